"""The ``rank_local`` weight-load strategy, for the DiTs of a sharded load: each rank reads only its own rows.

The skeleton is built on ``meta``, sharded with FSDP2 there, only the local shards are allocated, and each rank
reads its own rows of every tensor straight into FSDP's local storage (a row range is one contiguous byte
range -- what safetensors ``get_slice`` reads for a row slice -- read with ``pread`` into the shard, ~1/S of the
checkpoint per rank, nothing memory-mapped); LoRA deltas are fused shard-locally, ``B[rows] @ A`` per rank, so
no rank ever holds a full-size weight or delta. Other components (VAE, encoders) load with ``full``.
"""

from __future__ import annotations

import math
import os
import struct
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.checkpoint import CheckpointError, ComponentSource
from vllm_diffusion_plugin.engine.strategies.base import (
    ComponentLoad,
    DistributedLoadError,
    LoadContext,
    normalize_lora_files,
)

logger = init_logger(__name__)


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
    rows, size, index = param.shape[0], mesh.size(dim), mesh.get_local_rank(dim)
    chunk = math.ceil(rows / size)  # torch.chunk's split, as FSDP2 and DTensor use
    start = min(rows, index * chunk)
    stop = min(rows, start + chunk)
    local = param.to_local()
    if tuple(local.shape) != (stop - start, *param.shape[1:]):
        raise DistributedLoadError(f"{name}: local shard is {tuple(local.shape)} but rows {start}:{stop} of "
                                   f"{tuple(param.shape)} were expected on shard {index} of {size}")
    return local, start, stop


