"""Patch: ``--load-format diffusion-hsdp`` survives vllm-omni's default diffusion stage (pipelines without a
deploy YAML, e.g. Z-Image).

Why. For a diffusion pipeline with no stage/deploy YAML of its own, vllm-omni 0.30 builds the single stage from
the CLI arguments in ``StageConfigFactory._normalize_default_diffusion`` (``config/config_factory.py``), which
keeps only the arguments ``OmniDiffusionConfig`` declares -- the load format is not one of them -- and turns
those into the stage's ``stage_0_*`` overrides. The load format is gone before
``extract_diffusion_stage_config_kwargs`` runs, so ``patch_serve_flag`` sees ``load_format=None`` and (rightly)
refuses our ``--additional-config diffusion_hsdp`` options; without options the flag would be silently ignored.
Seen with ``vllm serve Z-IMAGE-DIR --omni --load-format diffusion-hsdp``. Pipelines with a deploy YAML (Wan2.2)
take another path and keep the flag.

How. ``StageConfigFactory._normalize_default_diffusion`` is wrapped: when its ``kwargs`` carry our load format,
``load_format`` is put back into the engine arguments it returns, so it becomes the stage's ``load_format``
override as on the deploy-YAML path, and ``patch_serve_flag`` checks and carries it from there. Any other load
format goes through untouched.

Versions. Recognized shape: ``StageConfigFactory._normalize_default_diffusion(cls, kwargs)`` (a classmethod)
returning a 4-tuple whose first item is the engine-argument dict (0.30). Unrecognized with the flag on the
command line: the server stops at startup (``_patching``).

Remove when vllm-omni's default diffusion stage keeps the CLI load format (or ``OmniDiffusionConfig`` declares it).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni._patching import UnrecognizedShape, is_patched, mark, require_attr, require_params

logger = init_logger(__name__)

NAME = "default-stage"
TARGET = "vllm_omni.config.config_factory"
CLASS, METHOD = "StageConfigFactory", "_normalize_default_diffusion"
REQUIRED_BY_LOAD_FORMAT = True


def apply(module: Any) -> str:
    where = f"{module.__name__}.{CLASS}"
    factory = require_attr(module, CLASS, module.__name__)
    static = require_attr(factory, METHOD, where)
    if not isinstance(static, classmethod):
        raise UnrecognizedShape(f"{where}.{METHOD} is not a classmethod ({type(static).__name__})")
    original = static.__func__
    if is_patched(original):
        return "already applied"
    require_params(original, ("cls", "kwargs"), f"{where}.{METHOD}")
    if "tuple[" not in str(inspect.signature(original).return_annotation):
        raise UnrecognizedShape(f"{where}.{METHOD} no longer returns a tuple")
    setattr(factory, METHOD, classmethod(mark(_wrap(original), unit=NAME, original=original)))
    return "applied"


def _wrap(original):
    @functools.wraps(original)
    def _normalize_default_diffusion(cls, kwargs, *args, **kw):
        result = original(cls, kwargs, *args, **kw)
        return keep_load_format(kwargs, result)

    return _normalize_default_diffusion


def keep_load_format(kwargs: Any, result: Any) -> Any:
    """``result`` with our load format from ``kwargs`` put back into its engine arguments (``result[0]``)."""
    from vllm_diffusion_plugin import LOAD_FORMAT

    load_format = kwargs.get("load_format") if hasattr(kwargs, "get") else None
    if not (isinstance(load_format, str) and load_format.lower() == LOAD_FORMAT):
        return result
    if not (isinstance(result, tuple) and result and isinstance(result[0], dict)):
        raise TypeError(f"{CLASS}.{METHOD} returned {type(result).__name__}, not (engine arguments, ...): "
                        f"--load-format {LOAD_FORMAT} cannot be carried by this vllm-omni")
    logger.debug("--load-format %s kept in vllm-omni's default diffusion stage", LOAD_FORMAT)
    return ({**result[0], "load_format": load_format}, *result[1:])
