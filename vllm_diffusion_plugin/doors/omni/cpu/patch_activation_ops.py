"""Patch (CPU platform only): the ``torch.ops._C`` activation kernels vLLM's activation layers bind on a CPU.

Why. On ``CpuPlatform`` vLLM binds a custom kernel in the ``__init__`` of some activation layers
(``vllm/model_executor/layers/activation.py``, e.g. ``NewGELU``: ``elif current_platform.is_cpu(): self.op =
torch.ops._C.gelu_new``). Those kernels come from vLLM's CPU build (``vllm._C``); the PyPI wheel is the CUDA
build, whose ``_C`` library does not load on a CPU-only host, so building any DiT with such a layer fails:
Z-Image's feed-forward (``SiluAndMul`` on vLLM 0.30) and FLUX.1's T5 (``NewGELU``), seen in real ``vllm serve
--omni`` servers on the CPU as "Orchestrator initialization failed: '_OpNamespace' '_C' object has no attribute
'silu_and_mul'". The x86 CPU forward never calls the kernel (``forward_cpu`` -> ``forward_native``).

How. Which layers bind a kernel depends on the vLLM line (0.30 binds all six of :data:`OPS` on a CPU; 0.31-0.34
bind ``SiluAndMul`` / ``GeluAndMul`` only on POWERPC, ``NewGELU`` / ``FastGELU`` / ``QuickGELU`` still on every
CPU), so the installed vLLM is probed, not looked up: each layer of :data:`OPS` is built once as a probe subclass
whose parent ``CustomOp.__init__`` is skipped (it needs a current vLLM config; the layer's own ``__init__``, with
its platform checks, runs as written), and the ops whose lookup fails -- exactly those the layer binds on this
platform and ``_C`` lacks -- are defined in a ``torch.library`` fragment of ``_C`` with vLLM's own
``forward_native`` math (written into ``out``). A CPU build of vLLM, which has them, gets nothing. Installed only by
``CpuOmniPlatform`` (only in processes that resolved the CPU platform, i.e. under ``VLLM_DIFFUSION_OMNI_CPU=1``),
never by ``register()``. Idempotent: probed and defined once per process.

Versions. Tested on vLLM 0.30.0 (six ops defined), 0.31.0 and 0.32.0 (``gelu_new``, ``gelu_fast``,
``gelu_quick``). Recognized shape: a ``CustomOp`` subclass per layer of :data:`OPS` in the ``activation``
module; a layer that fails its probe for any other reason is an unrecognized shape.

Remove when the served vLLM binds no ``_C`` kernel in an activation layer's ``__init__`` on x86 CPUs.
"""

from __future__ import annotations

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
OPS: dict[str, tuple[str, tuple[Any, ...], Any]] = {  # op -> (the layer binding it, its arguments, forward_native)
    "silu_and_mul": ("SiluAndMul", (), _halves(F.silu)),
    "gelu_and_mul": ("GeluAndMul", (), _halves(lambda x: F.gelu(x, approximate="none"))),
    "gelu_tanh_and_mul": ("GeluAndMul", ("tanh",), _halves(lambda x: F.gelu(x, approximate="tanh"))),
    "gelu_new": ("NewGELU", (), _whole(lambda x: 0.5 * x * (1.0 + torch.tanh(_C0 * (x + 0.044715 * torch.pow(x, 3.0)))))),
    "gelu_fast": ("FastGELU", (), _whole(lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))))),
    "gelu_quick": ("QuickGELU", (), _whole(lambda x: x * torch.sigmoid(1.702 * x))),
}
_state: dict[str, Any] = {"lib": None, "defined": []}


def missing_bound_ops(module: Any) -> list[str]:
    """The ops of :data:`OPS` that ``module``'s layers bind in ``__init__`` on this platform and ``_C`` lacks."""
    custom_op = require_attr(module, "CustomOp", module.__name__)

    class _NoConfig(custom_op):  # sits between the layer and CustomOp: no vLLM config needed to build it
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            torch.nn.Module.__init__(self)

    missing = []
    for op, (class_name, args, _) in OPS.items():
        layer = require_attr(module, class_name, module.__name__)
        if not (isinstance(layer, type) and issubclass(layer, custom_op)):
            raise UnrecognizedShape(f"{module.__name__}.{class_name} is no CustomOp subclass")
        try:
            type(f"Probe{class_name}", (layer, _NoConfig), {})(*args)
        except AttributeError as exc:
            if f"'{op}'" not in str(exc):
                raise UnrecognizedShape(f"{module.__name__}.{class_name}{args}: {exc}") from exc
            missing.append(op)
    return missing


def apply(module: Any) -> str:
    if _state["lib"] is not None:
        return "already applied"
    missing = missing_bound_ops(module)
    if not missing:  # nothing bound on this platform, or a CPU build of vLLM that has the kernels
        return "already applied"
    lib = torch.library.Library("_C", "FRAGMENT")
    for op in missing:
        lib.define(SCHEMA.format(op))
        lib.impl(op, OPS[op][2], "CPU")
    _state.update(lib=lib, defined=missing)
    logger.debug("CPU platform: defined torch.ops._C.{%s} with vLLM's native math", ", ".join(missing))
    return "applied"
