"""Patch (CPU platform only): the ``torch.ops._C`` activation kernels vLLM 0.30's layers look up on a CPU host.

Why. On ``CpuPlatform`` vLLM 0.30-0.32 binds a custom op in the ``__init__`` of some activation layers
(``model_executor/layers/activation.py``: ``if is_cuda_alike() or is_cpu() or is_xpu(): self.op =
torch.ops._C.gelu_new``). Those ops come from vLLM's own CPU build (``vllm._C``); the PyPI wheel is the CUDA
build, whose ``_C`` does not import on a CPU-only host, so building the layer raises ``AttributeError:
'_OpNamespace' '_C' object has no attribute 'gelu_new'``. vllm-omni's T5 encoder (FLUX.1's ``text_encoder_2``,
``get_act_fn("gelu_new")`` for T5's gated GELU) is built that way: the worker dies at startup. On x86 the
layers' ``forward_cpu`` never calls the op (``forward_native``); only the lookup fails.

How. When ``vllm.model_executor.layers.activation`` is imported (at once if it already is), each op of
:data:`OPS` that ``torch.ops._C`` lacks is defined in a ``torch.library`` fragment of the ``_C`` namespace, with
vLLM's out-variant schema (``op(Tensor(a!) out, Tensor input) -> ()``) and the math of the layer's own
``forward_native``; an op ``_C`` already has is left alone. Before anything is defined, each layer class of
:data:`OPS` must still bind its ops under ``is_cpu()`` in ``__init__`` and fall back to ``forward_native`` in
``forward_cpu`` (source checked); otherwise the unit is skipped (and the CPU platform refuses to start a
worker, ``platform.require_patches_applied``). Installed only by ``CpuOmniPlatform`` (only in processes that
resolved the CPU platform, ``VLLM_DIFFUSION_OMNI_CPU=1``), never by ``register()``.

Versions. vLLM 0.30-0.32 look the ops up on every CPU; 0.33+ only on POWERPC (nothing missing there, nothing
defined). Idempotent: a second call finds the ops present.

Remove when the vLLM that vllm-omni runs with no longer binds ``_C`` ops on x86 CPUs (0.33+), or ships them.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni._patching import UnrecognizedShape, require_attr

logger = init_logger(__name__)

NAME = "cpu-activation-ops"
TARGET = "vllm.model_executor.layers.activation"
SCHEMA = "{}(Tensor(a!) out, Tensor input) -> ()"


def _half(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


def _silu_and_mul(x):
    gate, up = _half(x)
    return F.silu(gate) * up


def _gelu_and_mul(x):
    gate, up = _half(x)
    return F.gelu(gate) * up


def _gelu_tanh_and_mul(x):
    gate, up = _half(x)
    return F.gelu(gate, approximate="tanh") * up


def _gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x):
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _gelu_quick(x):
    return x * torch.sigmoid(1.702 * x)


OPS: dict[str, dict[str, Any]] = {
    "SiluAndMul": {"silu_and_mul": _silu_and_mul},
    "GeluAndMul": {"gelu_and_mul": _gelu_and_mul, "gelu_tanh_and_mul": _gelu_tanh_and_mul},
    "NewGELU": {"gelu_new": _gelu_new},
    "FastGELU": {"gelu_fast": _gelu_fast},
    "QuickGELU": {"gelu_quick": _gelu_quick},
}
"""Layer class of ``vllm.model_executor.layers.activation`` -> the ``_C`` ops its ``__init__`` binds on a CPU,
each with its ``forward_native`` math (input -> output)."""

_LIBRARY: torch.library.Library | None = None
"""The ``_C`` fragment holding the ops defined here (kept alive: dropping it would unregister them)."""


def _source(obj: Any, where: str) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError) as exc:
        raise UnrecognizedShape(f"{where}: no source to check ({exc})") from exc


def _check_shape(module: Any) -> None:
    for cls_name, ops in OPS.items():
        cls = require_attr(module, cls_name, module.__name__)
        where = f"{module.__name__}.{cls_name}"
        init = _source(require_attr(cls, "__init__", where), f"{where}.__init__")
        forward_cpu = _source(require_attr(cls, "forward_cpu", where), f"{where}.forward_cpu")
        if "is_cpu()" not in init or any(f"torch.ops._C.{op}" not in init for op in ops):
            raise UnrecognizedShape(f"{where}.__init__ no longer binds torch.ops._C.{'/'.join(ops)} on a CPU "
                                    f"platform as vLLM 0.30 does")
        if "forward_native" not in forward_cpu:
            raise UnrecognizedShape(f"{where}.forward_cpu no longer falls back to forward_native")


def missing_ops() -> list[str]:
    """The ops of :data:`OPS` that ``torch.ops._C`` does not have in this process."""
    return [op for ops in OPS.values() for op in ops if not hasattr(torch.ops._C, op)]


def _out_variant(fn):
    def impl(out: torch.Tensor, x: torch.Tensor) -> None:
        out.copy_(fn(x))

    return impl


def apply(module: Any) -> str:
    """Define the missing ops; ``"already applied"`` when none is missing (defined before, or by vLLM's own
    CPU build)."""
    global _LIBRARY
    _check_shape(module)
    missing = missing_ops()
    if not missing:
        return "already applied"
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("_C", "FRAGMENT")
    impls = {op: fn for ops in OPS.values() for op, fn in ops.items()}
    for op in missing:
        _LIBRARY.define(SCHEMA.format(op))
        _LIBRARY.impl(op, _out_variant(impls[op]), "CPU")
    logger.info("CPU platform: defined torch.ops._C.%s with vLLM's forward_native math for vLLM's activation "
                "layers (the PyPI wheel's _C has no CPU kernels)", ", torch.ops._C.".join(missing))
    return "applied"
