"""A component's checkpoint tensors as a stream: deterministic order, bytes counted, every error naming the file.

:func:`iterate_weights` yields ``(name, tensor)`` from a resolved ``checkpoint.ComponentSource``: files in source
order, keys in on-disk order. A safetensors tensor views a private (copy-on-write) mapping of its file
(:func:`mapped_file`), its pages read in first by ``io.pagein.fault_in`` (a failing store is an error naming the file
and the byte, never a SIGBUS), by the loading thread or ``threads`` read threads ahead (``threads.read_ahead``);
onto an accelerator each tensor's bytes are ``pread`` into the staging ring instead (:class:`FileReads`,
``staging.DeviceStaging``). Pickle files are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_diffusion_plugin.engine.errors import CheckpointError
from vllm_diffusion_plugin.engine.io import pagein
from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource
from vllm_diffusion_plugin.engine.io.headers import TensorInfo, read_safetensors_header
from vllm_diffusion_plugin.engine.io.pagein import pread_tensor
from vllm_diffusion_plugin.engine.io.staging import DeviceStaging, StagedCopy
from vllm_diffusion_plugin.engine.io.threads import bounded, read_ahead
from vllm_diffusion_plugin.engine.progress import progress_bar


def mapped_file(source: ComponentSource, file: Path, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors viewing one private (copy-on-write) mapping of a safetensors file: reading them costs page
    faults on the page cache, writing one copies only the pages it touches, and nothing reaches the file.
    A tensor whose offset does not suit its dtype's alignment is read with ``pread`` instead."""

    start0 = data_start(file)
    size, storage = bounded(f"{file} (mapping it)", _mapping, file)
    for key in keys:
        info = source.tensors[key]
        start = start0 + info.offset
        if start + info.nbytes > size:
            raise CheckpointError(f"{file}: error while reading tensor {key!r}: it ends at byte "
                                  f"{start + info.nbytes}, the file has {size} bytes (truncated since it was "
                                  f"resolved?)")
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, start, (info.nbytes,), (1,))
        if mapped_at(start, info) is None:  # read, not viewed: a failing store is then an error, not a SIGBUS
            raw = pread_tensor(file, start, raw)
        yield key, raw.view(info.dtype).view(info.shape)


def _mapping(file: Path) -> tuple[int, torch.UntypedStorage]:
    size = file.stat().st_size
    return size, torch.UntypedStorage.from_file(str(file), shared=False, nbytes=size)


def open_file(file: Path):
    """``open(file, "rb")``, waited for at most the read timeout (``threads.bounded``)."""
    return bounded(f"{file} (opening it)", open, file, "rb")


def mapped_at(start: int, info: TensorInfo) -> int | None:
    """``start`` where ``mapped_file`` hands out a view of the mapping for a tensor starting there, else None (a
    start that does not suit the dtype's alignment: a copy)."""
    return None if start % info.dtype.itemsize else start


def named(file: Path | str, key: str, work, *args):
    """``work(*args)``, its error raised as a ``CheckpointError`` naming the file and the tensor."""
    try:
        return work(*args)
    except Exception as exc:
        raise CheckpointError(f"{file}: error while reading tensor {key!r}: "
                              f"{str(exc).removeprefix(f'{file}: ')}") from exc


