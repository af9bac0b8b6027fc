"""A pure-torch online-quantization method for tests: vLLM's online fp8 cannot run on a CPU-only host.

vLLM's own online fp8 methods quantize with ``torch.ops._C.static_scaled_fp8_quant`` (absent from the PyPI
wheel on CPU) and its MXFP8 method has no CPU kernel. This method keeps their shape and uses vLLM's real
layerwise machinery, so ``finalize_layerwise_processing`` and the post-load contract are exercised for real.
Imports vLLM: import it only in tests that already need it.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload import layerwise

FP8 = torch.float8_e4m3fn


class TorchFp8OnlineMethod(QuantizeMethodBase):
    """Online per-tensor fp8 in pure torch, shaped like vLLM's ``Fp8PerTensorOnlineLinearMethod``: weights
    start on ``meta``, vLLM's layerwise loader materializes and processes a layer when its last weight
    arrives; the result is an fp8 ``.t()`` view plus a scale, and vLLM's "already processed" marker."""

    uses_meta_device = True

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, loader) -> None:
        weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"), requires_grad=False)
        weight.weight_loader = loader
        layer.register_parameter("weight", weight)
        layerwise.initialize_online_processing(layer)  # vLLM's real loader wrapping

    def apply(self, layer, x, bias=None):
        return x @ (layer.weight.float() * layer.weight_scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        weight = layer.weight.detach()
        scale = weight.abs().amax().float().clamp(min=1e-12) / torch.finfo(FP8).max
        qweight = (weight / scale).clamp(torch.finfo(FP8).min, torch.finfo(FP8).max).to(FP8)
        layer.weight = nn.Parameter(qweight.t(), requires_grad=False)  # column-major, as vLLM's kernels want
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer._already_called_process_weights_after_loading = True
