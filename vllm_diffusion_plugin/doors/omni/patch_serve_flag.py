"""Patch: ``--load-format diffusion-hsdp`` on ``vllm serve --omni`` reaches vllm-omni's diffusion workers.

Why. vllm-omni accepts ``--load-format`` under ``--omni`` and stores it in the stage's load config, then drops
it: ``build_diffusion_config`` keeps only the fields ``OmniDiffusionConfig`` declares (none is the load
format), and the diffusion model runner builds ``LoadConfig()`` (``load_format='auto'``). Without this patch
the flag does nothing, with or without the plugin. ``--model-loader-extra-config`` is refused under
``--omni``, so our options cannot travel that way either; ``additional_config`` does reach every worker.

How. ``vllm_omni.config.omni_config.extract_diffusion_stage_config_kwargs`` (the one place that turns a
stage's mixed engine arguments into ``OmniDiffusionConfig`` fields; ``build_diffusion_config`` and the
offline path import it from this module at call time) is wrapped. When the stage's ``load_format`` is
``diffusion-hsdp``, in the process that builds the stage (the API server, before any worker starts):

1. our options are parsed from ``additional_config["diffusion_hsdp"]`` (``serve_options.omni_options``:
   unknown keys / wrong types raise naming the key) and checked against vllm-omni's own options
   (``serve_options.check_supported``); every ``lora_path`` file is read and checked against its DiT's
   ``meta`` skeleton (``serve_options.check_lora_files``), as the workers will; the plan of the load is held
   against this node's available host memory (``preflight.check_host``);
2. vllm-omni's diffusion loader module is imported here and the worker-side units (``load-format``,
   ``postprocess``, ``load-path``) must be applied -- the same vllm-omni is installed for the workers, so a
   shape they would not recognize stops the server now (:class:`_patching.LoadFormatUnavailable`);
3. with ``lora_update_dirs`` (the runtime LoRA update): each is an existing directory, and the units that serve the
   update (``lora-update`` in the workers, ``lora-routes`` in the API server) are applied, else the server stops;
4. ``additional_config["diffusion_hsdp_load_format"] = "diffusion-hsdp"`` is added to the returned fields;
   ``patch_load_path`` reads it in each worker and gives vllm-omni's loader a load config with our format.

``diffusion_hsdp`` options without the flag are an error (they would otherwise be ignored). Any other load
format goes through untouched.

Versions. Recognized shape: ``extract_diffusion_stage_config_kwargs(kwargs, *, stage_id, ...)`` returning a
dict (tested on 0.30.0, 0.31.0rc1 and 0.32.0rc1). Unrecognized with the flag on the command line: the server stops at startup (``_patching``).

Remove when vllm-omni's ``OmniDiffusionConfig`` carries the stage's load format and load config to the
runner's ``LoadConfig(...)``.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni import lora_policy, patch_lora_routes, patch_lora_update
from vllm_diffusion_plugin.doors.omni._patching import (
    UnrecognizedShape,
    is_patched,
    mark,
    require_applied,
    require_attr,
    require_params,
)
from vllm_diffusion_plugin.engine.config import LOAD_FORMAT

logger = init_logger(__name__)

NAME = "serve-flag"
TARGET = "vllm_omni.config.omni_config"
FUNCTION = "extract_diffusion_stage_config_kwargs"
REQUIRED_BY_LOAD_FORMAT = True
WORKER_MODULE = "vllm_omni.diffusion.model_loader.diffusers_loader"
WORKER_UNITS = ("load-format", "postprocess", "load-path")


def apply(module: Any) -> str:
    where = f"{module.__name__}.{FUNCTION}"
    original = require_attr(module, FUNCTION, module.__name__)
    if is_patched(original):
        return "already applied"
    signature = require_params(original, ("kwargs",), where)
    if "stage_id" not in signature.parameters:
        raise UnrecognizedShape(f"{where}{signature} has no stage_id parameter")
    setattr(module, FUNCTION, mark(_wrap(original), unit=NAME, original=original))
    return "applied"


def _wrap(original):
    @functools.wraps(original)
    def extract_diffusion_stage_config_kwargs(kwargs, *args, **kw):
        result = original(kwargs, *args, **kw)
        return carry_load_format(kwargs.get("load_format"), result, stage=kwargs)

    return extract_diffusion_stage_config_kwargs


def carry_load_format(load_format: Any, diffusion_kwargs: dict[str, Any], *, stage: Any = None) -> dict[str, Any]:
    """``diffusion_kwargs`` (``OmniDiffusionConfig`` fields) with our load format carried, after every check;
    ``stage``: the stage's engine arguments they came from (vllm-omni's parallel options among them)."""
    from vllm_diffusion_plugin.doors.omni import preflight, serve_options

    additional = dict(diffusion_kwargs.get("additional_config") or {})
    ours = isinstance(load_format, str) and load_format.lower() == LOAD_FORMAT
    if not ours:
        if serve_options.OPTIONS_KEY in additional:
            raise ValueError(f"--additional-config key {serve_options.OPTIONS_KEY!r} is read only with "
                             f"--load-format {LOAD_FORMAT} (this stage's load format: {load_format!r})")
        return diffusion_kwargs
    options = serve_options.omni_options(additional)
    serve_options.check_supported(options, diffusion_kwargs)
    serve_options.check_lora_files(options, diffusion_kwargs)
    preflight.check_host(options, {**dict(stage or {}), **diffusion_kwargs})  # the node's host, before any worker
    _require_worker_units()
    if options.lora_update_dirs:
        _require_update_units(options.lora_update_dirs)
    additional[serve_options.CARRIED_KEY] = LOAD_FORMAT
    logger.info("--load-format %s: carried to vllm-omni's diffusion workers (hsdp_weight_load=%s, %d LoRA "
                "file(s))", LOAD_FORMAT, serve_options.weight_load_strategy(options, diffusion_kwargs),
                len(options.lora_path))
    return {**diffusion_kwargs, "additional_config": additional}


def _require_worker_units() -> None:
    importlib.import_module(WORKER_MODULE)  # runs the worker-side units here, as in every worker
    require_applied(WORKER_UNITS)


def _require_update_units(dirs) -> None:
    """``lora_update_dirs`` are existing directories, and the units of the runtime LoRA update are applied: the
    workers' method, and the API server's routes when this is the API server (an offline ``Omni(...)`` has none)."""
    lora_policy.allowed_dirs(dirs, origin="--additional-config diffusion_hsdp lora_update_dirs")
    importlib.import_module(patch_lora_update.TARGET)
    units = [patch_lora_update.NAME] + ([patch_lora_routes.NAME] if patch_lora_routes.TARGET in sys.modules else [])
    require_applied(units)
