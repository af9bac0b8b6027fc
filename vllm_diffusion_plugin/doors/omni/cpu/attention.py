"""Diffusion attention on the CPU: vllm-omni's own torch-SDPA backend, reachable from a CPU platform.

vllm-omni 0.30's ``AttentionImpl.forward`` (``diffusion/attention/backends/abstract.py``) dispatches on the
platform only: ``forward_cuda`` / ``forward_hip`` / ``forward_npu`` / ``forward_xpu`` / ``forward_musa``,
and raises ``NotImplementedError`` for any other platform -- even for its SDPA backend, whose math is
``torch.nn.functional.scaled_dot_product_attention`` and runs anywhere. These subclasses keep that backend
whole (name ``SDPA``, mask handling, GQA expansion) and route ``forward`` to its CUDA-layout path
(``[B, 1, 1, K]`` broadcast masks), which is plain torch.

Import this module only in a process where vllm-omni is importable (the CPU platform resolves it by name).
"""

from __future__ import annotations

import torch
from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class CpuSDPAImpl(SDPAImpl):
    """vllm-omni's SDPA implementation with a platform-independent ``forward``."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        return self.forward_cuda(query, key, value, attn_metadata)


class CpuSDPABackend(SDPABackend):
    """vllm-omni's SDPA backend (same name, ``SDPA``) whose implementation runs on the CPU platform."""

    @staticmethod
    def get_impl_cls() -> type[CpuSDPAImpl]:
        return CpuSDPAImpl
