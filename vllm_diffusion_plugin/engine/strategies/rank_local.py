"""The ``rank_local`` weight-load strategy, for the DiTs of a sharded load: each rank reads only its own rows.

The skeleton is built on ``meta``, sharded with FSDP2 there, only the local shards are allocated, and each rank
reads its own rows of every tensor straight into FSDP's local storage (a row range is one contiguous byte
range -- what safetensors ``get_slice`` reads for a row slice -- read with ``pread`` into the shard, ~1/S of the
checkpoint per rank, nothing memory-mapped); LoRA deltas are fused shard-locally, ``B[rows] @ A`` per rank, so
no rank ever holds a full-size weight or delta. Other components (VAE, encoders) load with ``full``.

Reads and fusion go through ``io.rows.RowBinding`` s: a diffusers module binds each key to itself whole
(:func:`load_rank_local`); a door whose model stacks q/k/v (vllm-omni) traces its bindings and hands them over
(:class:`RowLoad`, :func:`load_bound_rows`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.config import LoadOptions
from vllm_diffusion_plugin.engine.errors import DistributedLoadError, WeightLoadError
from vllm_diffusion_plugin.engine.hsdp import apply_hsdp
from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource
from vllm_diffusion_plugin.engine.io.rows import RowBinding, identity_bindings, read_bound_rows
from vllm_diffusion_plugin.engine.lora.rows import fuse_bound_rows, fuse_local_rows
from vllm_diffusion_plugin.engine.quant.fuse import fuse_files_into_fp8, split_deltas
from vllm_diffusion_plugin.engine.quant.layer import serialized_layers
from vllm_diffusion_plugin.engine.quant.online import QuantLayer, find_layers, quantize_by_block, to_quantized_layout
from vllm_diffusion_plugin.engine.quant.parts import (
    DequantizedBinding,
    Fp8Layer,
    find_fp8_layers,
    finish,
    fp8_targets,
    to_final_layout,
    unread_targets,
)
from vllm_diffusion_plugin.engine.quant.whole import (
    WholeLayer,
    find_whole_layers,
    gather_by_block,
    quant_path,
    to_whole_layout,
)
from vllm_diffusion_plugin.engine.skeleton import build_component
from vllm_diffusion_plugin.engine.strategies.base import ComponentLoad, LoadContext, normalize_lora_files
from vllm_diffusion_plugin.engine.weights import strict_check_exemptions, validate_headers

logger = init_logger(__name__)


def _read_local_rows(source: ComponentSource, targets: dict[str, torch.Tensor], progress: bool | None = None,
                     threads: int = 1, staging: Any = None):
    """This rank's rows of every checkpoint tensor named like a target (a diffusers module's state dict)."""
    return read_bound_rows(source, identity_bindings(source.tensors, targets), targets, progress=progress,
                           threads=threads, staging=staging)


def materialize_local_shards(module: nn.Module, device: torch.device, buffers: dict[str, torch.Tensor]) -> None:
    """Allocate only the local shards (``to_empty``), then put back the buffers' constructed values."""
    module.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            module.get_buffer(name).copy_(value)


def _validated(module: nn.Module, source: ComponentSource, targets: Mapping[str, torch.Tensor],
               layers: Sequence[QuantLayer], whole: Sequence[WholeLayer], *, strict_unexpected: bool) -> set[str]:
    """The headers checked against ``targets`` before any read (online-quantized weights against the layout ``full``
    loads them in; only what their methods add, e.g. scales, is ours); the names the checkpoint need not hold."""
    exempt = strict_check_exemptions(module)
    loads = {layer.weight: (layer.shape, layer.dtype) for layer in layers}
    loads |= {key: (w.inputs[key.rsplit(".", 1)[1]].shape, w.inputs[key.rsplit(".", 1)[1]].dtype)
              for w in whole for key in w.read}
    if layers or whole:
        exempt = {n for n in exempt if not n.startswith(tuple(f"{layer.module}." for layer in [*layers, *whole]))}
        exempt |= {layer.scale for layer in layers} | {key for w in whole for key in w.added}
    checked = {k: (torch.empty((), dtype=loads[k][1]).expand(loads[k][0]) if k in loads else t)
               for k, t in {**loads, **targets}.items() if k not in exempt or k in source.tensors}
    validate_headers(module, checked, source.tensors, exempt=exempt, strict_unexpected=strict_unexpected,
                     origin=str(source.folder))
    return exempt


