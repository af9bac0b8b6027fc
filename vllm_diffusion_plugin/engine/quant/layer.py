"""The FP8 linear layer every quantized load here ends with, in pure torch (no vLLM import).

One representation, whatever made the FP8 values: a linear whose ``weight`` is ``float8_e4m3fn`` ``[out, in]``
(row-major: the storage FSDP2 shards by rows, as vllm-omni's ``prepare_fp8_layers_for_fsdp`` keeps it; the
``weight_row_major`` mark), with an fp32 ``weight_scale`` -- one per tensor (0-dim) or one per output row
(``[out, 1]``, or ``[out]`` as ModelOpt's ``FP8_PER_CHANNEL_PER_TOKEN`` files store it) -- and, when the checkpoint
has one, its static ``input_scale`` (0-dim, kept for vLLM's kernels; the forward here dequantizes the weight).

- Online quantization (``testing.online_quant``) reaches it from bf16 weights: ``Fp8RowMethod``'s
  ``row_amax`` / ``quantize_rows`` are the row protocol of ``engine.quant.online``.
- A pre-quantized checkpoint (``engine.quant.checkpoints``) is read into it as it is: :func:`to_fp8_layers` gives the
  skeleton these parameters before a byte is read, and the checkpoint's FP8 bytes and scales land in them.

``Fp8Linear.forward`` is a reference (``x @ (q * scale)``), for the CLI's loads and the CPU proofs; vLLM's FP8
kernels are what serve.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from vllm_diffusion_plugin.engine.quant.fp8 import FP8, quantize


class Fp8RowMethod:
    """FP8 with a per-tensor or per-output-row scale: the row protocol of ``engine.quant.online`` plus the forward.

    ``serialized``: the FP8 values come from the checkpoint (nothing to quantize after loading; the checkpoint
    must hold ``weight`` and ``weight_scale``)."""

    uses_meta_device = False
    quantized_dtype = FP8

    def __init__(self, per_channel: bool = False, *, serialized: bool = False) -> None:
        super().__init__()
        self.per_channel = per_channel
        self.serialized = serialized

    @property
    def scale_granularity(self) -> str:
        """``tensor``: one scale from the whole tensor's amax (ranks holding its rows must agree on it);
        ``channel``: one per output row, from that row alone."""
        return "channel" if self.per_channel else "tensor"

    def row_amax(self, rows: torch.Tensor) -> torch.Tensor:
        """The statistic the scale comes from, over ``rows`` (``[rows, in]``, the ``[out, in]`` layout), in
        fp32: a 0-dim amax (``tensor``; the max over several row blocks is the whole tensor's) or ``[rows, 1]``."""
        if self.per_channel:
            return rows.abs().amax(dim=1, keepdim=True).float()
        return rows.abs().amax().float()

    def quantize_rows(self, rows: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp8 rows, scale)`` of ``rows`` given ``amax`` (``row_amax`` of the whole tensor, or of these rows
        for ``channel``)."""
        return quantize(rows, amax, self.quantized_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = layer.weight
        if getattr(layer, "weight_row_major", False):  # [out, in] storage
            weight = weight.t()
        scale = layer.weight_scale.reshape(1, -1) if self.per_channel else layer.weight_scale  # -> [1, out]
        out = x @ (weight.float() * scale).to(x.dtype)
        return out if bias is None else out + bias

    def install_rows(self, layer: nn.Module) -> None:
        """After ``weight`` (``[out, in]`` fp8 rows, maybe sharded) and ``weight_scale`` are filled: mark the
        layout (row-major) and the layer processed."""
        layer.weight_row_major = True
        layer._already_called_process_weights_after_loading = True


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` of a diffusers DiT given a quant method (what vLLM's ``quant_config`` does for the layers
    of the models it builds): the forward goes through ``quant_method.apply``."""

    quant_method: Fp8RowMethod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


def to_fp8_layers(module: nn.Module, layers: Mapping[str, tuple[bool, tuple[int, ...], bool]]) -> list[str]:
    """Make each named ``nn.Linear`` of ``module`` a serialized :class:`Fp8Linear` before any byte is read:
    ``layers`` maps its name to ``(per_channel, scale shape, has input_scale)``. Its ``weight`` becomes an fp8
    ``[out, in]`` parameter on the weight's device (the same Parameter object, its attributes kept), and it gets an
    fp32 ``weight_scale`` of that shape (and a 0-dim ``input_scale``). Returns the names."""
    for name, (per_channel, scale_shape, has_input_scale) in layers.items():
        layer = module.get_submodule(name)
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"{name}: an FP8 weight in the checkpoint, but {type(layer).__name__} is no nn.Linear")
        weight = layer._parameters["weight"]
        new = nn.Parameter(torch.empty(tuple(weight.shape), dtype=FP8, device=weight.device), requires_grad=False)
        new.__dict__.update(weight.__dict__)
        torch.utils.swap_tensors(weight, new)
        layer.register_parameter("weight_scale", nn.Parameter(
            torch.empty(scale_shape, dtype=torch.float32, device=weight.device), requires_grad=False))
        if has_input_scale:
            layer.register_parameter("input_scale", nn.Parameter(
                torch.empty((), dtype=torch.float32, device=weight.device), requires_grad=False))
        layer.__class__ = Fp8Linear
        layer.quant_method = Fp8RowMethod(per_channel, serialized=True)
        layer.quant_method.install_rows(layer)
    return list(layers)


def serialized_layers(module: nn.Module) -> dict[str, Fp8RowMethod]:
    """Module name -> method of every layer whose FP8 values come from the checkpoint."""
    return {name: sub.quant_method for name, sub in module.named_modules()
            if getattr(getattr(sub, "quant_method", None), "serialized", False)}
