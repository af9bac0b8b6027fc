"""A pure-torch online-quantization method for tests: vLLM's online fp8 cannot run on a CPU-only host.

vLLM's own online fp8 methods quantize with ``torch.ops._C.static_scaled_fp8_quant`` (absent from the PyPI
wheel on CPU) and its MXFP8 method has no CPU kernel. This method keeps their shape and uses vLLM's real
layerwise machinery, so ``finalize_layerwise_processing`` and the post-load contract are exercised for real.
It scales per tensor (vLLM's ``Fp8PerTensorOnlineLinearMethod``) or, with ``per_channel=True``, per output row
(a ``[out, 1]`` scale), and it declares the row protocol of ``engine.quant.online`` (``scale_granularity``,
``row_amax``, ``quantize_rows``, ``install_rows``), so ``hsdp_weight_load=rank_local`` can quantize each
rank's rows with the scale the whole tensor would get. Its own ``process_weights_after_loading`` runs the same
two functions on the whole tensor, so the two paths share every floating-point operation.
Imports vLLM: import it only in tests that already need it.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.model_loader.reload import layerwise

from vllm_diffusion_plugin.engine.quant.fp8 import FP8
from vllm_diffusion_plugin.engine.quant.layer import Fp8Linear, Fp8RowMethod
from vllm_diffusion_plugin.engine.quant.online import ROW_WISE_METHODS


class TorchFp8OnlineMethod(Fp8RowMethod, QuantizeMethodBase):
    """Online fp8 in pure torch, shaped like vLLM's ``Fp8PerTensorOnlineLinearMethod``: weights start on
    ``meta`` (``create_weights``), vLLM's layerwise loader materializes and processes a layer when its last
    weight arrives; the result is an fp8 ``.t()`` view plus a scale, and vLLM's "already processed" marker.
    ``per_channel``: one scale per output row (``weight_scale`` of shape ``[out, 1]``). The row protocol, the
    rounding and the forward are ``engine.fp8_layer.Fp8RowMethod``'s, which pre-quantized checkpoints load into."""

    uses_meta_device = True

    def __init__(self, per_channel: bool = False, *, rows: bool = True) -> None:
        super().__init__(per_channel)
        self.rows = rows

    @property
    def scale_granularity(self) -> str | None:
        """The row protocol's granularity; None with ``rows=False`` (the protocol switched off: ``rank_local`` then
        gathers each layer whole and runs :meth:`process_weights_after_loading` on it, ``engine.quant.whole``)."""
        return ("channel" if self.per_channel else "tensor") if self.rows else None

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, loader) -> None:
        weight = nn.Parameter(torch.empty(out_features, in_features, device="meta"), requires_grad=False)
        weight.weight_loader = loader
        layer.register_parameter("weight", weight)
        layerwise.initialize_online_processing(layer)  # vLLM's real loader wrapping

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        weight = layer.weight.detach()
        qweight, scale = self.quantize_rows(weight, self.row_amax(weight))
        layer.weight = nn.Parameter(qweight.t(), requires_grad=False)  # column-major, as vLLM's kernels want
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer._already_called_process_weights_after_loading = True


OnlineQuantLinear = Fp8Linear
"""An ``nn.Linear`` of a diffusers DiT given an online quant method: ``engine.fp8_layer.Fp8Linear``."""


def attach_online_quant(module: nn.Module, *, per_channel: bool = False, pattern: str = r"blocks\.\d+\.",
                        rows: bool = True, stacked: bool = False) -> list[str]:
    """Give every ``nn.Linear`` of ``module`` whose name matches ``pattern`` a ``TorchFp8OnlineMethod`` (on
    ``meta`` or real weights alike: the class changes, the parameters stay). Returns the layer names. The
    ``quantization`` hook of ``session.load_components``. ``rows=False``: the row protocol switched off;
    ``stacked``: :class:`TorchFp8StackedMethod` instead (no row protocol either)."""
    names = []
    for name, sub in module.named_modules():
        if type(sub) is nn.Linear and re.search(pattern, name):
            sub.__class__ = OnlineQuantLinear
            sub.quant_method = TorchFp8StackedMethod() if stacked else TorchFp8OnlineMethod(per_channel=per_channel,
                                                                                            rows=rows)
            names.append(name)
    return names


