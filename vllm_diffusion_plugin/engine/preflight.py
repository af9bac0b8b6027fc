"""The plan as a pre-flight: before the first weight byte, each rank's planned peak against what it has.

Every door plans the load it is about to run (``plan.plan_load``, ``plan.plan_module_load``: headers and ``meta``
skeletons, no weight byte) and holds it against what the ranks have (``memory``): the host memory this node has
left, shared by its ranks -- their host needs add up (``Plan.node_host_need``), plus what ranks not started yet
take before their load (their imports; ``starting``) -- and each rank's free accelerator memory.

A load that cannot fit is refused in one line (:class:`~vllm_diffusion_plugin.engine.errors.PreflightError`) naming
the rank(s), the planned and the available bytes, and the strategy that would fit or that none does, in ``plan``'s
words. ``preflight`` set to ``warn`` logs the same line and loads; ``off`` plans nothing. Each door says how to set
it (``how``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine import memory, platform
from vllm_diffusion_plugin.engine.config import PREFLIGHT_MODES as MODES  # noqa: F401  (refuse, warn, off)
from vllm_diffusion_plugin.engine.errors import PreflightError
from vllm_diffusion_plugin.engine.memory import HostMemory, size_text

logger = init_logger(__name__)


def _fitting(plan, *, strategies: Sequence[str] | None, first_run: bool) -> str:
    usable = [s for s in (strategies or ("full", "broadcast", "rank_local"))
              if s not in plan.unavailable and plan.fits(s, first_run=first_run)]
    pick = plan.pick(first_run=first_run)
    pick = pick if pick in usable else (usable[0] if usable else None)
    return f"fits: {', '.join(usable)} (pick: {pick})" if usable else "fits: none (pick: none fits)"


def _ranks_text(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {ranks[0]}-{ranks[-1]}" if list(ranks) == list(range(ranks[0], ranks[-1] + 1)) else \
        f"ranks {', '.join(map(str, ranks))}"


def check_host(plan, strategy: str, *, host: HostMemory | None, starting: int = 0,
               strategies: Sequence[str] | None = None, first_run: bool = True) -> str | None:
    """Why ``strategy`` does not fit the host (one line), or None. ``starting``: bytes the node's ranks not yet
    started will hold before their load (their imports); ``strategies``: those this door can run; ``first_run``:
    the first run's all-gather counts on a CPU (a server warms up; the CLI's load runs nothing)."""
    if host is None or strategy in plan.unavailable:
        return None
    room = max(0, host.available - starting)
    need, ranks = plan.node_host_need(strategy, first_run=first_run)
    if need <= room:
        return None
    fitted = dataclasses.replace(plan, host_memory=room, device_memory=None)
    each = f" ({len(ranks)} ranks of this node together)" if len(ranks) > 1 else ""
    before = f" ({size_text(host.available)} less {size_text(starting)} the ranks' imports take)" if starting \
        else ""
    return (f"hsdp_weight_load={strategy!r} does not fit {_ranks_text(ranks)}'s host: host peak "
            f"{size_text(need)}{each} > {size_text(room)} available{before} [{host.source}]; "
            f"{_fitting(fitted, strategies=strategies, first_run=first_run)}")


def check_device(plan, strategy: str, *, rank: int, free: int | None,
                 strategies: Sequence[str] | None = None) -> str | None:
    """Why ``strategy`` does not fit ``rank``'s accelerator with ``free`` bytes (one line), or None."""
    if free is None or strategy in plan.unavailable:
        return None
    rows = [r for r in plan.ranks if r.strategy == strategy and r.rank == rank]
    need = plan.device_need(rows[0]) if rows else None
    if need is None or need <= free:
        return None
    fitted = dataclasses.replace(plan, host_memory=None, device_memory=free)
    return (f"hsdp_weight_load={strategy!r} does not fit rank {rank}'s accelerator: device peak {size_text(need)} "
            f"> {size_text(free)} free; {_fitting(fitted, strategies=strategies, first_run=True)}")


def enforce(problems: Sequence[str | None], *, mode: str, how: str) -> None:
    """Refuse (``mode`` ``refuse``: :class:`PreflightError`) or warn about the first problem; ``how``: how this
    door's user sets ``preflight`` to ``warn`` (named in the line)."""
    problem = next((p for p in problems if p), None)
    if problem is None or mode == "off":
        return
    if mode == "warn":
        logger.warning("pre-flight: %s; loading anyway (preflight='warn')", problem)
        return
    raise PreflightError(f"pre-flight: {problem}. Nothing was read; to load anyway: {how}")


def check(plan, strategy: str, *, mode: str, how: str, host: bool = False, device: torch.device | None = None,
          rank: int = 0, starting: int = 0, first_run: bool = True, strategies: Sequence[str] | None = None,
          before_verdict: Callable[[], None] | None = None) -> None:
    """The pre-flight every door runs: this node's host memory (``host``) and ``device``'s free memory measured,
    ``before_verdict()`` called (the vLLM door waits for its peers there, so that none counts another's model as
    taken), then the first problem refused or warned about (:func:`enforce`; ``mode``), else the host fit said in one
    INFO line. ``starting``: bytes this node's ranks not yet started will hold before their load; ``first_run``: the
    first run's all-gather counts on a CPU (a server warms up; the CLI's load runs nothing)."""
    if mode == "off":
        return
    started = time.perf_counter()
    available = memory.host_available() if host else None
    free = platform.free_memory(device) if device is not None and device.type == plan.device_type else None
    if before_verdict is not None:
        before_verdict()
    problems = [check_host(plan, strategy, host=available, starting=starting, first_run=first_run,
                           strategies=strategies) if host else None,
                check_device(plan, strategy, rank=rank, free=free, strategies=strategies)]
    enforce(problems, mode=mode, how=how)
    if host:
        need, ranks = plan.node_host_need(strategy, first_run=first_run)
        logger.info("pre-flight: hsdp_weight_load=%r on %d rank(s) of this node: host peak %s (%s before their loads) "
                    "of %s available (%s; %.2f s)", strategy, len(ranks), size_text(need + starting),
                    size_text(starting), size_text(available.available if available else None),
                    available.source if available else "-", time.perf_counter() - started)


