"""The launcher (``doors.launcher.run_ranks``) with real spawned ranks in a real gloo group: a rank that dies of a
signal is named as the cause, with the signal, even when its peers' echo errors are written (issue 36, part 2)."""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest

from vllm_diffusion_plugin.doors.cli.launcher import RankError, run_ranks


def _killed_in_a_collective(rank: int, world_size: int, workdir) -> None:
    """Rank 1 SIGKILLs itself between two collectives; rank 0's all-reduce then fails ("Connection reset by
    peer" or the like) and writes that echo."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{workdir / 'store'}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4))


@pytest.mark.multiproc
def test_a_rank_killed_mid_collective_is_named_with_its_signal_before_the_echo(tmp_path):
    """Before: ``rank 1 exited with code -9`` (no signal named) or, when rank 0's echo reached the work folder
    first, that echo alone -- the death lost."""
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_killed_in_a_collective, world_size=2, workdir=tmp_path)
    message = str(info.value)
    assert message.startswith("rank 1 died of SIGKILL (out of memory or killed from outside)"), message
    assert "\n" not in message
    assert time.monotonic() - started < 120  # generous: both ranks gone, the launcher back


def _to_the_end(rank: int, world_size: int, workdir) -> None:
    time.sleep(3.0)
    (workdir / f"done-rank{rank}").touch()


@pytest.mark.multiproc
def test_a_ctrl_c_while_the_ranks_are_spawned_stops_them_even_when_another_thread_takes_it(tmp_path, monkeypatch):
    """A SIGINT to the launcher while it spawns its ranks, taken by a thread other than the spawning one (torch
    starts one at import; here a plain thread, which has SIGINT unblocked): the launcher stops the ranks and raises
    KeyboardInterrupt. Before: the signal was discarded (the handler was SIG_IGN for the window and only the
    spawning thread blocked it) and the load ran to its end -- the CLI exited 0 after a Ctrl-C (seen in a full run
    of the suite beside another)."""
    import contextlib
    import threading

    from vllm_diffusion_plugin.doors.cli import launcher

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)  # started before the window: SIGINT unblocked there
    other.start()
    real = launcher.environment

    @contextlib.contextmanager
    def interrupted_while_spawning(values):
        with real(values):
            if values.get("TMPDIR", "").endswith("tmp-rank1"):
                os.kill(os.getpid(), signal.SIGINT)  # process-directed: the kernel picks a thread not blocking it
            yield

    monkeypatch.setattr(launcher, "environment", interrupted_while_spawning)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_ranks(_to_the_end, world_size=2, workdir=tmp_path)
    finally:
        stop.set()
    assert sorted(p.name for p in tmp_path.glob("done-rank*")) == []  # stopped, not run to their end
