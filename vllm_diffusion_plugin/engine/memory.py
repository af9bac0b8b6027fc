"""What this host, this process and an accelerator have, in bytes: the probe the pre-flight, the pressure watch,
the load report and the server samplers share, and how sizes are written (an accelerator's free memory:
``platform.free_memory``).

- host: :func:`host_available`, the tighter of ``/proc/meminfo`` MemAvailable and the headroom of every memory
  cgroup level of this process (v1 or v2), the usage less the group's inactive file pages (page cache the kernel
  reclaims before it kills, as ``MemAvailable`` counts it);
- a process: :func:`status_memory` (``/proc/PID/status``), :func:`private_rss`, :func:`peak_rss_bytes`;
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm_diffusion_plugin._logging import init_logger

logger = init_logger(__name__)

_NO_LIMIT = 2**60
"""cgroup v1 reports "no limit" as the largest page-aligned long (~2**63); anything this large is none."""


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


def status_memory(pid: int | str = "self") -> dict[str, int]:
    """The ``Vm*`` lines of ``/proc/PID/status`` in bytes (``VmRSS``, ``VmHWM``, ...); empty where unreadable
    (not Linux, or the process is gone)."""
    try:
        lines = open(f"/proc/{pid}/status").read().splitlines()
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in lines if line.startswith("Vm") and line.endswith(" kB"))
    return {key: int(value.split()[0]) * 1024 for key, value in fields}


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux: write ``5`` to ``/proc/self/clear_refs``); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def human_count(n: float) -> str:
    """A count in human units: ``950``, ``12.3K``, ``4.50M``, ``14.0B`` (parameters, tensors)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.3g}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{n:.0f}"


def size_text(n: int | None) -> str:
    """Bytes as ``plan`` prints them (``12.34 GiB``, ``512MB``)."""
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{human_count(n)}B"
