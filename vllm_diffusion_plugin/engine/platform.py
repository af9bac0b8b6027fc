"""Which accelerator this process uses, whether it really works, and per-device primitives.

``local_device()`` is a *lookup*: it names ``cuda:N`` / ``npu:N`` / ``xpu:N`` / ``<privateuse1>:N`` from
``LOCAL_RANK`` when such a backend is available. A lookup proves nothing, so anything that wants to move
data to the device asks ``usable_device(dev)``, which makes a tiny probe allocation and returns the device
only when that succeeds (cached per process; ``usable_device.cache_clear()`` forgets).

``torch_npu`` is imported lazily and only when ``torch.npu`` is not already present: installing it on a
host without Huawei's CANN breaks ``import torch``, so nothing here imports it at module import time.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vllm_diffusion_plugin._logging import init_logger

logger = init_logger(__name__)

_DIST_BACKENDS = {"cuda": "nccl", "npu": "hccl", "xpu": "xccl", "cpu": "gloo"}


def _npu_available() -> bool:
    if not hasattr(torch, "npu"):
        try:
            importlib.import_module("torch_npu")
        except Exception:  # ImportError, or a broken CANN install raising anything
            return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def _privateuse1_name() -> str | None:
    name = torch._C._get_privateuse1_backend_name()
    if name == "privateuseone":
        return None  # nothing registered
    module = getattr(torch, name, None)
    if module is None or not getattr(module, "is_available", lambda: False)():
        return None
    return name


def accelerator_type() -> str | None:
    """The device type of the available accelerator backend (cuda, npu, xpu, a PrivateUse1 name), or None."""
    if torch.cuda.is_available():
        return "cuda"
    if _npu_available():
        return "npu"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    return _privateuse1_name()


def local_rank() -> int:
    raw = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={raw!r} is not an integer") from None


def local_device() -> torch.device:
    """This process's accelerator (``<type>:LOCAL_RANK``), or ``cpu`` when no backend is available.

    A lookup only: the device may still be unusable (see ``usable_device``).
    """
    device_type = accelerator_type()
    if device_type is None:
        return torch.device("cpu")
    return torch.device(device_type, local_rank())


@functools.cache
def usable_device(device: torch.device | str) -> torch.device | None:
    """``device`` if a tiny allocation on it succeeds, else None. CPU is always usable.

    Cached per process and per device; call ``usable_device.cache_clear()`` to probe again.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return device
    try:
        torch.empty(1, device=device)
    except Exception as exc:  # driver errors, missing backend, invalid ordinal, OOM
        logger.info("Device %s is not usable (probe allocation failed: %s); using the CPU path.",
                    device, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    return device


def accelerator_of(modules) -> torch.device | None:
    """The one accelerator every materialized parameter of ``modules`` is on, else None (host, mixed, nothing)."""
    devices = {p.device for m in modules for p in m.parameters() if p.device.type != "meta"}
    return devices.pop() if len(devices) == 1 and next(iter(devices)).type != "cpu" else None


def dist_backend(device: torch.device | str) -> str:
    """The torch.distributed backend for ``device``: nccl, hccl, xccl or gloo.

    A PrivateUse1 backend's collective library is unknown here; it gets its registered backend name if it
    registered one under its own device type, else gloo.
    """
    # A string is parsed by hand: "npu:0" is no valid torch.device until torch_npu is imported.
    device_type = device.split(":")[0] if isinstance(device, str) else device.type
    if device_type in _DIST_BACKENDS:
        return _DIST_BACKENDS[device_type]
    registered = torch.distributed.Backend.default_device_backend_map.get(device_type)
    return registered or "gloo"


def _device_module(device: torch.device):
    return getattr(torch, device.type, None)


def synchronize(device: torch.device | str) -> None:
    """Wait for all work queued on ``device``; a no-op for CPU and for backends without the call."""
    device = torch.device(device)
    module = _device_module(device)
    if device.type == "cpu" or module is None or not hasattr(module, "synchronize"):
        return
    module.synchronize(device)


def empty_cache(device: torch.device | str) -> None:
    """Release cached allocator blocks on ``device``; a no-op for CPU and for backends without the call."""
    device = torch.device(device)
    module = _device_module(device)
    if device.type == "cpu" or module is None or not hasattr(module, "empty_cache"):
        return
    module.empty_cache()


# ---- asynchronous copies: page-locked host memory, a copy stream, events ------------------------------------
# Through ``torch.<device type>`` (``torch.cuda``, ``torch.npu`` once torch_npu is imported, ``torch.xpu``), which
# all name these calls alike; a backend module lacking one makes the caller fall back to synchronous copies.

def pinned_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` page-locked host bytes for asynchronous copies to ``device``; raises when they cannot be had.

    A backend module may provide its own ``pinned_empty(nbytes)`` (the test backend ``fakeacc`` does: a Python
    backend cannot register torch's pinned-memory allocator)."""
    allocate = getattr(_device_module(device), "pinned_empty", None)
    if allocate is not None:
        return allocate(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def new_stream(device: torch.device):
    """A new stream on ``device`` (for copies that overlap the work on its current stream)."""
    return _device_module(device).Stream(device=device)


def on_stream(device: torch.device, stream):
    """Context manager: work issued inside runs on ``stream``."""
    return _device_module(device).stream(stream)


def new_event(device: torch.device):
    return _device_module(device).Event()


def current_stream(device: torch.device):
    return _device_module(device).current_stream(device)


@dataclass(frozen=True)
class World:
    """This process's place in the job (one process when torch.distributed is not initialized)."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def current(cls) -> World:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()


def resolve_target_device(requested: str) -> torch.device:
    """``auto`` -> this process's accelerator when the probe says it works, else CPU; or the named type."""
    if requested == "auto":
        return usable_device(local_device()) or torch.device("cpu")
    if requested == "cpu":
        return torch.device("cpu")
    device = torch.device(requested, local_rank())
    if usable_device(device) is None:
        raise RuntimeError(f"--device {requested}: {device} is not usable on this host (probe allocation failed)")
    return device


def free_memory(device: torch.device | str) -> int | None:
    """Free bytes on ``device`` as its backend says (``torch.cuda.mem_get_info``, ``torch.npu.mem_get_info``, ...);
    None on the CPU and for a backend without the call (the fake accelerator)."""
    device = torch.device(device)
    module = _device_module(device)
    if device.type == "cpu" or module is None or not hasattr(module, "mem_get_info"):
        return None
    try:
        return int(module.mem_get_info(device)[0])
    except Exception as exc:  # a driver error: no figure, no refusal
        logger.info("Free memory of %s unknown (%s); the pre-flight skips it.", device, exc)
        return None