def load_rank_local(source: ComponentSource, *, context: LoadContext,
                    lora_files: Sequence[tuple[str, float]]) -> ComponentLoad:
    """Load one DiT sharded from the start: meta skeleton -> FSDP2 -> local shards -> own rows -> local LoRA
    (``context.mesh`` and ``context.hsdp`` given: the session sends only sharded DiTs here)."""
    options, report, device = context.options, context.report, context.device
    origin, cls_name = str(source.folder), str(source.config.get("_class_name", "?"))
    with report.phase("build"):
        # parameters on meta in their final dtypes (diffusers' _keep_in_fp32_modules rule); real buffers
        module = build_component(source, dtype=context.dtype, device="meta")
        if context.quantization is not None:
            context.quantization(module)
        layers = find_layers(module, others="skip")  # online-quantized linears whose methods declare rows
        whole = find_whole_layers(module, device=device)  # the others: gathered whole, their layout probed
        buffers = {name: b for name, b in module.named_buffers()}  # real values (rotary tables...)
        module.to("meta")  # buffers too, so FSDP2 moves nothing; their values are restored after to_empty
    with report.phase("lora"):
        files = normalize_lora_files(module, lora_files, strict=options.lora_strict, component=source.name)
    with report.phase("shard"):
        to_quantized_layout(module, layers)  # fp8 [out, in] weights + scales, sharded by rows
        to_whole_layout(module, whole)  # what the methods' own post-processing leaves, contiguous
        shard = apply_hsdp(module, mesh=context.mesh, config=context.hsdp, pattern=options.hsdp_block_pattern,
                           allow_meta=True)
        materialize_local_shards(module, device, buffers)
    targets = module.state_dict(keep_vars=True)
    exempt = _validated(module, source, targets, layers, whole, strict_unexpected=options.strict_unexpected)
    quantized = {layer.weight for layer in layers} | {key for w in whole for key in w.read}
    plain = {k: t for k, t in targets.items() if k not in quantized}
    with report.phase("read"):
        loaded, stats = _read_local_rows(source, plain, context.progress, context.options.threads, context.staging)
    lora = None
    if layers or whole:
        loaded, lora = _quantize_rows(module, layers, whole, source, targets, files, loaded, stats, shard, context)
    missing = set(targets) - loaded - exempt
    if missing:
        raise WeightLoadError(f"{len(missing)} parameter(s)/buffer(s) of {cls_name} were not in "
                              f"{origin}: {', '.join(sorted(missing)[:20])}")
    on_meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()]
               if (t.to_local() if isinstance(t, DTensor) else t).is_meta]
    if on_meta:
        raise DistributedLoadError(f"{len(on_meta)} tensor(s) of {cls_name} ({origin}) are still on "
                                   f"the meta device after the rank-local read: {', '.join(on_meta[:20])}")
    unexpected = sorted(set(source.tensors) - set(targets))
    if unexpected:
        logger.warning("%d checkpoint key(s) in %s have no place in %s and were skipped: %s", len(unexpected),
                       origin, cls_name, ", ".join(unexpected[:20]))
    fp8 = serialized_layers(module)  # a pre-quantized checkpoint's FP8 rows: dequantize, add, requantize
    if fp8 and any(files):
        with report.phase("lora"):
            files, fused = fuse_files_into_fp8(targets, files, fp8, options=options,
                                                        modules=(n for n, _ in module.named_modules()))
            lora = fused if lora is None else lora if fused is None else lora + fused
    rest = [{n: d for n, d in f.items() if f"{n}.weight" not in quantized} for f in files]
    if any(rest):
        with report.phase("lora"):
            fused = fuse_local_rows(module, [f for f in rest if f], chunk_mb=options.lora_device_chunk_mb,
                                    check_finite=options.lora_check_finite, host_weights=options.lora_host_weights)
            lora = fused if lora is None else lora + fused
    logger.info("Rank-local load of %s: read %d tensors' own rows (%.3f GB of %.3f GB) into local shards on %s%s",
                origin, len(loaded), stats.total_bytes / 1e9, source.total_bytes / 1e9, device,
                f"; fused {lora.targets} LoRA targets shard-locally" if lora else "")
    return ComponentLoad(module, bytes_read=stats.total_bytes, tensors=len(loaded), lora=lora, shard=shard,
                         quant_path=quant_path(layers, whole))