class FileReads:
    """``fill`` callables for ``StagedCopy``: each tensor's bytes ``pread`` from its safetensors file into the
    staging buffer (one kernel copy from the page cache, no mapping, no page faults), errors naming the file and
    the tensor. Each file's header is read again when it is first opened and must still be the resolved one; one
    descriptor per file, closed on exit."""

    def __init__(self, source: ComponentSource) -> None:
        self.source = source
        self._open: dict[Path, tuple[int, int]] = {}

    def fill(self, key: str):
        info = self.source.tensors[key]
        fd, data_start = self._descriptor(info.file)
        return lambda buffer, start: named(info.file, key, pagein.pread_into, fd, data_start + info.offset + start,
                                            buffer, info.file)

    def where(self, key: str):
        """``StagedCopy.where`` for ``key`` (after ``fill(key)``): its file and the byte a chunk starts at."""
        info = self.source.tensors[key]
        data_start = self._open[info.file][1]
        return lambda start: f"{info.file} at byte {data_start + info.offset + start} (tensor {key!r})"

    def _descriptor(self, file: Path) -> tuple[int, int]:
        if file not in self._open:

            data_start = unchanged_data_start(self.source, file, self.source.keys_in(file))
            self._open[file] = (bounded(f"{file} (opening it)", os.open, file, os.O_RDONLY), data_start)
        return self._open[file]

    def close(self) -> None:
        for fd, _ in self._open.values():
            os.close(fd)
        self._open.clear()

    def __enter__(self) -> FileReads:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass
class LoadStats:
    """Bytes and tensors read so far (a mutable counter a caller passes in to report bytes read per rank)."""

    bytes_per_file: dict[Path, int] = field(default_factory=dict)
    tensors: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_file.values())

    def add(self, file: Path, nbytes: int) -> None:
        self.bytes_per_file[file] = self.bytes_per_file.get(file, 0) + nbytes
        self.tensors += 1


def _progress_bar(source: ComponentSource, total: int, progress: bool | None):
    return progress_bar(total=total, desc=f"Loading {source.name}", progress=progress)


def _open_pickle(file: Path) -> dict[str, torch.Tensor]:
    try:
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{file}: cannot load with torch.load(weights_only=True): {exc}") from exc


def _iter_file(source: ComponentSource, file: Path, keys: list[str],
               map_private: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    if map_private and source.format == "safetensors":
        yield from mapped_file(source, file, keys)
        return
    if source.format == "pickle":
        state = _open_pickle(file)
        if isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        for key in keys:
            if key not in state:
                raise CheckpointError(f"{file}: key {key!r} vanished since the checkpoint was resolved")
            yield key, state[key]
        return
    from safetensors import safe_open
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:
        raise CheckpointError(f"{file}: cannot open safetensors file: {exc}") from exc
    with handle:
        for key in keys:
            try:
                tensor = handle.get_tensor(key)
            except Exception as exc:
                raise CheckpointError(f"{file}: error while reading tensor {key!r}: {exc}") from exc
            yield key, tensor


class WeightStream(Iterator[tuple[str, torch.Tensor]]):
    """The iterator ``iterate_weights`` returns; ``.source`` lets consumers name the file of each key."""

    def __init__(self, source: ComponentSource, generator: Iterator[tuple[str, torch.Tensor]]):
        self.source = source
        self._generator = generator

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._generator)

    def close(self) -> None:
        self._generator.close()


def iterate_weights(source: ComponentSource, *, stats: LoadStats | None = None, keys: Collection[str] | None = None,
                    progress: bool | None = None, map_private: bool = False, threads: int = 1,
                    staging: DeviceStaging | None = None) -> WeightStream:
    """Yield ``(name, cpu_tensor)`` for every tensor of ``source`` (or only ``keys``), deterministically.

    ``stats`` (optional) accumulates bytes per file. A progress bar over bytes is shown on rank 0 when
    stderr is a terminal and the component is > 1 GiB, or when ``progress=True``; ``progress=False``
    never shows one. A tensor whose file changed since it was resolved raises ``CheckpointError``.
    ``map_private``: safetensors tensors view a copy-on-write mapping of their file (``mapped_file``).
    Safetensors tensors (not staged) view a mapping of their file and are read in before they are yielded
    (``io.pagein.fault_in``: a failing store is an error naming the file and the byte, not a SIGBUS): by the loading
    thread, or with ``threads`` > 1 by that many threads ahead of the consumer (``read_ahead``), still
    yielded in the same order; stats and the bar count a tensor when it is yielded.
    ``staging`` (safetensors): every tensor is yielded on its accelerator, copied through its page-locked ring by
    ``threads`` threads (the caller's copies from it then run at device speed); same values.
    """
    return WeightStream(source, _generate(source, stats, keys, progress, map_private, threads, staging))


