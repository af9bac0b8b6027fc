"""A CPU stand-in for vLLM's ModelOpt FP8 linear method, for servers on our CPU platform: NOT vLLM's ModelOpt.

vLLM's ModelOpt FP8 post-processing (one scale per stacked layer: ``requantize_with_max_scale``) and its FP8 GEMMs run
custom CUDA ops, so a pre-quantized ModelOpt FP8 DiT cannot be served on a CPU-only host. This config takes vLLM's
``ModelOptFp8Config`` as it is (its parsing of ``quantization_config``, ``exclude_modules``, its name ``modelopt``
and ``is_checkpoint_fp8_serialized``, which vllm-omni's ``ModelOptFp8CheckpointAdapter`` keys on) and gives every
quantized linear a method with vLLM's parameters -- ``weight`` fp8 ``[out, in]``, ``weight_scale`` one per stacked
part (per tensor; ``[out]`` per channel), ``input_scale`` one per part (per tensor) -- and vLLM's post-processing
arithmetic in plain torch: the parts of a stacked layer requantized to their largest scale (``requantize_rows``, also
applied to each rank's own rows under ``rank_local``), then the weight dequantized in the forward (activations are
not quantized: the static ``input_scale`` is loaded and not used).

Registered through vLLM's own ``register_quantization_config("modelopt")`` by the ``diffusion_cpu_fp8`` general plugin
(``testing/cpu_fp8.py``) only on our CPU platform, and said so in the log. Imports vLLM.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.modelopt import ModelOptFp8Config
from vllm.model_executor.parameter import ChannelQuantScaleParameter, ModelWeightParameter, PerTensorScaleParameter

from vllm_diffusion_plugin.engine.quant.fp8 import FP8, dequantize
from vllm_diffusion_plugin.engine.quant.layer import Fp8RowMethod
from vllm_diffusion_plugin.engine.quant.online import ROW_WISE_METHODS

LIMIT = torch.finfo(FP8).max
UNLOADED = torch.finfo(torch.float32).min
"""vLLM's ``FP8_SCALE_SENTINEL``: a scale the checkpoint never filled."""


class CpuModelOptFp8LinearMethod(Fp8RowMethod, LinearMethodBase):
    """vLLM's ModelOpt FP8 parameters for a (stacked) linear layer, its post-processing in plain torch, the forward of
    ``engine.fp8_layer.Fp8RowMethod`` (the weight kept row-major ``[out, in]``)."""

    def __init__(self, per_channel: bool) -> None:
        super().__init__(per_channel, serialized=True)

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        loader = extra_weight_attrs["weight_loader"]
        out, parts = sum(output_partition_sizes), len(output_partition_sizes)
        layer.logical_widths = list(output_partition_sizes)
        layer.register_parameter("weight", ModelWeightParameter(
            data=torch.empty(out, input_size_per_partition, dtype=FP8), input_dim=1, output_dim=0,
            weight_loader=loader))
        if self.per_channel:
            scale = ChannelQuantScaleParameter(data=torch.full((out,), UNLOADED), output_dim=0, weight_loader=loader)
        else:
            scale = PerTensorScaleParameter(data=torch.full((parts,), UNLOADED), weight_loader=loader)
            layer.register_parameter("input_scale", PerTensorScaleParameter(
                data=torch.full((parts,), UNLOADED), weight_loader=loader))
        layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        weight, scale = layer.weight.detach(), layer.weight_scale.detach().float()
        if bool((scale == UNLOADED).any()):
            raise ValueError(f"ModelOpt FP8 layer {type(layer).__name__} {tuple(weight.shape)}: weight_scale was not "
                             f"loaded from the checkpoint")
        if not self.per_channel:  # vLLM's requantize_with_max_scale: every stacked part to the largest scale
            top, rows, start = scale.max(), [], 0
            for part, width in zip(scale, layer.logical_widths):
                rows.append(self.requantize_rows(weight[start:start + width], part, top))
                start += width
            weight, scale = torch.cat(rows), top
        layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)  # per channel: [out], as loaded
        self.install_rows(layer)

    def requantize_rows(self, rows: torch.Tensor, scale: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """FP8 ``rows`` of one stacked part at its per-tensor ``scale``, at the layer's largest part scale ``top``
        (as they are where ``scale`` is ``top``): the post-processing above, row by row (elementwise per row), which
        ``hsdp_weight_load=rank_local`` applies to each rank's own rows (``engine/quant/parts.py``)."""
        if bool(scale == top):
            return rows
        return (dequantize(rows, scale) / top).clamp(-LIMIT, LIMIT).to(FP8)


class CpuModelOptFp8Config(ModelOptFp8Config):
    """vLLM's ``ModelOptFp8Config`` whose quantized linears get :class:`CpuModelOptFp8LinearMethod`."""

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None
        if self.is_layer_excluded(prefix):
            return UnquantizedLinearMethod()
        return CpuModelOptFp8LinearMethod(per_channel=self.quant_method == "FP8_PER_CHANNEL_PER_TOKEN")


def register() -> str:
    """``modelopt`` -> :class:`CpuModelOptFp8Config` in vLLM's quantization registry (its out-of-tree hook); the
    method's parameters loaded by vLLM's ``weight_loader_v2`` (per-part scales of stacked layers), as vLLM's own
    ModelOpt method registers itself. Its layers are finished row by row under ``rank_local`` (``requantize_rows``):
    named in ``engine.quant.online.ROW_WISE_METHODS``."""
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.quantization import register_quantization_config

    if CpuModelOptFp8LinearMethod.__name__ not in linear.WEIGHT_LOADER_V2_SUPPORTED:
        linear.WEIGHT_LOADER_V2_SUPPORTED.append(CpuModelOptFp8LinearMethod.__name__)
    register_quantization_config("modelopt")(CpuModelOptFp8Config)
    ROW_WISE_METHODS.add("modelopt")
    return "modelopt"
