"""A pure-torch online-quantization method for tests: vLLM's online fp8 cannot run on a CPU-only host.

vLLM's own online fp8 methods quantize with ``torch.ops._C.static_scaled_fp8_quant`` (absent from the PyPI
wheel on CPU) and its MXFP8 method has no CPU kernel. This method keeps their shape and uses vLLM's real
layerwise machinery, so ``finalize_layerwise_processing`` and the post-load contract are exercised for real.
It scales per tensor (vLLM's ``Fp8PerTensorOnlineLinearMethod``) or, with ``per_channel=True``, per output row
(a ``[out, 1]`` scale), and it declares the row protocol of ``engine.quant_shards`` (``scale_granularity``,
``row_amax``, ``quantize_rows``, ``install_rows``), so ``hsdp_weight_load=rank_local`` can quantize each
rank's rows with the scale the whole tensor would get. Its own ``process_weights_after_loading`` runs the same
two functions on the whole tensor, so the two paths share every floating-point operation.
Imports vLLM: import it only in tests that already need it.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload import layerwise

FP8 = torch.float8_e4m3fn


class TorchFp8OnlineMethod(QuantizeMethodBase):
    """Online fp8 in pure torch, shaped like vLLM's ``Fp8PerTensorOnlineLinearMethod``: weights start on
    ``meta`` (``create_weights``), vLLM's layerwise loader materializes and processes a layer when its last
    weight arrives; the result is an fp8 ``.t()`` view plus a scale, and vLLM's "already processed" marker.
    ``per_channel``: one scale per output row (``weight_scale`` of shape ``[out, 1]``)."""

    uses_meta_device = True
    quantized_dtype = FP8

    def __init__(self, per_channel: bool = False) -> None:
        super().__init__()
        self.per_channel = per_channel

    @property
    def scale_granularity(self) -> str:
        """``tensor``: one scale from the whole tensor's amax (ranks holding its rows must agree on it);
        ``channel``: one per output row, from that row alone."""
        return "channel" if self.per_channel else "tensor"

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, loader) -> None:
        weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"), requires_grad=False)
        weight.weight_loader = loader
        layer.register_parameter("weight", weight)
        layerwise.initialize_online_processing(layer)  # vLLM's real loader wrapping

    def row_amax(self, rows: torch.Tensor) -> torch.Tensor:
        """The statistic the scale comes from, over ``rows`` (``[rows, in]``, the ``[out, in]`` layout), in
        fp32: a 0-dim amax (``tensor``; the max over several row blocks is the whole tensor's) or ``[rows, 1]``."""
        if self.per_channel:
            return rows.abs().amax(dim=1, keepdim=True).float()
        return rows.abs().amax().float()

    def quantize_rows(self, rows: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp8 rows, scale)`` of ``rows`` given ``amax`` (``row_amax`` of the whole tensor, or of these rows
        for ``channel``)."""
        scale = amax.clamp(min=1e-12) / torch.finfo(FP8).max
        qrows = (rows / scale).clamp(torch.finfo(FP8).min, torch.finfo(FP8).max).to(FP8)
        return qrows, scale

    def apply(self, layer, x, bias=None):
        weight = layer.weight
        if getattr(layer, "weight_row_major", False):  # rank_local: the [out, in] storage FSDP2 shards by rows
            weight = weight.t()
        scale = layer.weight_scale.t() if self.per_channel else layer.weight_scale  # [out, 1] -> [1, out]
        out = x @ (weight.float() * scale).to(x.dtype)
        return out if bias is None else out + bias

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        weight = layer.weight.detach()
        qweight, scale = self.quantize_rows(weight, self.row_amax(weight))
        layer.weight = nn.Parameter(qweight.t(), requires_grad=False)  # column-major, as vLLM's kernels want
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer._already_called_process_weights_after_loading = True

    def install_rows(self, layer: nn.Module) -> None:
        """After ``rank_local`` filled ``weight`` (``[out, in]`` fp8 rows, sharded) and ``weight_scale``: mark
        the layout (row-major, as vllm-omni's ``prepare_fp8_layers_for_fsdp`` keeps it) and the layer processed."""
        layer.weight_row_major = True
        layer._already_called_process_weights_after_loading = True


class OnlineQuantLinear(nn.Linear):
    """An ``nn.Linear`` of a diffusers DiT given an online quant method (what vLLM's ``quant_config`` does for
    the layers of the models it builds): the forward goes through ``quant_method.apply``."""

    quant_method: QuantizeMethodBase

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


def attach_online_quant(module: nn.Module, *, per_channel: bool = False,
                        pattern: str = r"(^|\.)blocks\.\d+\.") -> list[str]:
    """Give every ``nn.Linear`` of ``module`` whose name matches ``pattern`` a ``TorchFp8OnlineMethod`` (on
    ``meta`` or real weights alike: the class changes, the parameters stay). Returns the layer names. The
    ``quantization`` hook of ``pipeline.load_components``."""
    names = []
    for name, sub in module.named_modules():
        if type(sub) is nn.Linear and re.search(pattern, name):
            sub.__class__ = OnlineQuantLinear
            sub.quant_method = TorchFp8OnlineMethod(per_channel=per_channel)
            names.append(name)
    return names