def _quantize_rows(module: nn.Module, layers: Sequence[Any], whole: Sequence[WholeLayer], source: ComponentSource,
                   targets: dict[str, torch.Tensor], files: Sequence[dict[str, Any]], loaded: set[str], stats: Any,
                   shard: Any, context: LoadContext):
    """The online-quantized weights, block by block: this rank's rows read into transients, their LoRA deltas fused
    there, then the rows quantized into the fp8 shards (``quantize_by_block``: the row protocol), or each layer
    gathered whole and post-processed by its method (``quant.whole.gather_by_block``). Adds to ``loaded`` and
    ``stats``; returns (loaded, the LoRA's ``FuseStats`` or None)."""
    options, report = context.options, context.report
    modules = [name for name, _ in module.named_modules()]
    lora = []

    def read(transients: dict[str, torch.Tensor]) -> None:
        with report.phase("read"):
            keys, more = read_bound_rows(source, identity_bindings(source.tensors, transients), transients,
                                         progress=False, threads=options.threads, staging=context.staging)
        loaded.update(keys)
        for file, nbytes in more.bytes_per_file.items():
            stats.bytes_per_file[file] = stats.bytes_per_file.get(file, 0) + nbytes
        stats.tensors += more.tensors

    def fuse(transients: dict[str, torch.Tensor], members: Sequence[Any]) -> None:
        names = {layer.module for layer in members}
        subset = [d for d in ({n: x for n, x in f.items() if n in names} for f in files) if d]
        if not subset:
            return
        rows = {**transients, **{f"{n}.bias": targets[f"{n}.bias"] for n in names if f"{n}.bias" in targets}}
        with report.phase("lora"):
            lora.append(fuse_bound_rows(rows, identity_bindings(rows, rows), subset, modules=modules,
                                        chunk_mb=options.lora_device_chunk_mb, check_finite=options.lora_check_finite,
                                        host_weights=options.lora_host_weights))

    if layers:
        quantize_by_block(module, layers, targets=targets, blocks=shard.blocks, read=read, fuse=fuse)
    if whole:
        gather_by_block(module, whole, targets=targets, blocks=shard.blocks, read=read, fuse=fuse)
    total = None
    for stats_one in lora:
        total = stats_one if total is None else total + stats_one
    return loaded, total


def row_layers(module: nn.Module, *, prefix: str, device: torch.device | str = "cpu",
               ) -> tuple[list[QuantLayer], list[Fp8Layer], list[WholeLayer]]:
    """A DiT's quantized linears, as a door built it (vLLM's layerwise wrapping undone): the online-quantized ones
    whose methods declare the row protocol, the pre-quantized FP8 ones, and the online-quantized ones gathered whole
    (their layout probed; ``device``: where a method that cannot run on ``meta`` is probed). Reads nothing."""
    return (find_layers(module, prefix=prefix, detach_layerwise=True, others="skip"),
            find_fp8_layers(module, prefix=prefix),
            find_whole_layers(module, prefix=prefix, device=device, detach_layerwise=True))


