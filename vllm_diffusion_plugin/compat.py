"""The vLLM internals this plugin uses, behind feature checks.

vLLM's loader internals move between releases. Everything the plugin takes from them goes through this
module, so a drift breaks one place with a message naming the vLLM version and the missing API, instead of
an ``ImportError`` deep inside a load. Checks are by feature (does the module/attribute exist), not by version
string. Every import is lazy: importing this module costs nothing.

What drifts within the supported range (vLLM 0.30-0.34), and the shim that serves each version:

- attention post-load hook: ``process_weights_after_loading(act_dtype)`` on 0.30-0.33, ``()`` on 0.34
  (``post_load_hook_takes_act_dtype`` / ``run_post_load_hook``, by signature);
- which modules' own post-load hooks vLLM runs: the deferred attention layers and the model on 0.30-0.33,
  every module children first on 0.34 (``post_load_hooks_on_every_module`` / ``post_load_hook_modules``, by
  the presence of ``weight_utils.finalize_model_weights``);
- ``record_checkpoint_layout_for_direct_reload``: 0.34's ``VLLM_RELOAD_MODE=direct`` bookkeeping, before
  post-load processing; nothing to do on 0.30-0.33 (no direct reload);
- ``configure_vllm_logging``: a no-op on 0.30 (no ``configure_logging_if_needed`` / ``LoggingConfig``);
- ``BaseModelLoader.get_all_weights`` (0.34 in-place reload) needs no shim: ``DiffusionHSDPLoader`` defines
  it, and older vLLMs never call it.
Everything else taken from vLLM here has the same name and signature in 0.30-0.34 (read from the wheels).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

TESTED_VLLM = ">=0.30.0,<0.35"
"""The vLLM releases this plugin is tested with: 0.30 (with vllm-omni 0.30) and 0.34, the two ends."""


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


def detach_layerwise_processing(layer: Any) -> bool:
    """Undo vLLM's online-quant layerwise wrapping of ``layer`` (``initialize_online_processing``): each
    parameter's ``weight_loader`` back to the one it wrapped, the layer's loading record reset (so neither a load
    nor ``finalize_layerwise_processing`` processes it). For loads that quantize the layer themselves
    (``engine.quant.online`` under ``rank_local``). False when this vLLM has no layerwise machinery."""
    records = _optional("vllm.model_executor.model_loader.reload.layerwise", "LAYERWISE_INFO")
    if records is None:
        return False
    for param in layer.parameters(recurse=False):
        loader = getattr(param, "weight_loader", None)
        while loader is not None and getattr(loader, "__name__", "") == "online_process_loader":
            loader = loader.__wrapped__
        if loader is not None:
            param.weight_loader = loader
    info = records.get(layer)
    if info is not None:
        info.reset()  # load_numel_total back to None: can_load() is False
    return True


def is_deferred_attention_layer() -> Callable[[Any], bool]:
    """vLLM's ``is_deferred_attention_layer(module)`` (attention layers with their own post-load processing);
    on a vLLM without it, a predicate that is always False (no such layers exist there)."""
    found = _optional("vllm.model_executor.layers.attention", "is_deferred_attention_layer")
    return found if found is not None else (lambda layer: False)


_VLLM_PACKAGES = ("vllm", "vllm_omni")


def may_hold_vllm_layers(model: Any) -> bool:
    """Whether ``model`` can hold a vLLM layer or quant method: some module carries a ``quant_method`` (whatever
    its class: vLLM decides by ``isinstance(..., QuantizeMethodBase)``, which an ABC registration satisfies with
    no vLLM class in the method's MRO), or some module's class derives from a class defined in vLLM or vllm-omni.
    A diffusers DiT has neither, and then vLLM's attention and quantization modules (seconds to import) need not
    be imported to know that none of them is there. A pre-quantized checkpoint's FP8 layers (``engine.quant.layer``,
    ``serialized``: nothing to process after loading) do not count."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not getattr(method, "serialized", False):
            return True
        if any(cls.__module__.split(".")[0] in _VLLM_PACKAGES for cls in type(module).__mro__):
            return True
    return False


def post_load_hooks_on_every_module() -> bool:
    """Whether vLLM's post-load processing runs *every* module's ``process_weights_after_loading()`` hook,
    children first (vLLM 0.34+: ``weight_utils.finalize_model_weights``), rather than only the deferred
    attention layers' and the root model's (vLLM 0.30-0.33)."""
    return _optional("vllm.model_executor.model_loader.weight_utils", "finalize_model_weights") is not None


