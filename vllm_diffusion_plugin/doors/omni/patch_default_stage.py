"""Patch: ``--load-format diffusion-hsdp`` survives vllm-omni's default diffusion stage (no deploy YAML).

Why. A pipeline with a deploy YAML (Wan2.2) gets its stage's engine arguments from the YAML plus the command
line, load format included, and ``patch_serve_flag`` carries it from there. A pipeline without one (FLUX.1,
Z-Image, ... -- ``resolve_omni_config`` -> ``StageConfigFactory.create_typed_default_diffusion``) gets a
generic diffusion stage whose engine arguments come from ``StageConfigFactory._normalize_default_diffusion``,
which keeps only the fields ``OmniDiffusionConfig`` declares. ``load_format`` is not one: the stage's load
format is ``None``, our door stays shut, and ``--additional-config diffusion_hsdp`` is refused ("read only with
--load-format diffusion-hsdp") although the flag was given. Seen in a real ``vllm serve FLUX_DIR --omni``.

How. ``StageConfigFactory._normalize_default_diffusion`` (shared by the typed builder and the compatibility
builder ``create_default_diffusion``) is wrapped: when the incoming arguments' ``load_format`` is
``diffusion-hsdp``, the engine arguments it returns get ``load_format`` back, so the generic stage's engine
arguments hold it (``stage_0_load_format``) as a deploy YAML's would, and ``patch_serve_flag`` checks and
carries it to the workers. Any other load format is left as vllm-omni drops it (nothing changes for it).

Versions. Recognized shape: the classmethod ``_normalize_default_diffusion(cls, kwargs)`` returning
``(engine_args: dict, parallel_config, default_sampling_params, final_output_type)`` (tested on 0.30.0, 0.31.0rc1 and
0.32.0rc1).
Unrecognized with the flag on the command line: the server stops at startup (``_patching``).

Remove when vllm-omni's default diffusion stage keeps the load format (or ``OmniDiffusionConfig`` declares it).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni._patching import UnrecognizedShape, is_patched, mark, require_attr, require_params

logger = init_logger(__name__)

NAME = "default-stage"
TARGET = "vllm_omni.config.config_factory"
METHOD = "_normalize_default_diffusion"
REQUIRED_BY_LOAD_FORMAT = True


def apply(module: Any) -> str:
    where = f"{module.__name__}.StageConfigFactory"
    factory = require_attr(module, "StageConfigFactory", module.__name__)
    raw = require_attr(factory, METHOD, where)
    if not isinstance(raw, classmethod):
        raise UnrecognizedShape(f"{where}.{METHOD} is no longer a classmethod")
    original = raw.__func__
    if is_patched(original):
        return "already applied"
    require_params(original, ("cls", "kwargs"), f"{where}.{METHOD}")
    setattr(factory, METHOD, classmethod(mark(_wrap(original), unit=NAME, original=original)))
    return "applied"


def _wrap(original):
    @functools.wraps(original)
    def _normalize_default_diffusion(cls, kwargs, *args, **kw):
        result = original(cls, kwargs, *args, **kw)
        return keep_load_format(kwargs.get("load_format") if hasattr(kwargs, "get") else None, result)

    return _normalize_default_diffusion


def keep_load_format(load_format: Any, result: Any) -> Any:
    """``result`` (``_normalize_default_diffusion``'s) with our ``load_format`` in its engine arguments."""
    from vllm_diffusion_plugin.engine.config import LOAD_FORMAT

    if not (isinstance(load_format, str) and load_format.lower() == LOAD_FORMAT):
        return result
    if not (isinstance(result, tuple) and len(result) == 4 and isinstance(result[0], dict)):
        raise ValueError(f"--load-format {LOAD_FORMAT}: vllm-omni's default diffusion stage builder returned "
                         f"{type(result).__name__}, not the (engine_args, ...) this plugin knows (vllm-omni 0.30); "
                         f"the flag cannot reach the stage")
    engine_args = {**result[0], "load_format": LOAD_FORMAT}
    logger.debug("--load-format %s kept in vllm-omni's default diffusion stage", LOAD_FORMAT)
    return (engine_args, *result[1:])
