"""``CpuOmniPlatform``: vllm-omni diffusion serving on the CPU (development, tests, CI).

vllm-omni 0.30-0.32 ship platforms for CUDA, ROCm, NPU, XPU and MUSA only; on a CPU-only host it falls back to
``UnspecifiedOmniPlatform`` (0 devices) and ``vllm serve --omni`` stops at stage init. This platform is
vLLM's own ``CpuPlatform`` (gloo, ``device_type == "cpu"``) plus what vllm-omni's diffusion path asks of an
omni platform, each found by running a real server:

- a device count (each rank is one CPU "device"; see :func:`device_count`) and ``torch.device("cpu")``;
- no-op ``set_device`` / ``synchronize`` / ``empty_cache`` (vLLM's ``Platform.__getattr__`` answers None
  for names ``torch.cpu`` lacks, so a missing one fails as "'NoneType' object is not callable");
- memory figures: free/total from psutil (host RAM); each worker's RSS right before its model load, logged;
  the per-request peak (``max_memory_reserved`` / ``max_memory_allocated``) is the process's peak RSS, reset
  by ``reset_peak_memory_stats`` through Linux's ``/proc/self/clear_refs`` where the kernel allows it;
- diffusion attention through torch SDPA (:mod:`.attention`);
- the worker output thread without device streams (patch unit :mod:`.patch_output_stream`), and the
  ``torch.ops._C`` activation kernels vLLM's layers bind on a CPU (:mod:`.patch_activation_ops`), both
  installed when this platform is constructed, i.e. only in processes that resolved it.

It is a diffusion-only platform: vllm-omni's autoregressive and generation workers are refused by name.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

from vllm_diffusion_plugin import envs
from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni import _patching
from vllm_diffusion_plugin.engine.memory import reset_peak_rss, status_memory

logger = init_logger(__name__)

ATTENTION_BACKEND = "vllm_diffusion_plugin.doors.omni.cpu.attention.CpuSDPABackend"
SUPPORTED_ATTENTION = ("TORCH_SDPA", "SDPA")
"""Backend names a user may select explicitly (``--diffusion-attention-backend`` / attention config)."""
PATCH_UNITS = ("cpu.patch_output_stream", "cpu.patch_activation_ops")
VISIBLE_DEVICES_VAR = "VLLM_DIFFUSION_OMNI_CPU_VISIBLE_DEVICES"
"""Where vllm-omni writes a stage's device list (``device_control_env_var``). Not vLLM's
``CPU_VISIBLE_MEMORY_NODES``: rank numbers are not NUMA nodes."""


def device_count() -> int:
    """``VLLM_DIFFUSION_OMNI_CPU_DEVICES`` when > 0, else the CPUs this process may run on (at least 1)."""
    configured = envs.get("VLLM_DIFFUSION_OMNI_CPU_DEVICES")
    if configured > 0:
        return configured
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def peak_rss_bytes() -> int:
    """Peak resident set size since the last reset (``VmHWM``), or the current RSS where unreadable."""
    if peak := status_memory().get("VmHWM"):
        return peak
    import psutil

    return psutil.Process().memory_info().rss


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    """vLLM's ``CpuPlatform`` as a vllm-omni platform for diffusion pipelines (see the module docstring)."""

    _omni_enum = OmniPlatformEnum.OOT
    device_control_env_var = VISIBLE_DEVICES_VAR

    def __init__(self) -> None:
        super().__init__()
        _patching.install(PATCH_UNITS)

    # ---- workers ---------------------------------------------------------------------------------------
    @classmethod
    def get_diffusion_worker_cls(cls) -> str:
        # Called by vllm-omni's WorkerProc right before it starts its output thread: refuse to start a
        # worker whose thread would die on its first output (the server would hang until --init-timeout).
        require_patches_applied()
        return super().get_diffusion_worker_cls()

    @classmethod
    def init_diffusion_model_runner_runtime(cls, *args: Any, **kwargs: Any) -> None:
        # vllm-omni's runner calls this right before its load_model. vLLM's CPU memory figure ("Model loading
        # took X GiB") is the host's used memory, all workers together; this worker's own RSS is said here.

        logger.info("CPU platform: worker RSS before its model load: %d bytes", status_memory().get("VmRSS", 0))
        super().init_diffusion_model_runner_runtime(*args, **kwargs)

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        raise NotImplementedError("The vllm-diffusion-plugin CPU platform serves diffusion pipelines only; "
                                  "vllm-omni's autoregressive stages need a GPU/NPU platform.")

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        raise NotImplementedError("The vllm-diffusion-plugin CPU platform serves diffusion pipelines only; "
                                  "vllm-omni's generation stages need a GPU/NPU platform.")

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    # ---- attention -------------------------------------------------------------------------------------
    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend: str | None, head_size: int,
                                       allow_trtllm_default: bool = False) -> str:
        if selected_backend is not None and selected_backend.upper() not in SUPPORTED_ATTENTION:
            raise ValueError(f"The diffusion attention backend {selected_backend!r} does not run on the "
                             f"vllm-diffusion-plugin CPU platform; select TORCH_SDPA or none.")
        return ATTENTION_BACKEND

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    # ---- devices ---------------------------------------------------------------------------------------
    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return device_count()

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"The CPU platform cannot use device {device}")

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    # ---- memory ----------------------------------------------------------------------------------------
    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        import psutil

        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return cls.get_device_memory(device)[0]

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return cls.get_device_memory()[1]

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        import psutil

        return float(psutil.Process().memory_info().rss)

    @classmethod
    def reset_peak_memory_stats(cls, device: torch.types.Device | None = None) -> None:
        reset_peak_rss()

    @classmethod
    def max_memory_allocated(cls, device: torch.types.Device | None = None) -> int:
        return peak_rss_bytes()

    @classmethod
    def max_memory_reserved(cls, device: torch.types.Device | None = None) -> int:
        return peak_rss_bytes()


def require_patches_applied() -> None:
    """Import each CPU patch unit's target (vllm-omni's own module, about to be used anyway), which applies
    the unit, and raise unless every unit is applied."""
    import importlib

    units = [importlib.import_module(f"vllm_diffusion_plugin.doors.omni.{name}") for name in PATCH_UNITS]
    for unit in units:
        importlib.import_module(unit.TARGET)
    missing = _patching.not_applied(unit.NAME for unit in units)
    if missing:
        raise RuntimeError(f"vllm-omni {_patching.omni_version()}: the CPU platform needs its patch units, "
                           f"and these are not applied: {missing}. This vllm-omni is not one the CPU platform "
                           f"supports (tested: 0.30.0, 0.31.0rc1, 0.32.0rc1).")
