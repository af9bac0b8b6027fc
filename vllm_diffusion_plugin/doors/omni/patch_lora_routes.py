"""Patch: ``vllm serve --omni`` gets ``/v1/diffusion_hsdp/loras`` when the operator allowed LoRA directories.

Why. Changing the fused LoRA set of a running server (``lora_update``) needs an HTTP route in vllm-omni's API server,
and like vLLM's own ``/v1/load_lora_adapter`` (present only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) it must not
exist unless the operator asked for it. Here one setting both enables and bounds it: ``lora_update_dirs`` in
``--additional-config '{"diffusion_hsdp": {...}}'`` (env ``VLLM_DIFFUSION_LORA_UPDATE_DIRS``), the directories LoRA
files may be read from. Unset: no route (404), nothing else changes.

How. ``vllm_omni.entrypoints.openai.api_server.build_openai_app`` (vLLM's ``build_app``, which vllm-omni's server calls
once to build its FastAPI app) is wrapped: with ``--load-format diffusion-hsdp`` and ``lora_update_dirs`` set, the
app it returns gets ``lora_routes.LoraRoutes``' router (``GET`` / ``POST /v1/diffusion_hsdp/loras``,
``lora_routes.add_routes``). The directories were already checked before any worker started (``patch_serve_flag``).

Versions. Recognized shape: a module-level ``build_openai_app(args, ...)`` called by ``omni_run_server_worker``
(0.30.0, 0.31.0rc1, 0.32.0rc1). Unrecognized: skipped with a warning; a server whose ``lora_update_dirs`` is set then
refuses to start (``patch_serve_flag``).

Remove when vllm-omni offers a runtime update of a fused LoRA set (or a hook to add routes).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni._patching import is_patched, mark, require_attr, require_params

logger = init_logger(__name__)

NAME = "lora-routes"
TARGET = "vllm_omni.entrypoints.openai.api_server"
FUNCTION = "build_openai_app"


def apply(module: Any) -> str:
    original = require_attr(module, FUNCTION, module.__name__)
    if is_patched(original):
        return "already applied"
    require_params(original, ("args",), f"{module.__name__}.{FUNCTION}")
    require_attr(module, "omni_run_server_worker", module.__name__)
    setattr(module, FUNCTION, mark(_wrap(original), unit=NAME, original=original))
    return "applied"


def _wrap(original):
    @functools.wraps(original)
    def build_openai_app(args, *rest, **kwargs):
        from vllm_diffusion_plugin.doors.omni import lora_routes

        app = original(args, *rest, **kwargs)
        lora_routes.add_routes(app, args)
        return app

    return build_openai_app