def to_row_layout(module: nn.Module, *, prefix: str, quantized: Sequence[QuantLayer],
                  prequantized: Sequence[Fp8Layer], whole: Sequence[WholeLayer] = ()) -> None:
    """The final layout of a DiT's quantized layers, on ``meta`` before it is sharded: fp8 ``[out, in]`` weights and
    their scales (``quant.online.to_quantized_layout``), per-tensor FP8 layers' one scale (``quant.parts``), what the
    other online methods' post-processing leaves (``quant.whole.to_whole_layout``)."""
    to_quantized_layout(module, quantized, prefix=prefix)
    to_final_layout(module, prequantized, prefix=prefix)
    to_whole_layout(module, whole, prefix=prefix)


@dataclass
class RowLoad:
    """A DiT its door sharded on ``meta`` (local shards allocated) and whose checkpoint rows it traced: what
    :func:`load_bound_rows` needs to read, fuse and quantize this rank's rows into it."""

    component: str
    prefix: str
    """The DiT's name in the door's model, with a trailing dot (``""``: the model itself)."""
    module: nn.Module
    bindings: list[RowBinding]
    """Where each checkpoint row lands (targets named in the door's model)."""
    targets: Mapping[str, torch.Tensor]
    """Every parameter and buffer of the door's model by name (DTensors where sharded)."""
    device: torch.device
    quantized: list[QuantLayer] = field(default_factory=list)
    """Its online-quantized linears (``quant.online.find_layers``), their fp8 layout set before sharding."""
    prequantized: list[Fp8Layer] = field(default_factory=list)
    """Its pre-quantized FP8 linears and their parts (``quant.parts``)."""
    whole: list[WholeLayer] = field(default_factory=list)
    """Its online-quantized layers without the row protocol (``quant.whole``), their layout set before sharding."""


@dataclass
class RowsRead:
    """What :func:`load_bound_rows` did on this rank."""

    keys: set[str]
    bytes_read: int
    lora: Any = None
    """``lora.FuseStats`` or None."""
    lora_s: float = 0.0
    quant_path: str | None = None


def load_bound_rows(source: ComponentSource, dit: RowLoad, *, fuser: Any, options: LoadOptions,
                    staging: Any = None) -> RowsRead:
    """This rank's rows of ``source`` into ``dit``: the plain rows read, the pre-quantized FP8 layers finished
    (``quant.parts.finish``), the online-quantized ones read, fused and quantized block by block, then the LoRA of
    ``fuser`` (its deltas keyed by checkpoint names) fused into the plain rows. Unread checkpoint tensors are
    warned about by name."""
    deltas = list(fuser.deltas) if fuser is not None else []
    into = {layer.weight for layer in dit.quantized} | {key for layer in dit.whole for key in layer.read}
    fp8 = dit.prequantized
    plain = [b for b in dit.bindings if b.target not in into | unread_targets(fp8)
             and not isinstance(b, DequantizedBinding)]
    keys, stats = read_bound_rows(source, plain, dit.targets, threads=options.threads, staging=staging)
    bytes_read, lora, lora_s = stats.total_bytes, None, 0.0
    if fp8_into := fp8_targets(fp8, dit.bindings):
        fp8_deltas, deltas = split_bound_deltas(deltas, dit.bindings, fuser.modules, fp8_into) if fuser else ([], [])
        more, nbytes, lora, lora_s = finish(_Dit(source, fuser, dit.component, dit.prefix), dit.module, fp8,
                                            dit.bindings, dit.targets, fp8_deltas)
        keys, bytes_read = keys | more, bytes_read + nbytes
    if dit.quantized or dit.whole:
        _, deltas = split_bound_deltas(deltas, dit.bindings, fuser.modules, into) if fuser else ([], [])
        more, nbytes, lora = _quantize_bound(source, dit, fuser, options=options, staging=staging)
        keys, bytes_read = keys | more, bytes_read + nbytes
    unbound = sorted(set(source.tensors) - keys)
    if unbound:
        logger.warning("%d checkpoint tensor(s) of %s (%s) go into no parameter of %s and were not read: %s",
                       len(unbound), dit.component, source.folder, type(dit.module).__name__,
                       ", ".join(unbound[:20]))
    if fuser is not None and any(deltas):
        start = time.perf_counter()
        fused = fuse_bound_rows(dit.targets, plain, [d for d in deltas if d], modules=fuser.modules,
                                chunk_mb=fuser.chunk_mb, check_finite=fuser.check_finite,
                                host_weights=fuser.host_weights)
        lora, lora_s = (fused if lora is None else lora + fused), time.perf_counter() - start + lora_s
    return RowsRead(keys, bytes_read, lora, lora_s, quant_path(dit.quantized, dit.whole))


