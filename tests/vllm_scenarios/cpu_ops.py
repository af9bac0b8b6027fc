"""vLLM 0.30-0.32 on a CPU host with the PyPI (CUDA) wheel: the custom CPU ops some layers look up when built.

On ``CpuPlatform`` vLLM 0.30-0.32 binds ``torch.ops._C.<op>`` in the ``__init__`` of e.g. ``SiluAndMul``
(``layers/activation.py``: ``if is_cuda_alike() or is_cpu() or is_xpu(): self.op = torch.ops._C.silu_and_mul``);
those ops come from vLLM's CPU build (``vllm._C``), which the PyPI wheel does not ship, so building a Llama
raises ``AttributeError: '_OpNamespace' '_C' object has no attribute 'silu_and_mul'``. vLLM 0.33+ looks them
up on CPU only for POWERPC. The x86 CPU forward never calls them (``forward_cpu`` -> ``forward_native``).

``ensure_cpu_ops()`` defines the missing ones with vLLM's own ``forward_native`` math, so the scenarios can
build models on any vLLM in range; it changes nothing where vLLM's ``_C`` provides them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_LIB: torch.library.Library | None = None


def _silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1] // 2
    out.copy_(F.silu(x[..., :d]) * x[..., d:])


OPS = {"silu_and_mul": ("silu_and_mul(Tensor(a!) out, Tensor input) -> ()", _silu_and_mul)}


def ensure_cpu_ops() -> list[str]:
    """Define the ops of ``OPS`` that ``torch.ops._C`` lacks; returns their names."""
    global _LIB
    missing = [name for name in OPS if not hasattr(torch.ops._C, name)]
    if missing and _LIB is None:
        _LIB = torch.library.Library("_C", "FRAGMENT")
    for name in missing:
        schema, fn = OPS[name]
        _LIB.define(schema)
        _LIB.impl(name, fn, "CPU")
    return missing
