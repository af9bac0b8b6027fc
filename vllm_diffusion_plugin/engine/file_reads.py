"""Reading one safetensors file's tensors for ``weights.iterate_weights``: views of a private mapping of the file
(:func:`mapped_file`), or ``pread`` into a staging buffer (:class:`FileReads`); every error naming the file and the
tensor (:func:`named`). Where a view cannot be had (a tensor whose start does not suit its dtype's alignment) its
bytes are read with ``pread``: a store failing the read is then an error, not a SIGBUS (``pagein``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vllm_diffusion_plugin.engine.checkpoint import CheckpointError, TensorInfo, data_start  # noqa: F401 (readers' name)

if TYPE_CHECKING:
    from vllm_diffusion_plugin.engine.checkpoint import ComponentSource


def mapped_file(source: ComponentSource, file: Path, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors viewing one private (copy-on-write) mapping of a safetensors file: reading them costs page
    faults on the page cache, writing one copies only the pages it touches, and nothing reaches the file.
    A tensor whose offset does not suit its dtype's alignment is read with ``pread`` instead."""
    from vllm_diffusion_plugin.engine.pagein import pread_tensor
    from vllm_diffusion_plugin.engine.reader import bounded

    start0 = data_start(file)
    size, storage = bounded(f"{file} (mapping it)", _mapping, file)
    for key in keys:
        info = source.tensors[key]
        start = start0 + info.offset
        if start + info.nbytes > size:
            raise CheckpointError(f"{file}: error while reading tensor {key!r}: it ends at byte "
                                  f"{start + info.nbytes}, the file has {size} bytes (truncated since it was resolved?)")
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, start, (info.nbytes,), (1,))
        if mapped_at(start, info) is None:  # read, not viewed: a failing store is then an error, not a SIGBUS
            raw = pread_tensor(file, start, raw)
        yield key, raw.view(info.dtype).view(info.shape)


def _mapping(file: Path) -> tuple[int, torch.UntypedStorage]:
    size = file.stat().st_size
    return size, torch.UntypedStorage.from_file(str(file), shared=False, nbytes=size)


def open_file(file: Path):
    """``open(file, "rb")``, waited for at most the read timeout (``reader.bounded``)."""
    from vllm_diffusion_plugin.engine.reader import bounded

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
    """``fill`` callables for ``reader.StagedCopy``: each tensor's bytes ``pread`` from its safetensors file into the
    staging buffer (one kernel copy from the page cache, no mapping, no page faults), errors naming the file and
    the tensor. Each file's header is read again when it is first opened and must still be the resolved one; one
    descriptor per file, closed on exit."""

    def __init__(self, source: ComponentSource) -> None:
        self.source = source
        self._open: dict[Path, tuple[int, int]] = {}

    def fill(self, key: str):
        from vllm_diffusion_plugin.engine.reader import pread_into

        info = self.source.tensors[key]
        fd, data_start = self._descriptor(info.file)
        return lambda buffer, start: named(info.file, key, pread_into, fd, data_start + info.offset + start,
                                            buffer, info.file)

    def where(self, key: str):
        """``StagedCopy.where`` for ``key`` (after ``fill(key)``): its file and the byte a chunk starts at."""
        info = self.source.tensors[key]
        data_start = self._open[info.file][1]
        return lambda start: f"{info.file} at byte {data_start + info.offset + start} (tensor {key!r})"

    def _descriptor(self, file: Path) -> tuple[int, int]:
        if file not in self._open:
            from vllm_diffusion_plugin.engine.checkpoint import unchanged_data_start
            from vllm_diffusion_plugin.engine.reader import bounded

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
