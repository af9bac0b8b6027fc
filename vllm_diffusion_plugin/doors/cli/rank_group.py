"""The process group of the CLI's ranks (spawned, or a ``torchrun`` world across nodes): joined with the collective
timeout, and a collective of it that fails said in one line -- what the ranks were exchanging, on which rank, after
how long, against which bound, and what that means of the peer.

A collective that fails says little by itself: gloo's ``Timed out waiting 5000ms for send operation to complete``
or ``Connection closed by peer [127.0.0.1]:40261`` names neither the exchange, nor the option that bounds it, nor the
rank that is gone. The launcher names a local rank that died of a signal (``doors/cli/launcher.py``); a rank on another
node, or one that stalls alive, is known here only by its silence, so this line says which of the two it looks like
and names the peer where there is only one.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import time
from collections.abc import Iterator

import torch

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.session import DistributedLoadError, dist_backend

logger = init_logger(__name__)

_WORDS = ("gloo", "nccl", "hccl", "Connection reset by peer", "Connection closed by peer", "Timed out waiting",
          "Broken pipe", "Socket Timeout")
"""What a failed collective's error says (for errors torch raises as a plain ``RuntimeError``)."""


def join(device: torch.device, *, collective_timeout_s: float, read_timeout_s: float,
         init_method: str | None = None) -> None:
    """Join the ranks' group (``torchrun``'s env:// rendezvous, or the spawned ranks' file store) with every
    collective bounded by ``collective_timeout_s``; one INFO line says both bounds."""
    import torch.distributed as dist

    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    if init_method is None:  # torchrun: its env:// rendezvous
        dist.init_process_group(dist_backend(device), timeout=timeout)
    else:  # spawned ranks: a file store, no port to pick and race for
        dist.init_process_group(dist_backend(device), init_method=init_method,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timeout)
    logger.info("Rank %d of %d joined the process group (%s): collective timeout %g s, read timeout %g s",
                dist.get_rank(), dist.get_world_size(), dist.get_backend(), collective_timeout_s, read_timeout_s)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective of the group failing (a peer gone, stalled or unreachable)."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(word in str(exc) for word in _WORDS)


def describe(what: str, exc: BaseException, *, waited_s: float, timeout_s: float) -> str:
    """One line for a failed collective of ``what`` on this rank (see the module doc)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    peer = f"rank {1 - rank}, its only peer," if world == 2 else "a peer rank"
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first)  # gloo's source line
    first = first.split(". This is typically caused")[0].rstrip(".")  # gloo's advice (and its emoji)
    head = (f"{what} failed on rank {rank} of {world} after {waited_s:.1f} s (collective timeout {timeout_s:g} s, "
            f"--collective-timeout / collective_timeout_s): ")
    if "Timed out" in first or "timeout" in first.lower() or waited_s >= 0.9 * timeout_s:
        why = (f"{peer} did not take part within the collective timeout: it stalled (alive, not answering: stuck "
               f"in a read, stopped, swapping) or cannot be reached; see that rank's log")
    else:
        why = f"{peer} closed its connection: it died (killed, out of memory, its node lost) or failed; see its error"
    return f"{head}{why}. {type(exc).__name__}: {first}"


@contextlib.contextmanager
def collectives(what: str, *, timeout_s: float) -> Iterator[None]:
    """Around work whose collectives exchange ``what``: a failed collective is raised as ``DistributedLoadError``
    in one line (:func:`describe`); any other error, and one a strategy already said, as it is."""
    import torch.distributed as dist

    started = time.monotonic()
    try:
        yield
    except DistributedLoadError:
        raise
    except Exception as exc:
        if not dist.is_initialized() or not is_collective_failure(exc):
            raise
        raise DistributedLoadError(describe(what, exc, waited_s=time.monotonic() - started,
                                            timeout_s=timeout_s)) from exc
