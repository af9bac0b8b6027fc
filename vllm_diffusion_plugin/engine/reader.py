"""Reading checkpoint bytes with several threads, in the consumer's order, with bounded bytes ahead.

One thread faulting a tensor in from a mapped file (or ``pread``-ing its rows) waits for each request in turn: on
storage where every request costs latency (network file systems, object-store mounts, a FUSE layer) that wait,
not the bandwidth, decides the load time. :func:`read_ahead` runs the reads of the next jobs on ``threads`` worker
threads (the copies and page faults happen in torch and the kernel, outside the GIL) while the consumer handles
the current one, and hands the results back **in job order**, so whatever the consumer does with them -- copy into
parameters, fuse a LoRA, send a broadcast bucket -- happens exactly as with one thread: the loaded weights are
bit-identical. At most ``max_bytes`` of jobs are read ahead of the consumer (a single larger job is read alone),
so the memory a read-ahead holds is bounded whatever the checkpoint. ``threads=1`` reads inline, as before. The
consumer waits at most ``read_timeout_s`` for one read (:func:`bounded_reads`), then fails naming the file and the
offset: a store that stopped answering ends the load, though Linux keeps the stuck thread until the store answers.

Two kinds of job use it: a safetensors tensor viewing a private mapping of its file (``full``, ``broadcast``, the
vllm-omni door; ``pagein.fault_in`` reads its pages in, an I/O error named), and this rank's rows of a tensor read
with ``pread`` straight into its shard (``rank_local``).

Onto an accelerator, :class:`DeviceStaging` owns the rest of the way: a bounded ring of page-locked host buffers
the read threads fill, a copy stream that copies each filled buffer to the device without blocking while the next
are read, and the events that say when a buffer may be filled again. Strategies hand it ``StagedCopy`` items
(where the bytes come from, which device tensor they go to) and never manage buffers themselves.
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.pagein import fault_in, pread_into  # noqa: F401  (re-exported: readers' names)

logger = init_logger(__name__)

J = TypeVar("J")
R = TypeVar("R")

DEFAULT_THREADS = 4
"""Read threads when nothing says otherwise: vllm-omni's own default (``num_weight_load_threads``)."""
DEFAULT_AHEAD_BYTES = 256 << 20
"""Bytes read ahead of the consumer at most (a single larger job is read alone)."""
THREAD_NAME = "diffusion-hsdp-read"


DEFAULT_READ_TIMEOUT_S = 300.0
"""Seconds the consumer waits for one read of the read threads (``read_timeout_s``) when no load set it."""
_read_timeout_s: contextvars.ContextVar[float] = contextvars.ContextVar("read_timeout_s",
                                                                       default=DEFAULT_READ_TIMEOUT_S)


class ReadTimeoutError(TimeoutError):
    """A read handed to the read threads did not complete within ``read_timeout_s``; the message names the file
    and the offset. The thread stays blocked in the kernel (no signal ends a read a FUSE server took); it is a
    daemon thread, so the process's exit does not wait for it -- though Linux may, until the store answers."""


def _stopped_answering(what: str, timeout_s: float) -> ReadTimeoutError:
    return ReadTimeoutError(f"{what}: no answer within {timeout_s:g} s (read_timeout_s): the store stopped answering; "
                            f"the load gives up (a read thread stays blocked in the kernel until the store answers)")


@contextlib.contextmanager
def bounded_reads(timeout_s: float) -> Iterator[None]:
    """Within this block (this thread and context), :func:`read_ahead` waits at most ``timeout_s`` for one read."""
    token = _read_timeout_s.set(float(timeout_s))
    try:
        yield
    finally:
        _read_timeout_s.reset(token)


