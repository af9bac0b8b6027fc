"""``patch_worker_death``'s account of dead diffusion workers, on real processes (the server-level proof, a worker
SIGKILLed while a real ``vllm serve --omni`` starts, is ``tests/serve/test_serve_faults.py``)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import signal
import time

import pytest

from vllm_diffusion_plugin.doors.omni import patch_worker_death as death


def _sleep() -> None:
    time.sleep(60)


def _fail() -> None:
    time.sleep(0.3)  # after its peer was killed, as a peer failing in a collective would
    os._exit(1)


@pytest.fixture
def remembered():
    start = multiprocessing.process.BaseProcess.start
    death._workers.clear()
    death._remember_workers()
    try:
        yield
    finally:
        multiprocessing.process.BaseProcess.start = start
        death._workers.clear()


def test_the_killed_worker_is_named_first_and_the_echo_after_it(remembered):
    ctx = multiprocessing.get_context("spawn")
    echo = ctx.Process(target=_fail, name="DiffusionWorker-0", daemon=True)
    victim = ctx.Process(target=_sleep, name="DiffusionWorker-1", daemon=True)
    other = ctx.Process(target=_sleep, name="not-a-worker", daemon=True)
    for p in (victim, other):
        p.start()
    os.kill(victim.pid, signal.SIGKILL)
    echo.start()
    try:
        line = death.describe_dead(settle_s=20.0)
    finally:
        other.kill()
    assert sorted(death._workers) == [0, 1]  # only vllm-omni's worker names are remembered
    assert line.startswith("diffusion worker rank 1 died of SIGKILL (out of memory or killed from outside); then "
                           "rank 0 exited with code 1"), line


def test_nothing_to_say_while_every_worker_lives(remembered):
    ctx = multiprocessing.get_context("spawn")
    alive = ctx.Process(target=_sleep, name="DiffusionWorker-0", daemon=True)
    alive.start()
    try:
        assert death.describe_dead(settle_s=0.5) is None
    finally:
        alive.kill()
        alive.join()


def _fail_recording(rank: int, delay_s: float) -> None:
    time.sleep(delay_s)
    death.record_error(rank, OSError(5, "/store/shard-3.safetensors: I/O error at byte 20480"))
    os._exit(1)


def test_a_worker_whose_load_raised_is_named_with_its_error(remembered):
    """Workers whose load raised record their error's first line for the starting process: the line carries it
    (same error on both ranks: said once) instead of ``rank 0 exited with code 1 (its error is above)``."""
    ctx = multiprocessing.get_context("spawn")
    errors = death.errors_dir(os.getpid())
    errors.mkdir(exist_ok=True)
    try:
        workers = [ctx.Process(target=_fail_recording, args=(rank, 0.2 * rank), name=f"DiffusionWorker-{rank}",
                               daemon=True) for rank in (0, 1)]
        for p in workers:
            p.start()
        line = death.describe_dead(settle_s=20.0, errors=errors)
    finally:
        import shutil

        shutil.rmtree(errors, ignore_errors=True)
    assert line.startswith("diffusion worker ranks 0, 1 failed: OSError: [Errno 5] /store/shard-3.safetensors: I/O "
                           "error at byte 20480 -- while the workers started"), line
    assert death.describe_dead(settle_s=0.0, errors=errors).startswith("diffusion worker rank 0 exited with code 1, "
                                                                        "rank 1 exited with code 1 (its error is above)")


def worker_main(rank: int, pipe_writer) -> None:  # the name and the argument vllm-omni's worker entry point has
    death.record_error(rank, OSError(5, "/store/shard-3.safetensors: I/O error at byte 20480"))
    time.sleep(60)  # as a worker whose read is stuck in its store: alive, its pipe open


def test_a_failing_worker_tells_the_starting_process_on_its_ready_pipe(remembered):
    """A worker whose load raised sends ``status: failed`` on its "ready" pipe: vllm-omni's starting process stops
    waiting for that rank at once -- before, it waited for the pipe's end, which never came while a read of the
    worker was stuck in its store (the server hung, seen). The worker that cannot end is let go: no longer joined
    at the server's exit."""
    ctx = multiprocessing.get_context("spawn")
    errors = death.errors_dir(os.getpid())
    errors.mkdir(exist_ok=True)
    reader, writer = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=worker_main, args=(0, writer), name="DiffusionWorker-0", daemon=True)
    try:
        worker.start()
        writer.close()
        assert reader.poll(60), "no word from the failing worker within 60 s"
        message = reader.recv()
        assert message == {"status": "failed", "error": "OSError: [Errno 5] /store/shard-3.safetensors: I/O error "
                                                         "at byte 20480"}, message
        assert worker.exitcode is None  # it still runs: the pipe's end would not have come
        assert death.let_go(grace_s=1.0) == []  # it could end: SIGTERM
        assert worker.exitcode == -signal.SIGTERM
    finally:
        import shutil

        worker.kill()
        shutil.rmtree(errors, ignore_errors=True)


def _stuck_in_store(path: str, marker: str) -> None:
    """A read of the file's last page held in the store, then an open of the file: it waits uninterruptibly for
    the page that read holds (as a peer rank of a server did)."""
    import threading

    fd = os.open(path, os.O_RDONLY)
    threading.Thread(target=os.pread, args=(fd, 1, os.fstat(fd).st_size - 1), daemon=True).start()
    while not os.path.exists(marker):
        time.sleep(0.05)
    os.open(path, os.O_RDONLY)


def test_a_worker_stuck_in_its_store_is_let_go_not_joined(remembered, tiny_wan_dir, tmp_path):
    """A worker held in a read its store never answers cannot end, SIGKILL or not: the server exits without it
    (multiprocessing joins its children at exit: the server hung there, seen)."""
    from fuse_store import faulty_store, wait_for

    shard = sorted((tiny_wan_dir / "transformer").glob("*.safetensors"))[2]
    ctx = multiprocessing.get_context("spawn")
    with faulty_store(tiny_wan_dir, tmp_path, shard, mode="stall") as (checkpoint, fault):
        worker = ctx.Process(target=_stuck_in_store, args=(str(checkpoint / "transformer" / shard.name),
                                                           str(fault.marker)), name="DiffusionWorker-1", daemon=True)
        worker.start()
        wait_for(fault.marker, timeout_s=60)
        time.sleep(1.0)  # its open() is under way
        assert death.let_go(grace_s=0.5) == [1]
        assert worker.exitcode is None and worker not in multiprocessing.active_children()