def _generate(source: ComponentSource, stats: LoadStats | None, keys: Collection[str] | None,
              progress: bool | None, map_private: bool = False, threads: int = 1,
              staging: DeviceStaging | None = None) -> Iterator[tuple[str, torch.Tensor]]:

    wanted = None if keys is None else set(keys)
    plan = [(file, [k for k in source.keys_in(file) if wanted is None or k in wanted]) for file in source.files]
    bar = _progress_bar(source, sum(source.tensors[k].nbytes for _, ks in plan for k in ks), progress)
    staged = staging is not None and source.format == "safetensors"
    mapped = source.format == "safetensors" and not staged  # viewed in a mapping, its pages read in by fault_in
    items = ((file, key, tensor) for file, file_keys in plan
             for key, tensor in _iter_file(source, file, file_keys, map_private or mapped))
    starts: dict[Path, int] = {}

    def read(item: tuple[Path, str, torch.Tensor]) -> torch.Tensor | None:
        # on the read threads (or inline with one): the pages are read in here, an I/O error named where the
        # consumer's copy touching them would die of SIGBUS; None, or the tensor read by pread instead (a kernel
        # without MADV_POPULATE_READ: pagein.fault_in)
        if not mapped:
            return None
        file, key, tensor = item
        if file not in starts:
            starts[file] = data_start(file)
        at = mapped_at(starts[file] + source.tensors[key].offset, source.tensors[key])
        return named(file, key, pagein.fault_in, tensor, file, at) if at is not None else None

    def where(item: tuple[Path, str, torch.Tensor]) -> str:
        file, key, tensor = item
        return f"{file} at byte {tensor.storage_offset() * tensor.element_size()} (tensor {key!r})"

    reads = FileReads(source)

    def copies() -> Iterator[StagedCopy]:  # straight from the files into device tensors
        for file, file_keys in plan:
            for key in file_keys:
                info = source.tensors[key]
                dst = torch.empty(info.shape, dtype=info.dtype, device=staging.device)
                yield StagedCopy(dst, info.dtype, reads.fill(key), (file, key, dst), reads.where(key))

    handed = (staging.copy(copies(), threads=threads) if staged else
              (item if instead is None else (*item[:2], instead)
               for item, instead in read_ahead(items, read, threads=threads if mapped else 1,
                                                      nbytes=lambda item: item[2].nbytes, where=where)))
    try:
        for file, key, tensor in handed:
            info = source.tensors[key]
            if tuple(tensor.shape) != info.shape or tensor.dtype != info.dtype:
                raise CheckpointError(f"{file}: tensor {key!r} is {list(tensor.shape)} {tensor.dtype} but "
                                      f"its header said {list(info.shape)} {info.dtype}; file changed?")
            nbytes = tensor.numel() * tensor.element_size()
            if stats is not None:
                stats.add(file, nbytes)
            if bar is not None:
                bar.update(nbytes)
            yield key, tensor
    finally:
        reads.close()
        if bar is not None:
            bar.close()


def unchanged_data_start(source, file: Path, keys) -> int:
    """Where the data of safetensors ``file`` starts, once its header (read again) still describes ``keys`` as
    ``source`` resolved them; ``CheckpointError`` naming the changed tensors otherwise. For readers that ``pread``
    tensors at their resolved offsets."""
    header = read_safetensors_header(file)
    changed = [k for k in keys if header.get(k) != source.tensors[k]]
    if changed:
        raise CheckpointError(f"{file}: tensors {changed[:5]} changed since the checkpoint was resolved")
    return data_start(file)


def data_start(file: Path) -> int:
    """Where the data of safetensors ``file`` starts (its header length read again, waited for at most the read
    timeout)."""
    return bounded(f"{file} (reading its header)", _data_start, file)


def _data_start(file: Path) -> int:
    with open(file, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]
