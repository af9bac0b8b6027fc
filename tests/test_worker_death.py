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
