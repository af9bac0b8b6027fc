"""Patch: ``vllm serve --omni`` gets ``/v1/diffusion_hsdp/loras`` when the operator allowed LoRA directories.

Why. Changing the fused LoRA set of a running server (``lora_update``) needs an HTTP route in vllm-omni's API server,
and like vLLM's own ``/v1/load_lora_adapter`` (present only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) it must not
exist unless the operator asked for it. Here one setting both enables and bounds it: ``lora_update_dirs`` in
``--additional-config '{"diffusion_hsdp": {...}}'`` (env ``VLLM_DIFFUSION_LORA_UPDATE_DIRS``), the directories LoRA
files may be read from. Unset: no route (404), nothing else changes.

How. ``vllm_omni.entrypoints.openai.api_server.build_openai_app`` (vLLM's ``build_app``, which vllm-omni's server calls
once to build its FastAPI app) is wrapped: with ``--load-format diffusion-hsdp`` and ``lora_update_dirs`` set, the
app it returns gets ``lora_routes.LoraRoutes``' router (``GET`` / ``POST /v1/diffusion_hsdp/loras``). The directories
were already checked before any worker started (``patch_serve_flag``).

Versions. Recognized shape: a module-level ``build_openai_app(args, ...)`` called by ``omni_run_server_worker``
(0.30.0, 0.31.0rc1, 0.32.0rc1). Unrecognized: skipped with a warning; a server whose ``lora_update_dirs`` is set then
refuses to start (``patch_serve_flag``).

Remove when vllm-omni offers a runtime update of a fused LoRA set (or a hook to add routes).
"""

from __future__ import annotations

import functools
import json
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
        app = original(args, *rest, **kwargs)
        add_routes(app, args)
        return app

    return build_openai_app


def update_dirs(args: Any) -> tuple[str, ...]:
    """The ``lora_update_dirs`` of a server started with ``args`` (vLLM's parsed command line): empty unless its load
    format is ours."""
    from vllm_diffusion_plugin import envs
    from vllm_diffusion_plugin.doors.omni import serve_options
    from vllm_diffusion_plugin.engine.config import LOAD_FORMAT

    if str(getattr(args, "load_format", "") or "").lower() != LOAD_FORMAT:
        if envs.is_set("VLLM_DIFFUSION_LORA_UPDATE_DIRS"):
            logger.warning("VLLM_DIFFUSION_LORA_UPDATE_DIRS is set, but this server's load format is not "
                           "%s: it has no runtime LoRA update", LOAD_FORMAT)
        return ()
    additional = getattr(args, "additional_config", None) or {}
    if isinstance(additional, str):
        additional = json.loads(additional)
    return serve_options.omni_options(additional).lora_update_dirs


def add_routes(app: Any, args: Any) -> bool:
    """``app`` gets the runtime LoRA update's routes when ``args`` enable them; whether it did."""
    from vllm_diffusion_plugin.doors.omni import lora_policy, lora_routes

    dirs = update_dirs(args)
    if not dirs:
        return False
    routes = lora_routes.LoraRoutes(lora_policy.allowed_dirs(dirs), dirs)
    app.include_router(routes.router())
    logger.warning("runtime LoRA update enabled: %s reads LoRA files from %s (lora_update_dirs); anyone who can "
                   "reach this server can change the LoRAs it serves", lora_routes.ROUTE, ", ".join(dirs))
    return True
