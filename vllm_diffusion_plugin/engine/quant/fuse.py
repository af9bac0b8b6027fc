"""A LoRA fused exactly into FP8 layers: every file's delta of a layer summed in fp32, added once to the
dequantized rows, the rows requantized once (``fp8.fuse_fp8_rows``) -- per tensor with the amax agreed by the ranks
holding its rows. Requantizing after each file would round twice, the first rounding at that file's scale and
magnitudes landing several FP8 steps of the final scale away where the next file's delta cancels (measured on the
tiny Wan2.2: up to 50)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.io.rows import identity_bindings
from vllm_diffusion_plugin.engine.lora.rows import fuse_bound_rows
from vllm_diffusion_plugin.engine.quant.fp8 import CHUNK_ELEMENTS, fuse_fp8_rows, max_over
from vllm_diffusion_plugin.engine.quant.online import local_part, shard_group, transient_rows

logger = init_logger(__name__)


def fuse_transient_bytes(numel: int) -> int:
    """What :func:`fuse_fp8_layers` holds at most while fusing one layer's ``numel`` local elements: the fp32 delta
    and the requantized FP8 copy whole (5 bytes each), one row chunk (``quant.fp8.CHUNK_ELEMENTS``) of fp32
    dequantized, fused, divided and clamped rows (16 bytes each)."""
    return 5 * numel + 16 * min(numel, CHUNK_ELEMENTS)


def split_deltas(deltas: Mapping[str, Any], quantized: Callable[[str, Any], bool]) -> tuple[dict[str, Any],
                                                                                      dict[str, Any]]:
    """``(the deltas into quantized weights, the others)`` of one LoRA file's deltas (keyed by module name);
    ``quantized(name, delta)`` says which go into a quantized weight."""
    into = {n: d for n, d in deltas.items() if quantized(n, d)}
    return into, {n: d for n, d in deltas.items() if n not in into}


def into_layers(layers: Iterable[str]) -> Callable[[str, Any], bool]:
    """``split_deltas``' rule for FP8 layers by name: a delta of a layer's weight (a delta of its bias alone is an
    ordinary one: the weight is not requantized)."""
    layers = set(layers)
    return lambda name, delta: name in layers and (delta.A is not None or delta.full_delta is not None)


def fuse_fp8_layers(targets: Mapping[str, torch.Tensor], files: Sequence[Mapping[str, Any]], *,
                    modules: Iterable[str], chunk_mb: int, check_finite: bool = False, host_weights: str = "auto"):
    """Fuse every LoRA file's deltas of FP8 layers (``files``, in order, each keyed by module name) into this rank's
    rows of them, one requantization per layer: the files' deltas summed in fp32 (file after file, into zeros),
    the sum added once to the dequantized rows, the rows requantized once. ``targets`` holds each layer's ``weight``
    and ``weight_scale`` (and ``bias``), plain tensors or the DTensors FSDP2 shards by rows. Every rank holding rows
    of a layer must call this with the same files (per-tensor scales are agreed per layer, in the order the layers
    first appear in ``files``). Returns the ``FuseStats`` of the deltas or None."""

    modules, total = list(modules), None
    layers: dict[str, list[dict[str, Any]]] = {}  # layer -> its delta of each file naming it, in file order
    for deltas in files:
        for name, delta in deltas.items():
            layers.setdefault(name, []).append({name: delta})
    with torch.no_grad():
        for name, per_file in layers.items():  # one layer at a time: its transient is its rows in fp32
            weight, scale = targets[f"{name}.weight"], targets[f"{name}.weight_scale"]
            summed = transient_rows(weight, torch.float32)
            local_part(summed).zero_()
            rows = {f"{name}.weight": summed, **({f"{name}.bias": targets[f"{name}.bias"]}
                                                 if f"{name}.bias" in targets else {})}
            stats = fuse_bound_rows(rows, identity_bindings(rows, rows), per_file, modules=modules,
                                    chunk_mb=chunk_mb, check_finite=check_finite, host_weights=host_weights)
            total = stats if total is None else total + stats
            q, s = local_part(weight), local_part(scale)
            per_tensor = s.dim() == 0
            group = shard_group(weight) if per_tensor else None  # per tensor and sharded: agree on the amax
            agree = max_over(group) if group is not None else None
            new_q, new_scale = fuse_fp8_rows(q, s if per_tensor else s.reshape(-1, 1), local_part(summed),
                                             per_tensor=per_tensor, agree=agree)
            q.copy_(new_q)
            s.copy_(new_scale.reshape(s.shape))
            del summed, rows, new_q
            if len(per_file) > 1:
                logger.debug("%s.weight %s: %d LoRA files' deltas summed in fp32, requantized once", name,
                             tuple(weight.shape), len(per_file))
    return total


def fuse_files_into_fp8(targets: Mapping[str, torch.Tensor], files: Sequence[Mapping[str, Any]],
                        layers: Iterable[str], *, modules: Iterable[str], options) -> tuple[list[dict], Any]:
    """Every LoRA file's deltas of FP8 ``layers`` fused together (:func:`fuse_fp8_layers`: one requantization per
    layer, whatever the number of files); returns the files' other deltas (for the ordinary fusion, file after file)
    and the ``FuseStats`` or None."""
    layers = list(layers)
    split = [split_deltas(deltas, into_layers(layers)) for deltas in files]
    fp8 = [mine for mine, _ in split if mine]
    total = fuse_fp8_layers(targets, fp8, modules=modules, chunk_mb=options.lora_device_chunk_mb,
                            check_finite=options.lora_check_finite, host_weights=options.lora_host_weights) \
        if fp8 else None
    return [others for _, others in split], total
