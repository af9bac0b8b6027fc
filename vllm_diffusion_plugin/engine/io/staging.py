"""Host bytes onto an accelerator through a bounded ring of page-locked buffers and a copy stream.

:class:`DeviceStaging` owns the way: read threads (``threads.read_ahead``) fill the ring, a copy stream copies each
filled buffer to the device without blocking while the next are read, and a buffer is filled again only once its
copy completed (its event). Strategies hand it :class:`StagedCopy` items (where the bytes come from, which device
tensor they go to) and never manage buffers themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine import platform
from vllm_diffusion_plugin.engine.io.threads import DEFAULT_THREADS, read_ahead

logger = init_logger(__name__)


DEFAULT_PINNED_BYTES = 256 << 20
"""Page-locked host memory one staged copy holds at most (``pinned_staging_mb``)."""


_MIN_SLOT_BYTES = 1 << 20


_fallback_logged: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class StagedCopy:
    """One host->device copy: the bytes ``fill(buffer, start)`` writes (bytes ``[start, start + len(buffer))`` of
    the source, in the source's ``dtype``) land in the contiguous device tensor ``dst``, cast on the device where
    ``dst``'s dtype differs. ``tag`` is handed back once the copy was issued; ``where`` names the source."""

    dst: torch.Tensor
    dtype: torch.dtype
    fill: Callable[[torch.Tensor, int], None]
    tag: Any = None
    where: Callable[[int], str] | None = None
    """Names the source at byte ``start`` in errors (``"<file> at byte N"``)."""

    @property
    def nbytes(self) -> int:
        return self.dst.numel() * self.dtype.itemsize


def tensor_bytes(tensor: torch.Tensor) -> Callable[[torch.Tensor, int], None]:
    """``fill`` for a contiguous CPU tensor (a mapped checkpoint tensor: its pages are faulted in by the copy)."""
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return lambda buffer, start: buffer.copy_(flat[start:start + buffer.numel()])


@dataclass(frozen=True)
class _Chunk:
    copy: StagedCopy
    start: int
    nbytes: int
    slot: int
    last: bool


def _chunk_where(chunk: _Chunk) -> str:
    if chunk.copy.where is not None:
        return chunk.copy.where(chunk.start)
    return f"a staged read of {chunk.nbytes} bytes into {tuple(chunk.copy.dst.shape)} at byte {chunk.start}"


class DeviceStaging:
    """Host bytes onto an accelerator at the host's floors: read threads fill a bounded ring of page-locked
    buffers, each filled buffer is copied to the device with a non-blocking copy on a copy stream while the next
    ones are read, and a buffer is filled again only once the copy that read it completed (its event).

    A pageable ``dst.copy_(host)`` runs at a fraction of the link (6.9 vs 54 GB/s on an H200 host) and blocks
    the reader; here the reads and the copies overlap. ``slots`` buffers of ``max_bytes / slots`` each (at least
    1 MiB each): the bound is what the process pins. Results are bit-identical to a plain copy; a dtype cast (fp32
    checkpoint, bf16 module) happens on the device after the copy, so the link carries the source bytes.
    """

    def __init__(self, device: torch.device, *, max_bytes: int = DEFAULT_PINNED_BYTES, slots: int = 8) -> None:
        if slots < 2:
            raise ValueError(f"staging needs at least 2 buffers, got {slots}")
        self.device = device
        self.slot_bytes = max(_MIN_SLOT_BYTES, max_bytes // slots // 4096 * 4096)
        self._buffers = [platform.pinned_empty(self.slot_bytes, device) for _ in range(slots)]
        self._events: list[Any] = [None] * slots
        self._stream = platform.new_stream(device)

    @classmethod
    def open(cls, device: torch.device, *, max_bytes: int = DEFAULT_PINNED_BYTES,
             threads: int = DEFAULT_THREADS) -> DeviceStaging | None:
        """Staging for ``device``, or None when there is nothing to stage (a CPU or meta target, ``max_bytes``
        0) or pinned memory or a stream cannot be had -- then the caller copies as before (logged once per
        device and reason)."""
        if device.type in ("cpu", "meta") or max_bytes <= 0:
            return None
        try:
            return cls(device, max_bytes=max_bytes, slots=max(2, 2 * threads))
        except Exception as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if (str(device), reason) not in _fallback_logged:
                _fallback_logged.add((str(device), reason))
                logger.info("No pinned staging for %s (%s): weights are copied from pageable memory", device,
                            reason)
            return None

    def copy(self, copies: Iterable[StagedCopy], *, threads: int = 1) -> Iterator[Any]:
        """Issue every copy in order, yielding each one's ``tag`` once its bytes are on their way: work issued on
        the device's current stream after that sees them (it waits for the copy's event, on the device). When
        the iteration ends, normally or not, every issued copy has completed."""
        slots, current = len(self._buffers), platform.current_stream(self.device)

        def chunks() -> Iterator[_Chunk]:
            n = 0
            for item in copies:
                if not item.dst.is_contiguous() or item.dst.device.type != self.device.type:
                    raise ValueError(f"staged copy into a {'non-contiguous ' if not item.dst.is_contiguous() else ''}"
                                     f"{tuple(item.dst.shape)} tensor on {item.dst.device}; staging is for "
                                     f"contiguous tensors on {self.device}")
                step = self.slot_bytes // item.dtype.itemsize * item.dtype.itemsize  # whole source elements
                starts = range(0, item.nbytes, step) if item.nbytes else [0]
                for start in starts:
                    yield _Chunk(item, start, min(step, item.nbytes - start), n % slots, start + step >= item.nbytes)
                    n += 1

        def read(chunk: _Chunk) -> None:  # in a read thread
            if self._events[chunk.slot] is not None:
                self._events[chunk.slot].synchronize()  # the copy that last read this buffer is done
            chunk.copy.fill(self._buffers[chunk.slot][:chunk.nbytes], chunk.start)

        try:
            for chunk, _ in read_ahead(chunks(), read, threads=threads, nbytes=lambda c: c.nbytes,
                                       max_bytes=slots * self.slot_bytes, max_jobs=slots, where=_chunk_where):
                item = chunk.copy
                with platform.on_stream(self.device, self._stream):
                    if chunk.start == 0:  # the destination's memory may have served the current stream before
                        self._stream.wait_stream(current)
                    if chunk.nbytes:
                        src = self._buffers[chunk.slot][:chunk.nbytes].view(item.dtype)
                        first = chunk.start // item.dtype.itemsize
                        item.dst.view(-1)[first:first + src.numel()].copy_(src, non_blocking=True)
                    event = platform.new_event(self.device)
                    event.record(self._stream)
                self._events[chunk.slot] = event
                if chunk.last:
                    current.wait_event(event)
                    yield item.tag
        finally:
            self._stream.synchronize()  # every issued copy read its buffer (also on an error: buffers may go)

    def copy_all(self, copies: Iterable[StagedCopy], *, threads: int = 1) -> None:
        """``copy`` to the end."""
        for _ in self.copy(copies, threads=threads):
            pass


def to_device(tensors: Iterable[torch.Tensor], device: torch.device, staging: DeviceStaging | None, *,
              threads: int = 1) -> list[torch.Tensor]:
    """Each host tensor as a new contiguous tensor on ``device`` (same dtype and values), through ``staging``
    when there is one, else with plain copies."""
    tensors = list(tensors)
    out = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in tensors]
    if staging is None:
        for dst, src in zip(out, tensors):
            dst.copy_(src)
        return out
    sources = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    staging.copy_all((StagedCopy(dst, src.dtype, tensor_bytes(src)) for dst, src in zip(out, sources)),
                     threads=threads)
    return out


def place_module(module: torch.nn.Module, device: torch.device, staging: DeviceStaging | None, *,
                 threads: int = 1) -> None:
    """``module.to(device)``; with ``staging``, its host parameters and buffers are copied through it instead
    (parameters stay the same objects; tensors elsewhere, e.g. on ``meta``, are left where they are)."""
    if staging is None:
        module.to(device)
        return
    host = [(owner, name, tensor) for owner in module.modules()
            for name, tensor in [*owner._parameters.items(), *owner._buffers.items()]
            if tensor is not None and tensor.device.type == "cpu"]
    moved = to_device((t.detach() for _, _, t in host), device, staging, threads=threads)
    with torch.no_grad():
        for (owner, name, tensor), new in zip(host, moved):
            if not isinstance(tensor, torch.nn.Parameter):
                owner._buffers[name] = new
            elif torch._has_compatible_shallow_copy_type(tensor, new):
                tensor.data = new
            else:  # as nn.Module._apply does where ``.data =`` cannot change the tensor type (a Python backend)
                torch.utils.swap_tensors(tensor, torch.nn.Parameter(new, requires_grad=tensor.requires_grad))
