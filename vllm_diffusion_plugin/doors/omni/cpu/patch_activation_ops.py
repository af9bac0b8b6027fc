"""Patch (CPU platform only): the ``torch.ops._C`` activation kernels vLLM's activation layers bind on a CPU.

Why. On ``CpuPlatform`` vLLM 0.30-0.32 binds a custom kernel in the ``__init__`` of several activation layers
(``vllm/model_executor/layers/activation.py``, e.g. ``SiluAndMul``: ``if is_cuda_alike() or is_cpu() or
is_xpu(): self.op = torch.ops._C.silu_and_mul``). Those kernels come from vLLM's CPU build (``vllm._C``); the
PyPI wheel is the CUDA build, whose ``_C`` library does not load on a CPU-only host, so building any DiT with
such a layer fails: Z-Image's feed-forward (``SiluAndMul``), seen in a real ``vllm serve --omni`` on the CPU as
"Orchestrator initialization failed: '_OpNamespace' '_C' object has no attribute 'silu_and_mul'". The x86
CPU forward never calls the kernel (``forward_cpu`` -> ``forward_native``; only POWERPC takes it).

How. The missing ops among :data:`OPS` -- the ``(Tensor(a!) out, Tensor input) -> ()`` kernels those layers
bind on a CPU -- are defined in a ``torch.library`` fragment of ``_C`` with vLLM's own ``forward_native`` math
(written into ``out``), so the lookup in ``__init__`` succeeds; ops that ``_C`` has (a CPU build of vLLM) are
left alone. Installed only by ``CpuOmniPlatform`` (only in processes that resolved the CPU platform, i.e.
under ``VLLM_DIFFUSION_OMNI_CPU=1``), never by ``register()``. Idempotent: defined once per process.

Versions. Recognized shape: vLLM 0.30-0.32's ``activation`` module, whose layers of :data:`OPS` bind
``torch.ops._C.<op>`` in ``__init__`` under ``current_platform.is_cpu()``. vLLM 0.33+ binds them on a CPU
only for POWERPC: nothing is defined then (the unit reports "already applied").

Remove when the served vLLM no longer binds ``_C`` kernels on x86 CPUs (vLLM >= 0.33).
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


def _halves(fn):
    def op(out: torch.Tensor, x: torch.Tensor) -> None:
        d = x.shape[-1] // 2
        out.copy_(fn(x[..., :d]) * x[..., d:])
    return op


def _whole(fn):
    def op(out: torch.Tensor, x: torch.Tensor) -> None:
        out.copy_(fn(x))
    return op


_C0 = math.sqrt(2.0 / math.pi)
OPS: dict[str, tuple[str, Any]] = {  # op -> (the layer class binding it, vLLM's forward_native math)
    "silu_and_mul": ("SiluAndMul", _halves(F.silu)),
    "gelu_and_mul": ("GeluAndMul", _halves(lambda x: F.gelu(x, approximate="none"))),
    "gelu_tanh_and_mul": ("GeluAndMul", _halves(lambda x: F.gelu(x, approximate="tanh"))),
    "gelu_new": ("NewGELU", _whole(lambda x: 0.5 * x * (1.0 + torch.tanh(_C0 * (x + 0.044715 * torch.pow(x, 3.0)))))),
    "gelu_fast": ("FastGELU", _whole(lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))))),
    "gelu_quick": ("QuickGELU", _whole(lambda x: x * torch.sigmoid(1.702 * x))),
}
_state: dict[str, Any] = {"lib": None, "defined": []}


def binds_on_cpu(module: Any, op: str, class_name: str) -> bool:
    """Whether ``class_name.__init__`` of ``module`` binds ``torch.ops._C.<op>`` on a CPU (0.30-0.32 shape)."""
    init = require_attr(require_attr(module, class_name, module.__name__), "__init__", f"{module.__name__}.{class_name}")
    try:
        source = inspect.getsource(init)
    except (OSError, TypeError) as exc:
        raise UnrecognizedShape(f"{module.__name__}.{class_name}.__init__: no source to check ({exc})") from exc
    if f"torch.ops._C.{op}" not in source:
        raise UnrecognizedShape(f"{module.__name__}.{class_name}.__init__ no longer binds torch.ops._C.{op}")
    return "is_cpu()" in source and "POWERPC" not in source  # 0.33+: `is_cpu() and ... == POWERPC`


def apply(module: Any) -> str:
    if _state["lib"] is not None:
        return "already applied"
    wanted = [op for op, (cls, _) in OPS.items() if binds_on_cpu(module, op, cls)]
    if not wanted:  # vLLM 0.33+: no layer binds a kernel on x86, nothing to define
        return "already applied"
    missing = [op for op in wanted if not hasattr(torch.ops._C, op)]
    lib = torch.library.Library("_C", "FRAGMENT")
    for op in missing:
        lib.define(SCHEMA.format(op))
        lib.impl(op, OPS[op][1], "CPU")
    _state.update(lib=lib, defined=missing)
    logger.debug("CPU platform: defined torch.ops._C.{%s} with vLLM's native math", ", ".join(missing))
    return "applied"