class TorchFp8StackedMethod(TorchFp8OnlineMethod):
    """Online fp8 post-processed the way vLLM's ``Fp8LinearMethod`` finishes a layer of stacked shards, in pure torch
    and without the row protocol: each logical shard (``logical_widths``: the rows of q / k / v stacked in one
    weight; here the weight's rows split in ``parts``, torch.chunk's way) quantized with its own per-tensor scale,
    then every shard dequantized and requantized with the largest of those scales (one scale for the layer, as
    vLLM's ``requantize_with_max_scale``), and the fp8 weight stored transposed (``.t()``, ``[in, out]``: the
    column-major view vLLM's ``_scaled_mm`` takes). No rank's rows can be finished alone: the scale needs every
    shard's, and the transposed weight's rows are the original's columns."""

    def __init__(self, parts: int = 3) -> None:
        super().__init__(rows=False)
        self.parts = parts

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        weight = layer.weight.detach()
        shards = [(q, s) for q, s in (self.quantize_rows(part, self.row_amax(part))
                                      for part in weight.chunk(self.parts))]
        scale = torch.stack([s for _, s in shards]).amax()
        info = torch.finfo(FP8)
        requantized = [(q.float() * s / scale).clamp(info.min, info.max).to(FP8) for q, s in shards]
        layer.weight = nn.Parameter(torch.cat(requantized).t(), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer._already_called_process_weights_after_loading = True


class TorchFp8OnlineLinearMethod(TorchFp8OnlineMethod):
    """``TorchFp8OnlineMethod`` for vLLM's linear layers (vllm-omni's DiTs): vLLM's ``create_weights`` signature,
    and a processed weight kept as the row-major ``[out, in]`` storage (what vllm-omni's
    ``prepare_fp8_layers_for_fsdp`` makes of vLLM's fp8 ``.t()`` weights before FSDP2 shards them)."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        from vllm.model_executor.utils import set_weight_attrs

        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype,
                                          device="meta"), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)
        layerwise.initialize_online_processing(layer)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        weight = layer.weight.detach()
        qweight, scale = self.quantize_rows(weight, self.row_amax(weight))
        layer.weight = nn.Parameter(qweight, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.install_rows(layer)


class TorchFp8Config(QuantizationConfig):
    """Pure-torch online fp8 for CPU proofs: NOT vLLM's fp8 (which has no CPU kernel). Every linear layer gets
    ``TorchFp8OnlineLinearMethod``. A module-level class: vllm-omni pickles the stage's quantization config to its
    workers."""

    def __init__(self, per_channel: bool = False, *, rows: bool = True) -> None:
        super().__init__()
        self.per_channel, self.rows = per_channel, rows

    def get_name(self):
        return ("torch_fp8_per_channel" if self.per_channel else "torch_fp8") + ("" if self.rows else "_whole")

    def get_supported_act_dtypes(self):
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config):
        return cls()

    def get_quant_method(self, layer, prefix: str):
        from vllm.model_executor.layers.linear import LinearBase

        return TorchFp8OnlineLinearMethod(per_channel=self.per_channel, rows=self.rows) \
            if isinstance(layer, LinearBase) else None


def torch_fp8_config(per_channel: bool = False, *, rows: bool = True) -> TorchFp8Config:
    """A vLLM ``QuantizationConfig`` giving every linear layer ``TorchFp8OnlineLinearMethod`` (CPU proofs only)."""
    return TorchFp8Config(per_channel, rows=rows)


def register_omni_override() -> tuple[str, ...]:
    """Register ``torch_fp8`` / ``torch_fp8_per_channel`` with vllm-omni's own quantization override hook
    (``vllm_omni.quantization.factory.register_quantization_override``), so ``--quantization torch_fp8`` reaches
    vllm-omni's DiTs on a CPU host, and ``torch_fp8_whole`` (the per-tensor one with its row protocol switched off:
    ``rank_local`` runs it layer-whole). Labelled as what it is: a test method, not vLLM's fp8."""
    from vllm_omni.quantization.factory import register_quantization_override

    register_quantization_override("torch_fp8", lambda **_: torch_fp8_config(False))
    register_quantization_override("torch_fp8_per_channel", lambda **_: torch_fp8_config(True))
    register_quantization_override("torch_fp8_whole", lambda **_: torch_fp8_config(False, rows=False))
    ROW_WISE_METHODS.update({"torch_fp8", "torch_fp8_per_channel"})  # torch_fp8_whole: no row protocol
    return "torch_fp8", "torch_fp8_per_channel", "torch_fp8_whole"
