"""Pre-quantized FP8 layers stacked from several checkpoint tensors (vllm-omni's, under ``rank_local``): each rank
reads its own rows of every FP8 weight and finishes them as ``full`` finishes the whole layer, bit for bit.

vllm-omni builds a ModelOpt FP8 checkpoint's linears with its quant config's FP8 layers: an FP8 ``weight`` ``[out,
in]`` (q/k/v stacked in one ``to_qkv``: one *part* per checkpoint tensor) and, per tensor, one ``weight_scale`` and
``input_scale`` per part (``[parts]``), per channel one ``weight_scale`` per row (``[out]``). ``full`` reads the
checkpoint into them, a LoRA fused first into each checkpoint tensor it targets (``fused_stream.StreamFuser``: the
files' deltas summed in fp32, requantized once with a scale from the fused tensor); the method's post-processing
then gives a per-tensor layer one scale, its parts' largest, and requantizes the other parts' rows to it. Once the
scales are known every step is elementwise per row, so here:

- the FP8 rows -- and per channel the scale rows, per tensor the input scales -- are read like any other bound
  rows, into the local shards of the layer's final layout (per tensor a 0-dim ``weight_scale``, set on ``meta``
  before vllm-omni shards: :func:`to_final_layout`); a per-tensor layer's part scales (4 bytes each) are read by
  every rank;
- a part a LoRA targets: the files' deltas of this rank's rows summed in fp32 (the bias deltas into the bias rows),
  fused into the rows with ``fp8.fuse_fp8_rows`` -- per channel with each row's new amax, per tensor with the
  part's, agreed by the shard group (one ``all_reduce(MAX)`` of 4 bytes per targeted part, every rank of the group
  taking part, with rows or without);
- per tensor, each part's rows requantized to the largest part scale by the method itself (its ``requantize_rows``:
  its own post-processing's arithmetic), and the layer marked processed (its ``install_rows``).

A method declares that protocol (:data:`ROW_PROTOCOL`); the CPU stand-in ``testing.cpu_modelopt`` does. vLLM's own
ModelOpt FP8 method (its post-processing and GEMM layout are CUDA ops this CPU-built project cannot check row by row)
does not and is refused before any weight is read, naming it: use ``full``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.errors import RowQuantError
from vllm_diffusion_plugin.engine.io.rows import RowBinding, bound_local_rows, read_bound_rows
from vllm_diffusion_plugin.engine.io.stream import LoadStats, iterate_weights
from vllm_diffusion_plugin.engine.lora.rows import fuse_bound_rows
from vllm_diffusion_plugin.engine.postprocess import PROCESSED_ATTR
from vllm_diffusion_plugin.engine.quant.fp8 import FP8, fuse_fp8_rows, max_over
from vllm_diffusion_plugin.engine.quant.online import LayerNames, local_part, shard_group, transient_rows

logger = init_logger(__name__)


@dataclass(frozen=True)
class DequantizedBinding(RowBinding):
    """Rows of an FP8 checkpoint tensor that vllm-omni's ModelOpt adapter dequantizes into a layer it built unquantized
    (``rows.to(dtype) * scale``: the one per-tensor value, or the rows' own per-channel scales); read and fused by
    :func:`finish`, never by the ordinary row read."""

    scale_key: str = ""


ROW_PROTOCOL = ("scale_granularity", "requantize_rows", "install_rows")
"""What a pre-quantized FP8 method declares to be finished row by row: ``scale_granularity`` (``"tensor"`` /
``"channel"``), ``requantize_rows(rows, scale, top)`` (a part's FP8 rows at its scale, at the layer's largest part
scale) and ``install_rows(layer)`` (marks the layout and the layer processed)."""


@dataclass
class Fp8Layer(LayerNames):
    """One FP8 linear vllm-omni built for a pre-quantized checkpoint, named as in the pipeline."""

    module: str
    method: Any
    parts: list[RowBinding] = field(default_factory=list)
    """Its weight's bindings (one per checkpoint tensor stacked into it), in row order: :func:`bind`."""


def find_fp8_layers(module: nn.Module, *, prefix: str = "") -> list[Fp8Layer]:
    """The pre-quantized FP8 linears of ``module`` (an FP8 ``weight`` before anything is read; names prefixed with
    ``prefix``), or :class:`RowQuantError` naming the first whose method does not declare :data:`ROW_PROTOCOL`.
    Reads nothing."""
    layers = []
    for name, sub in module.named_modules():
        weight = sub._parameters.get("weight") if hasattr(sub, "_parameters") else None
        if weight is None or weight.dtype != FP8:
            continue
        method, full_name = getattr(sub, "quant_method", None), prefix + name
        missing = [attr for attr in ROW_PROTOCOL if not hasattr(method, attr)]
        if missing or method.scale_granularity not in ("tensor", "channel") or weight.dim() != 2:
            raise RowQuantError(
                f"hsdp_weight_load=rank_local reads each rank's rows of a pre-quantized FP8 layer and finishes "
                f"them as the method finishes the whole layer; {type(method).__name__} (layer {full_name}, "
                f"{tuple(weight.shape)}) does not declare how ({', '.join(missing) or 'its scale granularity'} "
                f"missing; see engine/quant/parts): use hsdp_weight_load=full with this checkpoint")
        layers.append(Fp8Layer(full_name, method))
    return layers


def bind(layers: Sequence[Fp8Layer], bindings: Sequence[RowBinding], source: Any) -> None:
    """Give each layer its parts (the traced bindings of its weight, in row order); each part's checkpoint tensor
    must have its ``weight_scale`` beside it in ``source``."""
    by_target: dict[str, list[RowBinding]] = {}
    for binding in bindings:
        by_target.setdefault(binding.target, []).append(binding)
    for layer in layers:
        layer.parts = sorted(by_target.get(layer.weight, ()), key=lambda b: b.start)
        missing = [p.key for p in layer.parts if scale_key(p.key) not in source.tensors]
        if missing:
            raise RowQuantError(f"{layer.weight}: FP8 rows of {', '.join(missing)} come without their weight_scale "
                                f"in {source.folder}")


def scale_key(weight_key: str) -> str:
    """The checkpoint's ``weight_scale`` key beside FP8 weight ``weight_key``."""
    return weight_key.removesuffix(".weight") + ".weight_scale"


def to_final_layout(module: nn.Module, layers: Sequence[Fp8Layer], *, prefix: str) -> None:
    """Before vllm-omni shards ``module`` on ``meta``: a per-tensor layer's ``weight_scale`` (one per part while
    loading) becomes the one 0-dim scale its post-processing ends with (replicated, not sharded)."""
    for layer in layers:
        if layer.per_tensor:
            owner = module.get_submodule(layer.module.removeprefix(prefix))
            owner.register_parameter("weight_scale", nn.Parameter(torch.empty((), device="meta"),
                                                                  requires_grad=False))


def fp8_targets(layers: Sequence[Fp8Layer], bindings: Sequence[RowBinding]) -> set[str]:
    """Targets whose rows come from FP8 checkpoint tensors: the FP8 layers' weights, and the layers vllm-omni built
    unquantized that its adapter dequantizes FP8 tensors into (a LoRA into either is fused by :func:`finish`)."""
    return {layer.weight for layer in layers} | {b.target for b in bindings if isinstance(b, DequantizedBinding)}


def unread_targets(layers: Sequence[Fp8Layer]) -> set[str]:
    """Targets the ordinary row read must leave alone: the per-tensor scales (:func:`finish` reads their parts)."""
    return {layer.scale for layer in layers if layer.per_tensor}


def finish(dit: Any, module: nn.Module, layers: Sequence[Fp8Layer], bindings: Sequence[RowBinding],
           targets: Mapping[str, torch.Tensor], deltas: Sequence[Mapping[str, Any]]):
    """After the ordinary row read: read the per-tensor part scales, fuse the LoRA ``deltas`` (per file, those of the
    FP8 layers' checkpoint tensors) into this rank's rows, requantize the parts to their largest scale, install.
    Returns (checkpoint keys read, bytes read, ``FuseStats`` or None, seconds fusing)."""

    stats = LoadStats()
    dequantized = [b for b in bindings if isinstance(b, DequantizedBinding)]
    keys = sorted({scale_key(p.key) for layer in layers if layer.per_tensor for p in layer.parts} |
                  {b.scale_key for b in dequantized if dit.source.tensors[b.scale_key].nbytes == 4})
    scales = {key: value.float().reshape(()).clone()
              for key, value in iterate_weights(dit.source, stats=stats, keys=keys)} if keys else {}
    per_module: dict[str, list[dict[str, Any]]] = {}  # checkpoint module -> its delta of each file naming it
    for file in deltas:
        for name, delta in file.items():
            per_module.setdefault(name, []).append({name: delta})
    fused, fuse_s, nbytes = [], 0.0, stats.total_bytes
    with torch.no_grad():
        for layer in layers:
            start = time.perf_counter()
            if per_module and (stats_of_layer := _fuse_parts(layer, bindings, targets, per_module, scales,
                                                             fuser=dit.fuser)) is not None:
                fused.append(stats_of_layer)
            fuse_s += time.perf_counter() - start
            if layer.per_tensor:
                _to_top_scale(layer, targets, scales)
            owner = module.get_submodule(layer.module.removeprefix(dit.prefix))
            layer.method.install_rows(owner)
            setattr(owner, PROCESSED_ATTR, True)
        for binding in dequantized:
            start = time.perf_counter()
            stats_of_rows, read_bytes = _dequantize(dit, binding, bindings, targets, per_module, scales)
            if stats_of_rows is not None:
                fused.append(stats_of_rows)
            nbytes += read_bytes
            fuse_s += time.perf_counter() - start
    if per_module:
        raise RowQuantError(f"LoRA targets of {dit.component} are in no FP8 layer's parts: {sorted(per_module)[:10]}")
    logger.info("%s: %d pre-quantized FP8 layers finished on this rank's rows (%d per tensor), %d FP8 tensors' rows "
                "dequantized into layers vllm-omni built unquantized; %d scales read whole (%d bytes)",
                dit.component, len(layers), sum(layer.per_tensor for layer in layers), len(dequantized), len(keys),
                len(keys) * 4)
    read = set(keys) | {b.key for b in dequantized} | {b.scale_key for b in dequantized}
    return read, nbytes, sum(fused[1:], fused[0]) if fused else None, fuse_s


def _fuse_parts(layer: Fp8Layer, bindings: Sequence[RowBinding], targets: Mapping[str, torch.Tensor],
                per_module: dict[str, list[dict[str, Any]]], scales: dict[str, torch.Tensor], *, fuser: Any):
    """Fuse every file's delta of each targeted part into this rank's rows of it (see the module doc); ``fuser``:
    the DiT's ``fused_stream.StreamFuser`` (its module names and fusion options). Returns the ``FuseStats`` or None."""

    weight, total, summed = targets[layer.weight], None, None
    group = shard_group(weight) if layer.per_tensor else None
    for part in layer.parts:
        name = part.key.removesuffix(".weight")
        per_file = per_module.pop(name, None)
        if per_file is None:
            continue
        if summed is None:
            summed = transient_rows(weight, torch.float32)
        local_part(summed).zero_()
        stats = _sum_deltas({layer.weight: summed}, part, bindings, targets, per_file, fuser)
        total = stats if total is None else total + stats
        mine = bound_local_rows(part, weight)
        q = mine[0] if mine is not None else local_part(weight)[:0]
        delta = bound_local_rows(part, summed)[0] if mine is not None else local_part(summed)[:0]
        if layer.per_tensor:
            agree = max_over(group) if group is not None else None
            new_q, scales[scale_key(part.key)] = fuse_fp8_rows(q, scales[scale_key(part.key)], delta,
                                                               per_tensor=True, agree=agree)
            q.copy_(new_q)
        elif mine is not None:
            scale = bound_local_rows(dataclasses.replace(part, target=layer.scale), targets[layer.scale])[0]
            new_q, new_scale = fuse_fp8_rows(q, scale.reshape(-1, 1), delta, per_tensor=False)
            q.copy_(new_q)
            scale.copy_(new_scale.reshape(scale.shape))
    return total


def _sum_deltas(rows: Mapping[str, torch.Tensor], binding: RowBinding, bindings: Sequence[RowBinding],
                targets: Mapping[str, torch.Tensor], per_file: Sequence[dict[str, Any]], fuser: Any):
    """Every file's delta of ``binding``'s checkpoint tensor summed into its rows of ``rows`` (fp32 transients, zero),
    its bias deltas into the bias rows in ``targets``, with the DiT's ``fuser``'s options; the ``FuseStats``."""
    biases = [b for b in bindings if b.key == binding.key.removesuffix(".weight") + ".bias"]
    return fuse_bound_rows({**rows, **{b.target: targets[b.target] for b in biases}}, [binding, *biases], per_file,
                           modules=fuser.modules, chunk_mb=fuser.chunk_mb, check_finite=fuser.check_finite,
                           host_weights=fuser.host_weights)


def _to_top_scale(layer: Fp8Layer, targets: Mapping[str, torch.Tensor], scales: Mapping[str, torch.Tensor]) -> None:
    """A per-tensor layer's parts at their largest scale (the method's ``requantize_rows``), which becomes its one
    scale."""

    weight = targets[layer.weight]
    part_scales = [scales[scale_key(p.key)] for p in layer.parts]
    top = torch.stack(part_scales).max()
    for part, scale in zip(layer.parts, part_scales):
        mine = bound_local_rows(part, weight)
        if mine is not None:
            mine[0].copy_(layer.method.requantize_rows(mine[0], scale, top))
    local_part(targets[layer.scale]).copy_(top)


def _dequantize(dit: Any, binding: DequantizedBinding, bindings: Sequence[RowBinding],
                targets: Mapping[str, torch.Tensor], per_module: dict[str, list[dict[str, Any]]],
                scales: dict[str, torch.Tensor]):
    """This rank's rows of an FP8 checkpoint tensor into the unquantized layer vllm-omni's adapter dequantizes it into:
    the FP8 rows (and per channel their scales) read, a LoRA fused exactly first (as ``full``'s stream fuses it
    before the adapter), then ``rows.to(dtype) * scale.to(dtype)``, the adapter's arithmetic. Returns (the
    ``FuseStats`` or None, bytes read)."""

    target = targets[binding.target]
    mine = bound_local_rows(binding, target)
    count, key_row = (mine[0].shape[0], mine[1]) if mine is not None else (0, binding.key_start)
    info = dit.source.tensors[binding.key]
    q = torch.empty((count, *info.shape[1:]), dtype=info.dtype)
    own = [RowBinding(binding.key, "q", key_start=key_row, rows=count)]
    per_tensor = binding.scale_key in scales
    scale = scales[binding.scale_key] if per_tensor else torch.empty((count,), dtype=torch.float32)
    holders = {"q": q} if per_tensor else {"q": q, "s": scale}
    if not per_tensor:
        own.append(RowBinding(binding.scale_key, "s", key_start=key_row, rows=count))
    read_bytes = read_bound_rows(dit.source, own, holders)[1].total_bytes if count else 0
    name, total = binding.key.removesuffix(".weight"), None
    per_file = per_module.pop(name, None)
    if per_file is not None:
        delta = torch.zeros(q.shape, dtype=torch.float32)
        total = _sum_deltas({"d": delta}, RowBinding(binding.key, "d", key_start=key_row, rows=count), bindings,
                            targets, per_file, dit.fuser)
        group = shard_group(target) if per_tensor else None
        q, new_scale = fuse_fp8_rows(q, scale if per_tensor else scale.reshape(-1, 1), delta, per_tensor=per_tensor,
                                     agree=max_over(group) if group is not None else None)
        scale = new_scale.reshape(()) if per_tensor else new_scale.reshape(-1)
    if mine is not None:
        dtype = mine[0].dtype
        factor = scale.to(dtype) if per_tensor else scale.to(dtype).reshape(-1, 1)
        mine[0].copy_(q.to(dtype) * factor)
    return total, read_bytes
