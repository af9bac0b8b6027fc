"""The plan's accounting of online-quantized DiT linears (``plan.plan_load(..., quantization=...)``).

A quantized linear is read in the load dtype and held quantized (fp8 bytes plus its scales). Under ``rank_local``
``quant.online.quantize_by_block`` reads one FSDP block's local rows of them into load-dtype transients, fuses the
LoRA there and quantizes row chunk by row chunk (``quant.fp8.row_chunks``); under ``full`` / ``broadcast`` the
method quantizes each whole tensor beside the load-dtype DiT. Pure functions over ``plan._Shape`` figures; reads
nothing, imports no door.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from vllm_diffusion_plugin.engine.hsdp import select_blocks
from vllm_diffusion_plugin.engine.io.rows import shard_rows
from vllm_diffusion_plugin.engine.quant.fp8 import CHUNK_ELEMENTS
from vllm_diffusion_plugin.engine.quant.layer import Fp8Linear, Fp8RowMethod

QUANTIZE_BYTES_PER_ELEMENT = 8
"""What ``quantize_rows`` holds at once per element of a row chunk: ``rows / scale`` in fp32 beside its clamped
copy (4 + 4 bytes; the fp8 result, 1 byte, is made after the quotient goes)."""


def quantized_layers(layers: Sequence, block_names: Sequence[str]) -> dict[str, tuple[int, int, int, bool, int]]:
    """Online-quantized weight (``quant.online.QuantLayer``) -> (quantized bytes, its scale's bytes, the index of its
    FSDP block in ``block_names`` (``len(block_names)``: outside them), per-tensor scale, elements)."""
    out = {}
    for layer in layers:
        block = next((i for i, n in enumerate(block_names) if layer.module.startswith(f"{n}.")), len(block_names))
        rows, numel = layer.shape[0], layer.shape[0] * layer.shape[1]
        scale = 4 * (1 if layer.per_tensor else rows)
        out[layer.weight] = (numel * layer.method.quantized_dtype.itemsize, scale, block, layer.per_tensor, numel)
    return out


def quantize_chunk_bytes(elements: int) -> int:
    """The temporaries of quantizing ``elements`` local elements of one weight, row chunk by row chunk (at most
    ``quant.fp8.CHUNK_ELEMENTS`` at once, as ``quant.online.quantize_by_block`` runs)."""
    return QUANTIZE_BYTES_PER_ELEMENT * min(elements, CHUNK_ELEMENTS)


def quantized_bytes(quantized: Mapping[str, tuple[int, int, int, bool, int]],
                    tensors: Mapping[str, tuple[int, int, int, bool]], local_of: Mapping[str, int], *,
                    sharded: bool, rank_local: bool) -> tuple[int, int, int]:
    """``(bytes the quantized weights hold less than their load-dtype copies, rank_local's transient, the largest
    whole tensor's quantized copy)`` for one component on one rank. ``quantized``: :func:`quantized_layers`;
    ``tensors``: ``plan._Shape.tensors`` (checkpoint bytes, final bytes, rows, sharded); ``local_of``: this rank's
    bytes of each tensor in the load dtype. rank_local's transient: the largest block's local rows in the load dtype
    plus the row-chunk temporaries of quantizing its largest weight (:func:`quantize_chunk_bytes`)."""
    if not quantized:
        return 0, 0, 0
    saved, per_block, largest, chunk = 0, {}, 0, 0
    for key, (qbytes, scale, block, per_tensor, numel) in quantized.items():
        final = tensors.get(key, (0, 0, 0, False))[1]
        if not final:
            continue
        mine = local_of[key] if sharded else final  # this rank's rows, load dtype
        saved += mine - qbytes * mine // final - (scale if per_tensor else scale * mine // final)
        per_block[block] = per_block.get(block, 0) + mine
        largest = max(largest, qbytes)
        chunk = max(chunk, quantize_chunk_bytes(numel * mine // final))
    transient = max(per_block.values(), default=0) + chunk if rank_local else 0
    return saved, transient, largest


def whole_layers(layers: Sequence, block_names: Sequence[str]) -> dict[str, tuple]:
    """Layer gathered whole (``quant.whole.WholeLayer``) -> (its read inputs' keys, its changed or added outputs by
    key (``Layout``), the index of its FSDP block in ``block_names``, its inputs' whole bytes, its outputs')."""
    out = {}
    for layer in layers:
        block = next((i for i, n in enumerate(block_names) if layer.module.startswith(f"{n}.")), len(block_names))
        changed = {f"{layer.module}.{n}": lay for n, lay in layer.outputs.items() if layer.inputs.get(n) != lay}
        out[layer.module] = (layer.read, changed, block, sum(lay.nbytes for lay in layer.inputs.values()),
                             sum(lay.nbytes for lay in layer.outputs.values()))
    return out


def whole_bytes(whole: Mapping[str, tuple], local_of: Mapping[str, int], *, shard: tuple[int, int] | None,
                rank_local: bool) -> tuple[int, int, int]:
    """``(bytes the processed layers hold less than their load-dtype inputs, rank_local's transient, the largest
    processed layer)`` for one component on one rank (``quant.whole``). ``whole``: :func:`whole_layers`; ``local_of``:
    this rank's bytes of each checkpoint tensor in the load dtype; ``shard``: ``(shard size, this rank's index)`` when
    sharded (each output's rows split as ``fully_shard`` cuts them; 0-dim ones whole). rank_local's transient: the
    largest block's local rows of the read inputs, plus one layer whole in the load dtype and its processed form. The
    method's own temporaries are not modelled (vLLM's fp8 quantizes in one fused kernel; the CPU stand-in's bf16
    quotients stayed within the test's 15%: ``tests/test_rank_local_quant.py``'s peak test)."""
    saved, per_block, layer_peak, largest = 0, {}, 0, 0
    for reads, changed, block, inputs, outputs in whole.values():
        mine = sum(local_of.get(key, 0) for key in reads)
        kept = 0
        for lay in changed.values():
            if shard is None or not lay.shape or not lay.dtype.is_floating_point:
                kept += lay.nbytes
            else:
                start, stop = shard_rows(lay.shape[0], size=shard[0], index=shard[1])
                kept += lay.nbytes // max(1, lay.shape[0]) * (stop - start)
        saved += mine - kept
        per_block[block] = per_block.get(block, 0) + mine
        layer_peak, largest = max(layer_peak, inputs + outputs), max(largest, outputs)
    transient = max(per_block.values(), default=0) + layer_peak if rank_local and whole else 0
    return saved, transient, largest


ONLINE_FP8 = {"fp8": "whole", "torch_fp8": "tensor", "torch_fp8_per_channel": "channel", "torch_fp8_whole": "whole"}
"""Online quantization methods whose DiT linears end as fp8 weights and a scale, by name -> how ``rank_local`` finishes
them: row by row (``tensor`` / ``channel`` scales: the row protocol) or gathered whole (``whole``: vLLM's ``fp8``, an
fp8 ``[in, out]`` weight -- its ``weight.t()`` -- and one scale). Planned at their quantized size. Any other method is
planned in the load dtype (an over-estimate)."""


class _PlannedOnlineFp8(Fp8RowMethod):
    uses_meta_device = True  # quantized after loading, as vLLM's online methods


class _PlannedWholeFp8(_PlannedOnlineFp8):
    """vLLM's ``fp8`` as the plan sees it: no row protocol; post-processing leaves an fp8 ``[in, out]`` weight and
    one fp32 scale (shapes only: the plan runs it on ``meta``)."""

    scale_granularity = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        layer.weight = nn.Parameter(torch.empty(tuple(weight.shape)[::-1], dtype=self.quantized_dtype,
                                                device=weight.device), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty((), device=weight.device), requires_grad=False)


def online_fp8_hook(method: str) -> Callable[[nn.Module], None] | None:
    """The plan's ``quantization`` hook for online method ``method`` (None: not an online fp8 method): every linear
    of a DiT's FSDP blocks an online fp8 layer on its ``meta`` skeleton, as a framework's quant config makes it."""
    kind = ONLINE_FP8.get(method)
    if kind is None:
        return None

    def on_meta(module: nn.Module) -> None:
        blocks = tuple(f"{name}." for name in select_blocks(module).names)
        for name, sub in module.named_modules():
            if type(sub) is nn.Linear and name.startswith(blocks):
                sub.__class__ = Fp8Linear
                sub.quant_method = _PlannedWholeFp8() if kind == "whole" else _PlannedOnlineFp8(kind == "channel")

    return on_meta
