"""The ``rank_local`` weight-load strategy, for the DiTs of a sharded load: each rank reads only its own rows.

The skeleton is built on ``meta``, sharded with FSDP2 there, only the local shards are allocated, and each rank
reads its own rows of every tensor straight into FSDP's local storage (a row range is one contiguous byte
range -- what safetensors ``get_slice`` reads for a row slice -- read with ``pread`` into the shard, ~1/S of the
checkpoint per rank, nothing memory-mapped); LoRA deltas are fused shard-locally, ``B[rows] @ A`` per rank, so
no rank ever holds a full-size weight or delta. Other components (VAE, encoders) load with ``full``.

Reads and fusion go through :class:`RowBinding` (rows of a checkpoint tensor -> rows of a target): a diffusers
module binds each key to itself whole (:func:`identity_bindings`); vllm-omni's DiTs, which stack q/k/v into one
parameter, bind several keys into one target (``doors/omni/rank_local.py`` learns them).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine import prequant, quant_shards
from vllm_diffusion_plugin.engine.checkpoint import CheckpointError, ComponentSource
from vllm_diffusion_plugin.engine.reader import pread_into
from vllm_diffusion_plugin.engine.strategies.base import (
    ComponentLoad,
    DistributedLoadError,
    LoadContext,
    normalize_lora_files,
)

logger = init_logger(__name__)


def shard_rows(rows: int, *, size: int, index: int) -> tuple[int, int]:
    """``(first row, end row)`` of shard ``index`` of ``size`` over ``rows`` rows: torch.chunk's split, as FSDP2
    and DTensor use (the last shards may be short or empty)."""
    chunk = math.ceil(rows / size)
    start = min(rows, index * chunk)
    return start, min(rows, start + chunk)


def local_rows(name: str, param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(local storage, first row, end row)`` of ``param`` on this rank: a DTensor's local shard and its
    global row range, or a plain tensor whole. Only ``Shard(0)``/``Replicate`` placements are supported."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return param, 0, (param.shape[0] if param.dim() else 0)
    shard_dims = [i for i, p in enumerate(param.placements) if type(p) is Shard and p.dim == 0]
    odd = [p for p in param.placements if not (type(p) is Replicate or (type(p) is Shard and p.dim == 0))]
    if odd or len(shard_dims) != 1:
        raise DistributedLoadError(f"{name}: placements {param.placements} are not (Replicate, ..., Shard(0)); "
                                   f"rank_local reads row ranges only; use hsdp_weight_load=broadcast")
    mesh, dim = param.device_mesh, shard_dims[0]
    size, index = mesh.size(dim), mesh.get_local_rank(dim)
    start, stop = shard_rows(param.shape[0], size=size, index=index)
    local = param.to_local()
    if tuple(local.shape) != (stop - start, *param.shape[1:]):
        raise DistributedLoadError(f"{name}: local shard is {tuple(local.shape)} but rows {start}:{stop} of "
                                   f"{tuple(param.shape)} were expected on shard {index} of {size}")
    return local, start, stop


@dataclass(frozen=True)
class RowBinding:
    """Rows ``[start, start + rows)`` of the target tensor ``target`` hold rows ``[key_start, key_start + rows)``
    of the checkpoint tensor ``key`` (``rows=None``: all of its rows). A diffusers module's parameter is bound
    to its own key whole; a stacked parameter (vllm-omni's ``to_qkv``) has one binding per checkpoint tensor."""

    key: str
    target: str
    start: int = 0
    key_start: int = 0
    rows: int | None = None
    """None: from ``start`` to the target's last row (a binding of a whole tensor)."""


def identity_bindings(keys: Iterable[str], targets: Mapping[str, torch.Tensor]) -> list[RowBinding]:
    """Each checkpoint key that names a target, bound to it whole (a diffusers module: names are keys)."""
    return [RowBinding(key, key) for key in keys if key in targets]


def bound_local_rows(binding: RowBinding, target: torch.Tensor):
    """``(local view, first key row)`` of the rows of ``binding`` this rank holds, or None when it holds none.
    A 0-dim target is one row."""
    local, first, end = local_rows(binding.target, target)
    if local.dim() == 0:
        return local, 0
    rows = target.shape[0] - binding.start if binding.rows is None else binding.rows
    lo, hi = max(first, binding.start), min(end, binding.start + rows)
    if hi <= lo:
        return None
    return local[lo - first:hi - first], binding.key_start + lo - binding.start


def read_bound_rows(source: ComponentSource, bindings: Sequence[RowBinding],
                    targets: Mapping[str, torch.Tensor], *, progress: bool | None = None, threads: int = 1,
                    staging: Any = None):
    """Read this rank's rows of every bound checkpoint tensor into its targets; returns (keys read, stats).
    ``progress``: a bar of this rank's bytes on rank 0 (``engine.progress``). ``threads``: row ranges read by
    that many threads at once (``reader.read_ahead``; every range lands in its own rows, so the result is the same).
    ``staging`` (``reader.DeviceStaging``): rows on its accelerator are ``pread`` into its page-locked ring and copied
    from there without blocking (same result).

    A row range of a safetensors tensor is one contiguous byte range (what ``get_slice(key)[a:b]`` reads);
    it is read with ``pread`` straight into the local shard's storage when dtype and device allow, else into
    a host buffer of those rows that is then copied (cast / H2D). Nothing is memory-mapped, so the page cache
    is not charged to the rank's RSS. Each file's header is re-read and compared with the resolved one first.
    """
    from vllm_diffusion_plugin.engine.progress import progress_bar
    from vllm_diffusion_plugin.engine.weights import LoadStats

    stats, loaded = LoadStats(), set()
    if sys.byteorder != "little":
        raise CheckpointError(f"{source.folder}: rank_local reads little-endian safetensors bytes directly; this "
                              f"host is big-endian (use hsdp_weight_load=broadcast)")
    by_key: dict[str, list[RowBinding]] = {}
    for binding in bindings:
        by_key.setdefault(binding.key, []).append(binding)
    mine = sum(found[0].numel() * source.tensors[b.key].dtype.itemsize for b in bindings if b.key in source.tensors
               and (found := bound_local_rows(b, targets[b.target])) is not None)
    bar = progress_bar(total=mine, desc=f"Loading {source.name} (own rows)", progress=progress)
    try:
        with torch.no_grad():
            for file in source.files:
                keys = [k for k in source.keys_in(file) if k in by_key]
                if keys:
                    _read_file_rows(source, file, keys, by_key, targets, stats, bar, threads, staging)
                    loaded.update(keys)
    finally:
        if bar is not None:
            bar.close()
    return loaded, stats


def _read_file_rows(source: ComponentSource, file: Any, keys: Sequence[str], by_key: Mapping[str, list[RowBinding]],
                    targets: Mapping[str, torch.Tensor], stats: Any, bar: Any, threads: int = 1,
                    staging: Any = None) -> None:
    """``read_bound_rows`` for the ``keys`` of one file, after checking its header is still the resolved one."""
    from vllm_diffusion_plugin.engine import file_reads
    from vllm_diffusion_plugin.engine.checkpoint import unchanged_data_start
    from vllm_diffusion_plugin.engine.reader import StagedCopy, read_ahead

    data_start = unchanged_data_start(source, file, keys)
    with file_reads.open_file(file) as f:

        def rows() -> Iterator[tuple[torch.Tensor, torch.dtype, int]]:  # (destination rows, dtype, file offset)
            for key in keys:
                info = source.tensors[key]
                row_bytes = info.nbytes // max(1, info.shape[0]) if info.shape else info.nbytes
                for binding in by_key[key]:
                    found = bound_local_rows(binding, targets[binding.target])
                    if found is None:
                        continue
                    dst, key_row = found
                    if tuple(dst.shape[1:]) != tuple(info.shape[1:]):
                        raise CheckpointError(f"{file}: rows of {key} {tuple(info.shape)} do not fit "
                                              f"{binding.target} rows {tuple(dst.shape)}")
                    if dst.numel():
                        yield dst, info.dtype, data_start + info.offset + key_row * row_bytes

        def done(nbytes: int) -> None:
            stats.add(file, nbytes)
            if bar is not None:
                bar.update(nbytes)

        if staging is not None:
            def copies() -> Iterator[StagedCopy]:
                for dst, dtype, offset in rows():
                    nbytes = dst.numel() * dtype.itemsize
                    if dst.device.type == staging.device.type and dst.is_contiguous():
                        yield StagedCopy(dst, dtype, lambda buf, start, at=offset: pread_into(
                            f.fileno(), at + start, buf, file), nbytes,
                            lambda start, at=offset: f"{file} at byte {at + start}")
                    else:
                        _read_rows(f.fileno(), dst, dtype, offset, file)
                        done(nbytes)

            for nbytes in staging.copy(copies(), threads=threads):
                done(nbytes)
            return

        def jobs():  # (destination rows, buffer read into, file offset), in file order
            for dst, dtype, offset in rows():
                direct = dst.dtype == dtype and dst.device.type == "cpu" and dst.is_contiguous()
                yield dst, dst if direct else torch.empty(dst.shape, dtype=dtype), offset

        def read(job) -> None:
            _, buffer, offset = job
            pread_into(f.fileno(), offset, buffer, file)

        for (dst, buffer, _), _ in read_ahead(jobs(), read, threads=threads,
                                               nbytes=lambda job: job[1].numel() * job[1].element_size(),
                                               where=lambda job: f"{file} at byte {job[2]}"):
            if buffer is not dst:
                dst.copy_(buffer)
            done(buffer.numel() * buffer.element_size())


def _read_rows(fd: int, dst: torch.Tensor, dtype: torch.dtype, offset: int, file: Any) -> None:
    """One row range read at once (a destination the staging ring cannot fill: on the host, or strided)."""
    buffer = torch.empty(dst.shape, dtype=dtype)
    pread_into(fd, offset, buffer, file)
    dst.copy_(buffer)


def _read_local_rows(source: ComponentSource, targets: dict[str, torch.Tensor], progress: bool | None = None,
                     threads: int = 1, staging: Any = None):
    """This rank's rows of every checkpoint tensor named like a target (a diffusers module's state dict)."""
    return read_bound_rows(source, identity_bindings(source.tensors, targets), targets, progress=progress,
                           threads=threads, staging=staging)


class LocalShards(nn.Module):
    """This rank's rows of LoRA target weights (and biases) as plain parameters sharing FSDP's local storage,
    named like the targets, so ``lora.fuse_lora`` fuses them with its own device rule and checks."""

    def add(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        owner: nn.Module = self
        for part in name.split("."):
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        owner.register_parameter("weight", nn.Parameter(weight.detach(), requires_grad=False))
        if bias is not None:
            owner.register_parameter("bias", nn.Parameter(bias.detach(), requires_grad=False))


def fuse_bound_rows(targets: Mapping[str, torch.Tensor], bindings: Sequence[RowBinding],
                    files: Sequence[dict[str, Any]], *, modules: Iterable[str], chunk_mb: int,
                    check_finite: bool = False, host_weights: str = "auto"):
    """Fuse LoRA deltas (keyed by checkpoint module names) into this rank's rows of their bound targets:
    ``W[rows] += s * B[key rows] @ A`` (and the same key rows of bias / full deltas), file after file.

    ``modules``: the checkpoint's module names (a delta target that is not one is a bare parameter). Returns
    the summed ``FuseStats`` or None."""
    from vllm_diffusion_plugin.engine.lora import fuse_lora

    modules = set(modules)
    by_key: dict[str, list[RowBinding]] = {}
    for binding in bindings:
        by_key.setdefault(binding.key, []).append(binding)

    unbound = [name for deltas in files for name in deltas
               if (f"{name}.weight" if name in modules else name) not in by_key]
    if unbound:
        raise DistributedLoadError(f"LoRA targets {unbound[:10]}: their checkpoint tensors go into no parameter")

    def bound(key: str) -> list[tuple[torch.Tensor, int]]:
        found = [bound_local_rows(b, targets[b.target]) for b in by_key.get(key, ())]
        return [f for f in found if f is not None]

    total = None
    for deltas in files:
        shadow, sliced = LocalShards(), {}
        for name, delta in deltas.items():
            weight_key = f"{name}.weight" if name in modules else name
            biases = {} if delta.bias_delta is None else {row: view for view, row in bound(f"{name}.bias")}
            for i, (w_local, first) in enumerate(bound(weight_key)):
                rows = slice(first, first + (w_local.shape[0] if w_local.dim() else 1))
                b_local = None
                if delta.bias_delta is not None:
                    b_local = biases.get(first)
                    if b_local is None or b_local.shape[0] != w_local.shape[0]:
                        raise DistributedLoadError(f"{name}: this rank holds weight rows {rows.start}:{rows.stop} "
                                                   f"but not the same bias rows; cannot fuse the bias delta locally")
                target = name if i == 0 else f"{name}_{i}"
                shadow.add(target, w_local, b_local)
                sliced[target] = dataclasses.replace(
                    delta, B=None if delta.B is None else delta.B[rows],
                    bias_delta=None if delta.bias_delta is None else delta.bias_delta[rows],
                    full_delta=None if delta.full_delta is None else delta.full_delta[rows])
        stats = fuse_lora(shadow, sliced, chunk_mb=chunk_mb, check_finite=check_finite, host_weights=host_weights)
        total = stats if total is None else total + stats
    return total


def fuse_local_rows(module: nn.Module, files: Sequence[dict[str, Any]], *, chunk_mb: int,
                    check_finite: bool = False, host_weights: str = "auto"):
    """``fuse_bound_rows`` for a diffusers module, whose parameter names are its checkpoint keys."""
    targets = dict(module.named_parameters())
    return fuse_bound_rows(targets, identity_bindings(targets, targets), files,
                           modules=(name for name, _ in module.named_modules()), chunk_mb=chunk_mb,
                           check_finite=check_finite, host_weights=host_weights)


def materialize_local_shards(module: nn.Module, device: torch.device, buffers: dict[str, torch.Tensor]) -> None:
    """Allocate only the local shards (``to_empty``), then put back the buffers' constructed values."""
    module.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            module.get_buffer(name).copy_(value)


def load_rank_local(source: ComponentSource, *, context: LoadContext,
                    lora_files: Sequence[tuple[str, float]]) -> ComponentLoad:
    """Load one DiT sharded from the start: meta skeleton -> FSDP2 -> local shards -> own rows -> local LoRA.

    Needs ``context.mesh`` and ``context.hsdp`` (the pipeline sends only sharded DiTs here)."""
    from torch.distributed.tensor import DTensor

    from vllm_diffusion_plugin.engine.fp8_layer import serialized_layers
    from vllm_diffusion_plugin.engine.hsdp import apply_hsdp
    from vllm_diffusion_plugin.engine.skeleton import build_component
    from vllm_diffusion_plugin.engine.weights import WeightLoadError, strict_check_exemptions, validate_headers

    options, report, device = context.options, context.report, context.device
    origin, cls_name = str(source.folder), str(source.config.get("_class_name", "?"))
    with report.phase("build"):
        # parameters on meta in their final dtypes (diffusers' _keep_in_fp32_modules rule); real buffers
        module = build_component(source, dtype=context.dtype, device="meta")
        if context.quantization is not None:
            context.quantization(module)
        layers = quant_shards.find_layers(module)  # online-quantized linears (refused here if not row-wise)
        buffers = {name: b for name, b in module.named_buffers()}  # real values (rotary tables...)
        module.to("meta")  # buffers too, so FSDP2 moves nothing; their values are restored after to_empty
    with report.phase("lora"):
        files = normalize_lora_files(module, lora_files, strict=options.lora_strict, component=source.name)
    with report.phase("shard"):
        quant_shards.to_quantized_layout(module, layers)  # fp8 [out, in] weights + scales, sharded by rows
        shard = apply_hsdp(module, mesh=context.mesh, config=context.hsdp, pattern=options.hsdp_block_pattern,
                           allow_meta=True)
        materialize_local_shards(module, device, buffers)
    targets = module.state_dict(keep_vars=True)
    exempt = strict_check_exemptions(module)
    quantized = {layer.weight: layer for layer in layers}
    if layers:  # their weights are checked against the dtype full loads them in; only the scales are ours
        exempt = {n for n in exempt if not n.startswith(tuple(f"{layer.module}." for layer in layers))}
        exempt |= {layer.scale for layer in layers}
    checked = {k: (torch.empty((), dtype=quantized[k].dtype).expand(quantized[k].shape) if k in quantized else t)
               for k, t in targets.items() if k not in exempt or k in source.tensors}
    validate_headers(module, checked, source.tensors, exempt=exempt, strict_unexpected=options.strict_unexpected,
                     origin=origin)  # headers only
    plain = {k: t for k, t in targets.items() if k not in quantized}
    with report.phase("read"):
        loaded, stats = _read_local_rows(source, plain, context.progress, context.options.threads, context.staging)
    lora = None
    if layers:
        loaded, lora = _quantize_rows(module, layers, source, targets, files, loaded, stats, shard, context)
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
            files, fused = prequant.fuse_files_into_fp8(targets, files, fp8, options=options,
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
    return ComponentLoad(module, bytes_read=stats.total_bytes, tensors=len(loaded), lora=lora, shard=shard)


def _quantize_rows(module: nn.Module, layers: Sequence[Any], source: ComponentSource, targets: dict[str, torch.Tensor],
                   files: Sequence[dict[str, Any]], loaded: set[str], stats: Any, shard: Any, context: LoadContext):
    """The online-quantized weights, block by block (``quant_shards.quantize_by_block``): this rank's rows read
    into transients, their LoRA deltas fused there, the rows quantized into the fp8 shards. Adds to ``loaded``
    and ``stats``; returns (loaded, the LoRA's ``FuseStats`` or None)."""
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

    quant_shards.quantize_by_block(module, layers, targets=targets, blocks=shard.blocks, read=read, fuse=fuse)
    total = None
    for stats_one in lora:
        total = stats_one if total is None else total + stats_one
    return loaded, total