@dataclass(frozen=True)
class _Dit:
    """What ``quant.parts.finish`` reads of a DiT: its source, fuser, name and prefix."""

    source: ComponentSource
    fuser: Any
    component: str
    prefix: str


def split_bound_deltas(deltas: Sequence[dict[str, Any]], bindings: Sequence[RowBinding], modules: Iterable[str],
                       quantized: set[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(deltas into quantized targets, the others)``, per LoRA file, by where their weight rows go
    (``quant.fuse.split_deltas`` over the bindings)."""
    modules = set(modules)
    into: dict[str, set[str]] = {}
    for binding in bindings:
        into.setdefault(binding.key, set()).add(binding.target)

    def bound_to_quantized(name: str, delta: Any) -> bool:
        return bool(into.get(f"{name}.weight" if name in modules else name, set()) & quantized)

    split = [split_deltas(file, bound_to_quantized) for file in deltas]
    return [q for q, _ in split], [p for _, p in split]


def _quantize_bound(source: ComponentSource, dit: RowLoad, fuser: Any, *, options: LoadOptions, staging: Any):
    """Read, fuse and quantize this rank's rows of ``dit.quantized`` and ``dit.whole`` block by block; returns
    (checkpoint keys read, bytes read, ``FuseStats`` or None)."""
    keys: set[str] = set()
    nbytes, fused = [0], []
    blocks = [dit.prefix + name for name, sub in dit.module.named_modules() if name and isinstance(sub, FSDPModule)]
    deltas = list(fuser.deltas) if fuser is not None else []

    def read(transients: dict[str, torch.Tensor]) -> None:
        mine = [b for b in dit.bindings if b.target in transients]
        got, stats = read_bound_rows(source, mine, transients, threads=options.threads, staging=staging)
        keys.update(got)
        nbytes[0] += stats.total_bytes

    def fuse(transients: dict[str, torch.Tensor], members: Sequence[QuantLayer]) -> None:
        if fuser is None:
            return
        names = set(transients)
        mine = [b for b in dit.bindings if b.target in names]
        subset = [f for f in split_bound_deltas(deltas, mine, fuser.modules, names)[0] if f]
        if not subset:
            return
        bias_keys = {b.key.removesuffix(".weight") + ".bias" for b in mine}
        rows = mine + [b for b in dit.bindings if b.key in bias_keys]
        fused.append(fuse_bound_rows({**dit.targets, **transients}, rows, subset, modules=fuser.modules,
                                     chunk_mb=fuser.chunk_mb, check_finite=fuser.check_finite,
                                     host_weights=fuser.host_weights))

    if dit.quantized:
        quantize_by_block(dit.module, dit.quantized, targets=dit.targets, blocks=blocks, read=read, fuse=fuse,
                          prefix=dit.prefix)
    if dit.whole:
        gather_by_block(dit.module, dit.whole, targets=dit.targets, blocks=blocks, read=read, fuse=fuse,
                        prefix=dit.prefix)
    return keys, nbytes[0], sum(fused[1:], fused[0]) if fused else None