def bounded(what: str, work: Callable[..., R], *args: Any) -> R:
    """``work(*args)`` -- opening a checkpoint file, reading its header -- on a daemon thread, waited for at most
    the read timeout (:func:`bounded_reads`), then :class:`ReadTimeoutError` naming ``what``. Where a store stopped
    answering, an ``open()`` waits in the kernel too, and nothing ends that wait: FUSE drops a file's cached pages
    on every open, waiting for the page a stalled read holds locked (seen: a peer rank opening the shard another
    rank's read stalled in). Errors of ``work`` are raised as they are."""
    timeout_s = _read_timeout_s.get()
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(work(*args))
        except BaseException as exc:  # noqa: BLE001 -- raised in the caller's thread
            future.set_exception(exc)

    threading.Thread(target=run, name=f"{THREAD_NAME}_open", daemon=True).start()
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        raise _stopped_answering(what, timeout_s) from None


class _Readers:
    """``threads`` daemon threads running submitted reads in order. Not ``ThreadPoolExecutor``: its threads are
    joined at the interpreter's exit, forever when one is stuck in a read that a store never answers."""

    def __init__(self, threads: int) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{THREAD_NAME}_{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, read, job = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(read(job))
                except BaseException as exc:  # noqa: BLE001 -- handed to the consumer, as ThreadPoolExecutor does
                    future.set_exception(exc)

    def submit(self, read: Callable[[J], R], job: J) -> Future:
        future: Future = Future()
        self._queue.put((future, read, job))
        return future

    def close(self, *, wait_s: float) -> None:
        """Stop the threads once their current read ends, waiting at most ``wait_s`` for each."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def read_ahead(jobs: Iterable[J], read: Callable[[J], R], *, threads: int, nbytes: Callable[[J], int],
               max_bytes: int = DEFAULT_AHEAD_BYTES, max_jobs: int | None = None,
               where: Callable[[J], str] | None = None) -> Iterator[tuple[J, R]]:
    """``(job, read(job))`` for every job, in job order, with up to ``threads`` reads running ahead of the
    consumer and at most ``max_bytes`` (by ``nbytes(job)``) and ``max_jobs`` (default ``2 * threads``) jobs read
    but not yet handed back. A job is started only once every job ``max_jobs`` or more places before it was
    handed back and the consumer asked for the next one (what :class:`DeviceStaging` reuses its buffers by).

    A read's exception is raised to the consumer when it reaches that job. The consumer waits at most the read
    timeout (:func:`bounded_reads`, default ``DEFAULT_READ_TIMEOUT_S``) for one job, then raises
    :class:`ReadTimeoutError` naming it by ``where(job)`` (the file and the offset). Leaving early (an exception in
    the consumer, ``close()``) cancels the reads not started and waits for the running ones -- up to the read
    timeout: a thread stuck in the kernel is left behind (a daemon). ``threads=1`` reads inline, unbounded."""
    if threads < 1:
        raise ValueError(f"read threads must be >= 1, got {threads}")
    if threads == 1:
        for job in jobs:
            yield job, read(job)
        return
    timeout_s = _read_timeout_s.get()
    pending: deque[tuple[J, int, Future]] = deque()
    ahead, stuck = 0, []

    def result(job: J, future: Future) -> R:
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            stuck.append(job)
            what = where(job) if where is not None else f"a read of {nbytes(job)} bytes"
            raise _stopped_answering(what, timeout_s) from None

    readers = _Readers(threads)
    try:
        for job in jobs:
            size = nbytes(job)
            while pending and (ahead + size > max_bytes or len(pending) >= (max_jobs or 2 * threads)):
                done, done_size, future = pending.popleft()
                ahead -= done_size
                yield done, result(done, future)
            pending.append((job, size, readers.submit(read, job)))
            ahead += size
        while pending:
            done, _, future = pending.popleft()
            yield done, result(done, future)
    finally:
        for _, _, future in pending:
            future.cancel()
        readers.close(wait_s=0.0 if stuck else timeout_s)


# ---- onto an accelerator: a bounded ring of page-locked buffers and a copy stream -------------------------------
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
        from vllm_diffusion_plugin.engine import platform

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
        from vllm_diffusion_plugin.engine import platform

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
