"""Patch: vllm-omni's diffusion workers answer the runtime LoRA update (``diffusion_hsdp_loras``).

Why. The API server reaches the diffusion workers only through vllm-omni's control RPCs: ``collective_rpc(method)``
broadcasts a method *name* to every worker, and the worker runs ``getattr(DiffusionWorker, name)`` (a callable is
refused: "Method must be str"). A worker has no method that swaps a fused LoRA set.

How. ``DiffusionWorker`` gets one method, ``diffusion_hsdp_loras(entries)``: ``lora_update.run`` on the pipeline its
model runner serves (what our load left there, ``lora_update.keep``), told whether vllm-omni runs it step by step
(``od_config.step_execution``). It never raises: the API server gets our answer, not vllm-omni's
error dict. Nothing else changes; a worker whose load was not ours answers "unsupported".

Versions. Recognized shape: ``vllm_omni.diffusion.worker.diffusion_worker`` with ``DiffusionWorker`` (its
``execute_model``) (0.30.0, 0.31.0rc1, 0.32.0rc1). Unrecognized: skipped with a warning; a
server whose ``lora_update_dirs`` is set then refuses to start (``patch_serve_flag``).

Remove when vllm-omni swaps a fused LoRA set of a sharded DiT itself.
"""

from __future__ import annotations

from typing import Any

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni._patching import SENTINEL, UnrecognizedShape, is_patched, require_attr
from vllm_diffusion_plugin.doors.omni.lora_policy import WORKER_METHOD

logger = init_logger(__name__)

NAME = "lora-update"
TARGET = "vllm_omni.diffusion.worker.diffusion_worker"


def apply(module: Any) -> str:
    worker = require_attr(module, "DiffusionWorker", module.__name__)
    require_attr(worker, "execute_model", f"{module.__name__}.DiffusionWorker")
    existing = getattr(worker, WORKER_METHOD, None)
    if existing is not None:
        if is_patched(existing):
            return "already applied"
        raise UnrecognizedShape(f"{module.__name__}.DiffusionWorker already has a `{WORKER_METHOD}`")
    method = _method()
    setattr(method, SENTINEL, NAME)  # a new method: nothing of vllm-omni's is wrapped (no ``__wrapped__``)
    setattr(worker, WORKER_METHOD, method)
    return "applied"


def _method():
    def diffusion_hsdp_loras(self, entries=None):
        from vllm_diffusion_plugin.doors.omni import lora_update

        runner = getattr(self, "model_runner", None)
        try:
            return lora_update.run(getattr(runner, "pipeline", None), entries,
                                   step_execution=bool(getattr(self.od_config, "step_execution", False)))
        except Exception as exc:  # noqa: BLE001 (a bug of ours: said, never vllm-omni's error dict)
            logger.exception("runtime LoRA update on this worker failed unexpectedly")
            return lora_update.answer(False, "failed", error=f"{type(exc).__name__}: {exc}")

    diffusion_hsdp_loras.__qualname__ = f"DiffusionWorker.{WORKER_METHOD}"
    return diffusion_hsdp_loras
