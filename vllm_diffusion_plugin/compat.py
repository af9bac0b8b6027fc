"""The vLLM internals this plugin uses, behind feature checks.

vLLM's loader internals move between releases. Everything the plugin takes from them goes through this
module, so a drift breaks one place with a message naming the vLLM version and the missing API, instead of
an ``ImportError`` deep inside a load. Checks are by feature (does the module/attribute exist), not by version
string. Every import is lazy: importing this module costs nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

TESTED_VLLM = ">=0.33.0,<0.34"


class VllmCompatError(RuntimeError):
    """A vLLM API this plugin needs is missing from the installed vLLM."""


def vllm_version() -> str:
    try:
        from vllm import __version__
    except ImportError:
        return "not installed"
    return __version__


def _require(module: str, attr: str, *, purpose: str) -> Any:
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise VllmCompatError(
            f"vLLM {vllm_version()} has no `{module}.{attr}` ({purpose}); vllm-diffusion-plugin is tested "
            f"with vllm{TESTED_VLLM}. ({type(exc).__name__}: {exc})"
        ) from exc


def _optional(module: str, attr: str) -> Any | None:
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def register_model_loader(load_format: str) -> Callable[[type], type]:
    """vLLM's ``@register_model_loader(name)`` decorator."""
    return _require("vllm.model_executor.model_loader", "register_model_loader",
                    purpose="registering the `diffusion-hsdp` load format")(load_format)


def base_model_loader() -> type:
    """vLLM's ``BaseModelLoader`` ABC."""
    return _require("vllm.model_executor.model_loader.base_loader", "BaseModelLoader",
                    purpose="the loader base class")


def initialize_model() -> Callable[..., Any]:
    """vLLM's ``initialize_model(vllm_config=..., model_config=..., prefix=...)``."""
    return _require("vllm.model_executor.model_loader.utils", "initialize_model",
                    purpose="building the model skeleton inside vLLM")


def quantize_method_base() -> type:
    """vLLM's ``QuantizeMethodBase`` (the type of every layer's ``quant_method``)."""
    return _require("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase",
                    purpose="finding quantized layers for post-load processing")


def require_finalize_layerwise_processing() -> Callable[..., Any]:
    """vLLM's ``finalize_layerwise_processing(model, model_config)``; call it only when online quant is in use
    (a vLLM without it cannot have left layers on ``meta``), so its absence then is an error."""
    return _require("vllm.model_executor.model_loader.reload.layerwise", "finalize_layerwise_processing",
                    purpose="materializing online-quant layers left on the meta device")


def is_deferred_attention_layer() -> Callable[[Any], bool]:
    """vLLM's ``is_deferred_attention_layer(module)`` (attention layers with their own post-load processing);
    on a vLLM without it, a predicate that is always False (no such layers exist there)."""
    found = _optional("vllm.model_executor.layers.attention", "is_deferred_attention_layer")
    return found if found is not None else (lambda layer: False)


_VLLM_PACKAGES = ("vllm", "vllm_omni")


def may_hold_vllm_layers(model: Any) -> bool:
    """Whether ``model`` can hold a vLLM layer or quant method: some module's class, or its ``quant_method``'s,
    derives from a class defined in vLLM or vllm-omni. A diffusers DiT holds none, and then vLLM's attention
    and quantization modules (seconds to import) need not be imported to know that none of them is there."""
    for module in model.modules():
        for obj in (module, getattr(module, "quant_method", None)):
            if obj is not None and any(cls.__module__.split(".")[0] in _VLLM_PACKAGES
                                       for cls in type(obj).__mro__):
                return True
    return False


def register_env_vars(names: list[str]) -> bool:
    """Add our variable names to vLLM's env registry so it does not warn about unknown ``VLLM_*`` variables.

    Returns False (and changes nothing) when this vLLM has no such registry.
    """
    import os

    registry = _optional("vllm.envs", "environment_variables")
    if not isinstance(registry, dict):
        return False
    for name in names:
        registry.setdefault(name, lambda name=name: os.environ.get(name))
    return True


def configure_vllm_logging() -> None:
    """Apply vLLM's default logging configuration in this process (vLLM does it lazily in its engine; a
    standalone command must ask). Honours ``VLLM_LOGGING_LEVEL``/``VLLM_LOGGING_STREAM``/``VLLM_CONFIGURE_LOGGING``.

    Where ``vllm.config`` is not imported yet (the CLI), vLLM's bootstrap configuration from those variables
    is applied (``vllm.logger._configure_vllm_root_logger()``: the same handler and format): its
    ``LoggingConfig`` lives in ``vllm.config``, whose import pulls in vLLM's quantization layers and every
    config (seconds). A vLLM without that function gets the ``LoggingConfig`` path."""
    import sys

    bootstrap = _optional("vllm.logger", "_configure_vllm_root_logger")
    if bootstrap is not None and "vllm.config" not in sys.modules:
        bootstrap()
        return
    configure = _optional("vllm.logger", "configure_logging_if_needed")
    config_cls = _optional("vllm.config.logging", "LoggingConfig")
    if configure is not None and config_cls is not None:
        configure(config_cls())


def maybe_retie_word_embeddings() -> Callable[..., Any] | None:
    """vLLM's ``maybe_retie_word_embeddings(model, model_config)`` (reclaims an lm_head equal to the
    embeddings), run by vLLM's own post-load processing; None on a vLLM without it."""
    return _optional("vllm.model_executor.model_loader.weight_tying", "maybe_retie_word_embeddings")
