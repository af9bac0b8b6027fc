"""Patch: ``--load-format diffusion-hsdp`` survives vllm-omni's generic diffusion stage (pipelines without a deploy
YAML, e.g. ``QwenImagePipeline``).

Why. For a pipeline vllm-omni has no deploy YAML for, the server builds its one diffusion stage with
``StageConfigFactory.create_typed_default_diffusion``, whose ``_normalize_default_diffusion`` keeps only the
arguments ``OmniDiffusionConfig`` declares -- ``load_format`` is not one -- and hands them on as the stage's
overrides. The stage therefore reaches ``extract_diffusion_stage_config_kwargs`` (where ``patch_serve_flag``
carries our format to the workers) with no load format at all: the flag is silently dropped, and with
``--additional-config '{"diffusion_hsdp": ...}'`` the server stops ("read only with --load-format
diffusion-hsdp (this stage's load format: None)"). Wan2.2 has a deploy YAML and never takes this path.

How. ``vllm_omni.config.config_factory.StageConfigFactory._normalize_default_diffusion`` (a classmethod) is
wrapped: when the command line's ``load_format`` is ``diffusion-hsdp``, it is put back into the stage's
engine arguments it returns, so it travels as ``stage_0_load_format`` like any other stage override and
``patch_serve_flag`` sees it. Any other load format is left as vllm-omni drops it (its behaviour unchanged).

Versions. Recognized shape: ``_normalize_default_diffusion(cls, kwargs)`` as a classmethod returning
``(engine_args: dict, parallel_config, default_sampling_params, final_output_type)`` (0.30). Unrecognized with
the flag on the command line: the server stops at startup (``_patching``).

Remove when vllm-omni's generic diffusion stage keeps the stage's load format (or ``OmniDiffusionConfig``
declares one).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni._patching import UnrecognizedShape, is_patched, mark, require_attr, require_params

logger = init_logger(__name__)

NAME = "default-stage"
TARGET = "vllm_omni.config.config_factory"
OWNER = "StageConfigFactory"
METHOD = "_normalize_default_diffusion"
REQUIRED_BY_LOAD_FORMAT = True


def apply(module: Any) -> str:
    owner = require_attr(module, OWNER, module.__name__)
    where = f"{module.__name__}.{OWNER}.{METHOD}"
    original = require_attr(owner, METHOD, f"{module.__name__}.{OWNER}")
    if not isinstance(original, classmethod):
        raise UnrecognizedShape(f"{where} is not a classmethod ({type(original).__name__})")
    if is_patched(original.__func__):
        return "already applied"
    require_params(original, ("cls", "kwargs"), where)
    setattr(owner, METHOD, classmethod(mark(_wrap(original.__func__), unit=NAME, original=original.__func__)))
    return "applied"


def _wrap(original):
    @functools.wraps(original)
    def _normalize_default_diffusion(cls, kwargs, *args, **kw):
        result = original(cls, kwargs, *args, **kw)
        return keep_load_format(kwargs.get("load_format") if isinstance(kwargs, dict) else None, result)

    return _normalize_default_diffusion


def keep_load_format(load_format: Any, result: Any) -> Any:
    """``result`` (``_normalize_default_diffusion``'s tuple) with our ``load_format`` in its engine arguments."""
    from vllm_diffusion_plugin import LOAD_FORMAT

    if not (isinstance(load_format, str) and load_format.lower() == LOAD_FORMAT):
        return result
    if not (isinstance(result, tuple) and result and isinstance(result[0], dict)):
        raise UnrecognizedShape(f"{TARGET}.{OWNER}.{METHOD} returned {type(result).__name__}, not a tuple "
                                f"starting with the stage's engine arguments; --load-format {LOAD_FORMAT} "
                                f"cannot be kept for the generic diffusion stage")
    logger.debug("--load-format %s kept for vllm-omni's generic diffusion stage (no deploy YAML)", LOAD_FORMAT)
    return ({**result[0], "load_format": LOAD_FORMAT}, *result[1:])
