"""The plan as a pre-flight: before the first weight byte, each rank's planned peak against what it has.

Every door plans the load it is about to run (``plan.plan_load``: headers and ``meta`` skeletons, no weight byte)
and holds it against what the ranks have:

- host: what this node has left (:func:`host_available`: the tighter of ``/proc/meminfo`` MemAvailable and the
  headroom of the process's memory cgroup, v1 or v2, at every level up to the mount's root), shared by the node's
  ranks: their host needs add up (``Plan.node_host_need``), plus what ranks not started yet will take before
  their load (their imports; ``starting``);
- accelerator: this rank's free memory (``platform.free_memory``; nothing on the CPU) against its device need.

A load that cannot fit is refused in one line (:class:`PreflightError`) that names the rank(s), the planned and the
available bytes, and the strategy that would fit or that none does, in ``plan``'s words (host peak, device peak,
fits, pick). ``preflight`` (extra-config key, ``VLLM_DIFFUSION_PREFLIGHT``, CLI ``--preflight``) set to ``warn``
logs the same line and loads; ``off`` plans nothing. Each door says how to set it (``how``).

The cgroup headroom is its limit minus its usage, the usage less the group's inactive file pages (page cache the
kernel reclaims before it kills; what ``MemAvailable`` counts as available too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_diffusion_plugin._logging import init_logger

logger = init_logger(__name__)

from vllm_diffusion_plugin.engine.config import PREFLIGHT_MODES as MODES  # noqa: F401  (refuse, warn, off)
_NO_LIMIT = 2**60
"""cgroup v1 reports "no limit" as the largest page-aligned long (~2**63); anything this large is none."""


class PreflightError(RuntimeError):
    """The planned load does not fit what a rank has; the message is the one line the door prints."""


@dataclass(frozen=True)
class HostMemory:
    """What this node has left for a load, and where the figure comes from."""

    available: int
    source: str
    """``MemAvailable`` or ``cgroup <path>: limit <bytes> - used <bytes>``."""


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat(path: Path, key: str) -> int:
    text = _read(path) or ""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def meminfo_available(root: Path = Path("/")) -> int | None:
    """``MemAvailable`` of ``root/proc/meminfo`` in bytes, None where unreadable."""
    for line in (_read(root / "proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _mounts(root: Path) -> list[tuple[str, str, str, str]]:
    """(mount root within its hierarchy, mount point, fs type, super options) of every cgroup mount."""
    found = []
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) >= 3 and after[0] in ("cgroup", "cgroup2"):
            found.append((fields[3], fields[4], after[0], after[2]))
    return found


def cgroup_headroom(root: Path = Path("/")) -> list[HostMemory]:
    """The headroom (limit - used) of every memory cgroup level this process is in that has a limit, from
    ``root/proc/self/cgroup`` and ``root/proc/self/mountinfo``: v1's ``memory`` controller
    (``memory.limit_in_bytes`` - ``memory.usage_in_bytes``) and v2's (``memory.max`` - ``memory.current``;
    ``max`` is no limit), used less ``inactive_file``. Empty where there is no limit or nothing is readable."""
    memberships = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            memberships.setdefault("v2", path)
        elif "memory" in controllers.split(","):
            memberships["v1"] = path
    found = []
    for mount_root, point, fstype, options in _mounts(root):
        version = "v2" if fstype == "cgroup2" else "v1" if "memory" in options.split(",") else None
        if version is None or version not in memberships:
            continue
        path = memberships[version]
        if path.startswith(mount_root.rstrip("/") + "/") or path == mount_root:
            path = path[len(mount_root.rstrip("/")):]
        base = root / point.lstrip("/")
        names = ("memory.max", "memory.current", "inactive_file") if version == "v2" else \
            ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        level = base / path.strip("/")
        while True:
            limit, used = _read(level / names[0]), _read(level / names[1])
            if limit is not None and used is not None and limit != "max" and limit.isdigit() and used.isdigit() \
                    and int(limit) < _NO_LIMIT:
                used_now = max(0, int(used) - _stat(level / "memory.stat", names[2]))
                found.append(HostMemory(max(0, int(limit) - used_now), f"cgroup {version} {level}: limit "
                                        f"{int(limit)} - used {used_now}"))
            if level == base or base not in level.parents:
                break
            level = level.parent
        if version == "v1":
            memberships.pop("v1")  # a hierarchy mounted twice counts once
    return found


def host_available(root: Path = Path("/")) -> HostMemory | None:
    """The tighter of MemAvailable and every memory cgroup headroom of this process (None: nothing readable)."""
    candidates = cgroup_headroom(root)
    available = meminfo_available(root)
    if available is not None:
        candidates.append(HostMemory(available, "MemAvailable"))
    return min(candidates, key=lambda h: h.available, default=None)


def private_rss(root: Path = Path("/")) -> int:
    """This process's anonymous resident bytes (``RssAnon``): what a rank started the same way holds before its
    load that other processes do not share (its libraries' pages they do)."""
    for line in (_read(root / "proc/self/status") or "").splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def size_text(n: int | None) -> str:
    """Bytes as ``plan`` prints them (``12.34 GiB``, ``512MB``)."""
    from vllm_diffusion_plugin.engine.report import human_count

    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{human_count(n)}B"


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


def plan_module_load(source, *, dtype, device_type: str, lora_files: Sequence[tuple[str, float]] = (),
                     ranks: int = 1, tensor_parallel: int = 1, chunk_mb: int = 256):
    """The plan of a load that streams one checkpoint folder into a model another framework builds whole on every
    rank (the vLLM loader door: ``full`` only), from its headers: every floating tensor at ``dtype``, divided
    over ``tensor_parallel`` ranks (vLLM's own split, near enough), allocated on the device (or the host), plus the
    LoRA files beside their factors (host) and one delta chunk (device). ``ranks``: this node's ranks (host)."""
    import math

    from vllm_diffusion_plugin.engine.plan import MIB, ComponentPlan, Plan, RankPlan

    size = dtype.itemsize if hasattr(dtype, "itemsize") else 2
    whole = sum(math.prod(t.shape) * (size if t.dtype.is_floating_point else t.dtype.itemsize)
                for t in source.tensors.values())
    read = sum(t.nbytes for t in source.tensors.values())
    held = -(-whole // max(1, tensor_parallel))
    lora = sum(Path(path).stat().st_size for path, _ in lora_files)
    chunk = min(chunk_mb * MIB, held) if lora else 0
    on_device = device_type != "cpu"
    host = 2 * lora + (0 if on_device else held + chunk)  # the files as read beside their factors, then the model
    device = held + chunk if on_device else None
    rows = tuple(RankPlan(rank, "full", "full", (ComponentPlan(source.name, read, held, device or host,
                                                                "lora_device_chunk_mb", chunk),),
                          read, host, device, device or held, host, 0 if on_device else held)
                 for rank in range(ranks))
    why = "the vLLM loader builds and loads its model on every rank"
    return Plan(str(source.folder), ranks, None, device_type, str(dtype).removeprefix("torch."), rows,
                {"broadcast": why, "rank_local": why})
