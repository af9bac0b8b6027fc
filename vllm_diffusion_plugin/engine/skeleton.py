"""Component modules from ``config.json`` without random init, and diffusers-format saving.

``build_component`` constructs the diffusers class named by ``config["_class_name"]`` with every
*parameter* on ``meta`` (no memory, no random init of billions of weights) while *buffers* are computed for
real: diffusers DiTs keep non-persistent buffers (Wan's rotary ``freqs_cos``/``freqs_sin``) that are not
in any checkpoint, so they must keep their constructed values. Parameters are then allocated uninitialized
on the target device, ready for ``weights.load_into_module`` to copy into. Dtypes follow diffusers'
``from_pretrained(torch_dtype=...)``: the model is constructed under that default dtype, floating
parameters get it, except those of the class's ``_keep_in_fp32_modules`` which stay float32.

``save_component`` writes a module or state dict as a diffusers component folder (``config.json``,
``diffusion_pytorch_model-0000i-of-0000N.safetensors`` shards and
``diffusion_pytorch_model.safetensors.index.json``) that diffusers' ``from_pretrained`` loads, atomically:
it is written into a hidden sibling folder that is renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.errors import CheckpointError
from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource
from vllm_diffusion_plugin.engine.io.diffusers_classes import model_class
from vllm_diffusion_plugin.engine.memory import human_count
from vllm_diffusion_plugin.engine.quant.checkpoints import fp8_layers
from vllm_diffusion_plugin.engine.quant.layer import to_fp8_layers

logger = init_logger(__name__)

_PATCH_LOCK = threading.Lock()  # the meta-parameter patch is process-global while a class is constructed


def component_class(source: ComponentSource) -> type[nn.Module]:
    """The diffusers class named by the component's ``config.json`` ``_class_name``."""
    config_file = source.folder / "config.json"
    name = source.config.get("_class_name")
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{config_file}: no _class_name; cannot tell which diffusers class to build")
    try:
        cls = model_class(name)
    except (AttributeError, ImportError, RuntimeError) as exc:  # diffusers' lazy module raises on import errors
        import diffusers

        raise CheckpointError(f"{config_file}: _class_name {name!r} is not a class diffusers "
                              f"{diffusers.__version__} provides ({type(exc).__name__}: {exc})") from exc
    if not (isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(cls, "from_config")):
        raise CheckpointError(f"{config_file}: _class_name {name!r} is not a diffusers model class")
    return cls


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Construct on one intra-op thread: a skeleton's only real tensors are small buffers (Wan's rotary tables:
    ~10 ops on 1024 x 44 float64), too small for two threads to help, and each parallel op waits for every
    thread of the pool. On a host whose other cores are busy a descheduled pool thread turned the 2.6 GB
    Wan-width skeleton's 11 ms into 0.08-0.2 s (spin-waiting, in CPU time too). Restored afterwards."""
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


def _skipped_on_meta(init: Callable[..., Any]) -> Callable[..., Any]:
    def skip_meta(tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return init(tensor, *args, **kwargs)

    return functools.wraps(init)(skip_meta)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While active, every parameter a module registers is moved to ``meta``; buffers stay real.

    The same idea as accelerate's ``init_empty_weights(include_buffers=False)``, without depending on it.
    ``torch.nn.init``'s functions return a meta tensor untouched (``reset_parameters`` of ``nn.Linear`` and
    friends; on meta their effect is nothing, but each call still went through torch's Python decompositions:
    ~2 ms of the 2.6 GB Wan-width skeleton's 11); on any other tensor (a buffer) they run as usual.
    """
    original = nn.Module.register_parameter
    inits = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS if hasattr(nn.init, name)}

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    with _PATCH_LOCK:
        nn.Module.register_parameter = register_on_meta
        for name, init in inits.items():
            setattr(nn.init, name, _skipped_on_meta(init))
        try:
            yield
        finally:
            nn.Module.register_parameter = original
            for name, init in inits.items():
                setattr(nn.init, name, init)


def _fp32_module_names(cls: type) -> tuple[str, ...]:
    names = getattr(cls, "_keep_in_fp32_modules", None) or ()
    return (names,) if isinstance(names, str) else tuple(names)


def materialize(module: nn.Module, *, device: torch.device | str, dtype: torch.dtype,
                keep_fp32: tuple[str, ...] = ()) -> nn.Module:
    """Allocate every meta parameter uninitialized on ``device`` and move buffers there, keeping values.

    Floating parameters get ``dtype`` unless a component of their dotted name is in ``keep_fp32``
    (diffusers' rule); others keep theirs. Shared (tied) parameters stay shared.
    """
    device = torch.device(device)
    _place_parameters(module, device=device, dtype=dtype, keep_fp32=keep_fp32)
    for module_name, sub in module.named_modules():
        for name, buffer in list(sub._buffers.items()):
            if buffer is None:
                continue
            if buffer.is_meta:
                raise CheckpointError(f"buffer {module_name}.{name} {list(buffer.shape)} was created on meta; "
                                      f"its value cannot be recovered")
            sub._buffers[name] = buffer.to(device)
    return module


def _place_parameters(module: nn.Module, *, device: torch.device, dtype: torch.dtype,
                      keep_fp32: tuple[str, ...]) -> None:
    """``materialize``'s parameter half: each parameter on ``device`` in its final dtype (diffusers' rule)."""
    replaced: dict[int, nn.Parameter] = {}
    for module_name, sub in module.named_modules():
        for name, param in list(sub._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                full = f"{module_name}.{name}" if module_name else name
                target = param.dtype
                if param.is_floating_point():
                    target = torch.float32 if any(m in full.split(".") for m in keep_fp32) else dtype
                if param.is_meta:
                    data = torch.empty(param.shape, dtype=target, device=device)
                else:
                    data = param.detach().to(device=device, dtype=target)
                replaced[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            sub._parameters[name] = replaced[id(param)]


def build_component(source: ComponentSource, *, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """The component's diffusers model with uninitialized parameters on ``device`` and real buffers, in eval().

    Load weights next (``weights.load_into_module(module, source=source)``). ``device="meta"`` returns the
    skeleton without allocating anything: parameters on ``meta`` already in their final dtypes (``dtype``, or
    float32 for the class's ``_keep_in_fp32_modules``), buffers with their real constructed values. The linears a
    pre-quantized checkpoint stores in FP8 are ``quant.layer.Fp8Linear`` (``fp8_layers``).
    """
    cls = component_class(source)
    config = dict(source.config)
    with _default_dtype(dtype), parameters_on_meta(), _one_intra_op_thread():
        try:
            module = cls.from_config(config)
        except Exception as exc:
            raise CheckpointError(f"{source.folder / 'config.json'}: cannot construct {cls.__name__} from "
                                  f"this config: {type(exc).__name__}: {exc}") from exc
    if torch.device(device).type != "meta":
        materialize(module, device=device, dtype=dtype, keep_fp32=_fp32_module_names(cls))
    else:  # diffusers' dtype rule on meta: parameters only, buffers keep their values
        _place_parameters(module, device=torch.device("meta"), dtype=dtype, keep_fp32=_fp32_module_names(cls))
    checkpoint = fp8_layers(source)  # a pre-quantized checkpoint: its FP8 layers, read as they are
    if checkpoint is not None:
        to_fp8_layers(module, checkpoint.layers)
    module.eval()
    n_params = sum(p.numel() for p in module.parameters())
    logger.info("Built %s (%s, %s parameters, %s) on %s from %s without initializing weights",
                cls.__name__, source.name, human_count(n_params), dtype, device, source.folder / "config.json")
    return module