def post_load_hook_modules(model: Any) -> Iterator[tuple[str, Any]]:
    """The ``(name, module)`` pairs whose own ``process_weights_after_loading`` hook vLLM's post-load
    processing runs, in vLLM's order.

    vLLM 0.34+ (``finalize_model_weights``): every module with a callable hook, each after all of its
    submodules, a module shared by several parents once; the submodules of a layer with a ``quant_method``
    and quant methods themselves are left to the quant method. vLLM 0.30-0.33: the deferred attention layers
    (``is_deferred_attention_layer``) in module order, then the root model.
    """
    if not post_load_hooks_on_every_module():
        is_attention = is_deferred_attention_layer()
        yield from ((n, m) for n, m in model.named_modules() if is_attention(m))
        if callable(getattr(model, "process_weights_after_loading", None)):
            yield "", model
        return
    quant_base = quantize_method_base()
    seen: set[int] = set()

    def children_first(name: str, module: Any) -> Iterator[tuple[str, Any]]:
        if not isinstance(getattr(module, "quant_method", None), quant_base):
            for child_name, child in module.named_children():
                if id(child) not in seen:
                    seen.add(id(child))
                    yield from children_first(f"{name}.{child_name}" if name else child_name, child)
        yield name, module

    for name, module in children_first("", model):
        if not isinstance(module, quant_base) and callable(getattr(module, "process_weights_after_loading", None)):
            yield name, module


def record_checkpoint_layout_for_direct_reload(model: Any) -> bool:
    """vLLM 0.34 with ``VLLM_RELOAD_MODE=direct``: record each tensor's checkpoint layout before post-load
    processing (``reload.direct.record_checkpoint_layout``), as vLLM's own post-load processing does, so a
    later direct in-place reload can write checkpoint bytes back. Returns whether it recorded (False on a
    vLLM without direct reload, or with it off)."""
    enabled = _optional("vllm.model_executor.model_loader.reload.direct", "direct_reload_enabled")
    record = _optional("vllm.model_executor.model_loader.reload.direct", "record_checkpoint_layout")
    if enabled is None or record is None or not enabled():
        return False
    record(model)
    return True


def post_load_hook_takes_act_dtype(module: Any, *, name: str) -> bool:
    """Whether ``module.process_weights_after_loading`` takes the activation dtype: ``(self, act_dtype)``
    (vLLM 0.29-0.33 attention layers) or ``(self)`` (vLLM 0.34 attention layers, every other module hook)."""
    try:
        params = [p for p in inspect.signature(module.process_weights_after_loading).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):  # no introspectable signature: call it as vLLM 0.34 does
        return False
    if len(params) > 1:
        raise VllmCompatError(
            f"vLLM {vllm_version()}: {type(module).__name__}.process_weights_after_loading of layer "
            f"{name or '<root>'} takes ({', '.join(p.name for p in params)}); vllm-diffusion-plugin knows the "
            f"forms () (vLLM 0.34) and (act_dtype) (vLLM 0.30-0.33) and is tested with vllm{TESTED_VLLM}")
    return bool(params)


def run_post_load_hook(module: Any, act_dtype: Any, *, name: str) -> None:
    """Call ``module.process_weights_after_loading`` in the form this vLLM defines (see
    ``post_load_hook_takes_act_dtype``); ``act_dtype`` None where the hook needs one is an error."""
    if not post_load_hook_takes_act_dtype(module, name=name):
        module.process_weights_after_loading()
        return
    if act_dtype is None:
        raise ValueError(f"model_config is required: {type(module).__name__}.process_weights_after_loading of "
                         f"layer {name or '<root>'} needs the activation dtype (model_config.dtype)")
    module.process_weights_after_loading(act_dtype)


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


def world_barrier() -> None:
    """Wait for every rank of vLLM's world group (its CPU group: no device work); nothing where that group is not
    initialized (an in-process load without vLLM's distributed environment)."""
    get_world_group = _optional("vllm.distributed.parallel_state", "get_world_group")
    try:
        group = get_world_group() if get_world_group is not None else None
    except AssertionError:  # "world group is not initialized"
        return
    if group is not None and group.world_size > 1:
        group.barrier()
