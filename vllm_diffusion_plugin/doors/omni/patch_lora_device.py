"""Patch: vllm-omni's distilled-LoRA fusion computes deltas where our probe-based device rule says.

Why. vllm-omni fuses distilled LoRAs (``--lora-backend distill``) into CPU-resident weights before HSDP
sharding. ``_resolve_lora_compute_device`` (0.30) asks vllm-omni's platform for the local device and probes
it; that lookup knows only the platforms vllm-omni ships, and a failing H2D copy or device matmul inside
``_prepare_lora_delta`` (OOM, driver error) is not caught: the load crashes.

How. In ``vllm_omni.diffusion.lora.loader``, and in every loaded ``vllm_omni`` module that imported the
names:

- ``_resolve_lora_compute_device`` becomes ``vllm_diffusion_plugin.engine.lora.fuse.resolve_compute_device``: the
  accelerator named by ``LOCAL_RANK`` (CUDA, NPU, XPU, a PrivateUse1 backend) only if a probe allocation on
  it succeeds (cached per process), else None. vllm-omni calls it once per ``load_lora_into_module`` /
  ``unload_module_lora`` call, outside the parameter loop.
- ``_prepare_lora_delta`` is wrapped: when the delta for one tensor fails on the accelerator with a
  ``RuntimeError`` (``torch.OutOfMemoryError`` included), it is computed again on the CPU, with one warning
  per load/unload call. A failure that the CPU repeats is raised as is.

Versions. Recognized shape: ``_resolve_lora_compute_device()`` and ``_prepare_lora_delta(..., compute_device)``
(tested on 0.30.0, 0.31.0rc1 and 0.32.0rc1). 0.28 computes every delta on the CPU and has no such hook: skipped with a warning (its loop would
have to be replaced). 0.22-0.26 (checked) have no ``vllm_omni.diffusion.lora.loader`` (no distilled-LoRA
fusion): nothing to patch, nothing logged.

Remove when vllm-omni's resolver covers every accelerator this plugin supports and ``_prepare_lora_delta``
falls back to the CPU on device failures.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni._patching import (
    UnrecognizedShape,
    is_patched,
    mark,
    rebind,
    require_attr,
    require_params,
)

logger = init_logger(__name__)

NAME = "lora-device"
TARGET = "vllm_omni.diffusion.lora.loader"

_calls = threading.local()
"""Per thread: whether the current load/unload call (one resolver call each) has warned about a fallback."""


def apply(module: Any) -> str:
    where = module.__name__
    resolver = require_attr(module, "_resolve_lora_compute_device", where)
    prepare = require_attr(module, "_prepare_lora_delta", where)
    if is_patched(resolver) and is_patched(prepare):
        return "already applied"
    resolver_sig = require_params(resolver, (), f"{where}._resolve_lora_compute_device")
    if any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
           for p in resolver_sig.parameters.values()):
        raise UnrecognizedShape(f"{where}._resolve_lora_compute_device{resolver_sig} takes required arguments")
    signature = require_params(prepare, ("lora_state_dict", "base_key"), f"{where}._prepare_lora_delta")
    if "compute_device" not in signature.parameters:
        raise UnrecognizedShape(f"{where}._prepare_lora_delta{signature} has no compute_device parameter")
    rebound = []
    if not is_patched(resolver):
        rebound += rebind(resolver, mark(_probe_based_resolver(resolver), unit=NAME, original=resolver))
    if not is_patched(prepare):
        rebound += rebind(prepare, mark(_with_cpu_fallback(prepare, signature), unit=NAME, original=prepare))
    logger.debug("LoRA device patch rebound %s", ", ".join(rebound))
    return "applied"


def _probe_based_resolver(original):
    def _resolve_lora_compute_device():
        """Our probe-based rule (``lora.fuse.resolve_compute_device``); starts a new load/unload call."""
        from vllm_diffusion_plugin.engine.session import resolve_compute_device

        _calls.warned = False
        device = resolve_compute_device()
        logger.debug("vllm-omni LoRA fusion: compute device %s for CPU-resident weights", device or "cpu")
        return device

    _resolve_lora_compute_device.__module__ = original.__module__
    return _resolve_lora_compute_device


def _with_cpu_fallback(original, signature: inspect.Signature):
    @functools.wraps(original)
    def _prepare_lora_delta(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        device = bound.arguments.get("compute_device")
        if device is None or device.type == "cpu":
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        except RuntimeError as exc:  # torch.OutOfMemoryError, driver/runtime errors of the H2D copy or matmul
            if not getattr(_calls, "warned", False):
                _calls.warned = True
                logger.warning("LoRA delta for %s failed on %s (%s: %s); computing it on the CPU (later "
                               "failures in this load/unload call fall back without a warning)",
                               bound.arguments["base_key"], device, type(exc).__name__,
                               str(exc).splitlines()[0] if str(exc) else "")
            bound.arguments["compute_device"] = None
            return original(*bound.args, **bound.kwargs)

    return _prepare_lora_delta
