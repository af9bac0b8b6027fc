"""The launcher (``doors.launcher.run_ranks``) with real spawned ranks in a real gloo group: a rank that dies of a
signal is named as the cause, with the signal, even when its peers' echo errors are written (issue 36, part 2)."""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest

from vllm_diffusion_plugin.doors.launcher import RankError, run_ranks


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