def _pread_into(fd: int, offset: int, dst: torch.Tensor, file) -> None:
    """Fill the contiguous CPU tensor ``dst`` with the file's bytes at ``offset`` (no mmap, no extra copy)."""
    view = memoryview(dst.detach().view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CheckpointError(f"{file}: unexpected end of file at byte {offset + done} (truncated since it "
                                  f"was resolved?)")
        done += n


def _read_local_rows(source: ComponentSource, targets: dict[str, torch.Tensor]):
    """Read this rank's rows of every checkpoint tensor that has a target; returns (keys loaded, stats).

    A row range of a safetensors tensor is one contiguous byte range (what ``get_slice(key)[a:b]`` reads);
    it is read with ``pread`` straight into the local shard's storage when dtype and device allow, else into
    a row-sized host buffer that is then copied (cast / H2D). Nothing is memory-mapped, so the page cache is
    not charged to the rank's RSS. Each file's header is re-read and compared with the resolved one first.
    """
    from vllm_diffusion_plugin.engine.checkpoint import read_safetensors_header
    from vllm_diffusion_plugin.engine.weights import LoadStats

    stats, loaded = LoadStats(), set()
    if sys.byteorder != "little":
        raise CheckpointError(f"{source.folder}: rank_local reads little-endian safetensors bytes directly; this "
                              f"host is big-endian (use hsdp_weight_load=broadcast)")
    with torch.no_grad():
        for file in source.files:
            keys = [k for k in source.keys_in(file) if k in targets]
            if not keys:
                continue
            header = read_safetensors_header(file)
            changed = [k for k in keys if header.get(k) != source.tensors[k]]
            if changed:
                raise CheckpointError(f"{file}: tensors {changed[:5]} changed since the checkpoint was resolved")
            with open(file, "rb") as f:
                data_start = 8 + struct.unpack("<Q", f.read(8))[0]
                for key in keys:
                    info = source.tensors[key]
                    local, start, stop = local_rows(key, targets[key])
                    if local.dim() == 0:
                        start, stop, row_bytes = 0, 1, info.nbytes
                    else:
                        row_bytes = info.nbytes // max(1, info.shape[0])
                    if stop > start and row_bytes:
                        direct = (local.dtype == info.dtype and local.device.type == "cpu"
                                  and local.is_contiguous())
                        dst = local if direct else torch.empty(local.shape, dtype=info.dtype)
                        _pread_into(f.fileno(), data_start + info.offset + start * row_bytes, dst, file)
                        if not direct:
                            local.copy_(dst)
                        stats.add(file, (stop - start) * row_bytes)
                    loaded.add(key)
    return loaded, stats


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


def fuse_local_rows(module: nn.Module, files: Sequence[dict[str, Any]], *, chunk_mb: int):
    """Fuse LoRA deltas into this rank's rows of ``module``'s (sharded) weights: ``W[rows] += s * B[rows] @ A``
    (and the same rows of bias/full deltas), file after file. Returns the summed ``FuseStats`` or None."""
    from vllm_diffusion_plugin.engine.lora import LoraDelta, fuse_lora

    modules, params = dict(module.named_modules()), dict(module.named_parameters())
    total = None
    for deltas in files:
        shadow, sliced = LocalShards(), {}
        for name, delta in deltas.items():
            owner = modules.get(name)
            weight = owner.weight if owner is not None else params[name]
            w_local, start, stop = local_rows(f"{name}.weight" if owner is not None else name, weight)
            b_local = None
            if delta.bias_delta is not None:
                b_local, b_start, b_stop = local_rows(f"{name}.bias", owner.bias)
                if (b_start, b_stop) != (start, stop):
                    raise DistributedLoadError(f"{name}: this rank holds weight rows {start}:{stop} but bias rows "
                                               f"{b_start}:{b_stop}; cannot fuse the bias delta locally")
            if stop == start:
                continue  # none of this target's rows live here
            rows = slice(start, stop)
            shadow.add(name, w_local, b_local)
            sliced[name] = LoraDelta(delta.A, None if delta.B is None else delta.B[rows], delta.scale,
                                     None if delta.bias_delta is None else delta.bias_delta[rows],
                                     None if delta.full_delta is None else delta.full_delta[rows],
                                     delta.source_keys)
        stats = fuse_lora(shadow, sliced, chunk_mb=chunk_mb)
        total = stats if total is None else total + stats
    return total


def _materialize_local_shards(module: nn.Module, device: torch.device, buffers: dict[str, torch.Tensor]) -> None:
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

    from vllm_diffusion_plugin.engine.hsdp import apply_hsdp
    from vllm_diffusion_plugin.engine.skeleton import build_component
    from vllm_diffusion_plugin.engine.weights import WeightLoadError, strict_check_exemptions, validate_headers

    options, report, device = context.options, context.report, context.device
    origin, cls_name = str(source.folder), str(source.config.get("_class_name", "?"))
    with report.phase("build"):
        # parameters on meta in their final dtypes (diffusers' _keep_in_fp32_modules rule); real buffers
        module = build_component(source, dtype=context.dtype, device="meta")
        buffers = {name: b for name, b in module.named_buffers()}  # real values (rotary tables...)
        module.to("meta")  # buffers too, so FSDP2 moves nothing; their values are restored after to_empty
    with report.phase("lora"):
        files = normalize_lora_files(module, lora_files, strict=options.lora_strict)
    with report.phase("shard"):
        shard = apply_hsdp(module, mesh=context.mesh, config=context.hsdp, pattern=options.hsdp_block_pattern,
                           allow_meta=True)
        _materialize_local_shards(module, device, buffers)
    targets = module.state_dict(keep_vars=True)
    exempt = strict_check_exemptions(module)
    validate_headers(module, targets, source.tensors, exempt=exempt, strict_unexpected=options.strict_unexpected,
                     origin=origin)  # headers only
    with report.phase("read"):
        loaded, stats = _read_local_rows(source, targets)
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
    lora = None
    if files:
        with report.phase("lora"):
            lora = fuse_local_rows(module, files, chunk_mb=options.lora_device_chunk_mb)
    logger.info("Rank-local load of %s: read %d tensors' own rows (%.3f GB of %.3f GB) into local shards on %s%s",
                origin, len(loaded), stats.total_bytes / 1e9, source.total_bytes / 1e9, device,
                f"; fused {lora.targets} LoRA targets shard-locally" if lora else "")
    return ComponentLoad(module, bytes_read=stats.total_bytes, tensors=len(loaded), lora=lora, shard=shard)
