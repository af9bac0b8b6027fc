"""This rank's rows of checkpoint tensors, read straight into its shards (``hsdp_weight_load=rank_local``).

A :class:`RowBinding` says which rows of a checkpoint tensor land in which rows of a target: a diffusers module
binds each key to its own parameter whole (:func:`identity_bindings`); vllm-omni's DiTs, which stack q/k/v into
one parameter, bind several keys into one target (``doors/omni/rank_local.py`` learns them). A row range of a
safetensors tensor is one contiguous byte range, read with ``pread`` into the local shard (~1/S of the checkpoint
per rank; nothing memory-mapped, so the page cache is not charged to the rank's RSS).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from vllm_diffusion_plugin.engine.errors import CheckpointError, DistributedLoadError
from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource
from vllm_diffusion_plugin.engine.io.pagein import pread_into
from vllm_diffusion_plugin.engine.io.staging import StagedCopy
from vllm_diffusion_plugin.engine.io.stream import LoadStats, open_file, unchanged_data_start
from vllm_diffusion_plugin.engine.io.threads import read_ahead
from vllm_diffusion_plugin.engine.progress import progress_bar


def shard_rows(rows: int, *, size: int, index: int) -> tuple[int, int]:
    """``(first row, end row)`` of shard ``index`` of ``size`` over ``rows`` rows: torch.chunk's split, as FSDP2
    and DTensor use (the last shards may be short or empty)."""
    chunk = math.ceil(rows / size)
    start = min(rows, index * chunk)
    return start, min(rows, start + chunk)


def local_rows(name: str, param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(local storage, first row, end row)`` of ``param`` on this rank: a DTensor's local shard and its
    global row range, or a plain tensor whole. Only ``Shard(0)``/``Replicate`` placements are supported."""
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
    that many threads at once (``threads.read_ahead``; every range lands in its own rows, so the result is the same).
    ``staging`` (``staging.DeviceStaging``): rows on its accelerator are ``pread`` into its page-locked ring and copied
    from there without blocking (same result).

    A row range of a safetensors tensor is one contiguous byte range (what ``get_slice(key)[a:b]`` reads);
    it is read with ``pread`` straight into the local shard's storage when dtype and device allow, else into
    a host buffer of those rows that is then copied (cast / H2D). Nothing is memory-mapped, so the page cache
    is not charged to the rank's RSS. Each file's header is re-read and compared with the resolved one first.
    """

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

    data_start = unchanged_data_start(source, file, keys)
    with open_file(file) as f:

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
