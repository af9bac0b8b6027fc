"""Reading checkpoint bytes with several threads, in the consumer's order, with bounded bytes ahead.

On storage where every request costs latency (network file systems, object stores, FUSE) one thread waiting for
each read in turn decides the load time. :func:`read_ahead` runs the reads of the next jobs on ``threads`` daemon
threads while the consumer handles the current one and hands the results back **in job order**, so what the
consumer does with them happens exactly as with one thread: the loaded weights are bit-identical. At most
``max_bytes`` of jobs are read ahead (a larger single job is read alone); ``threads=1`` reads inline. The consumer
waits at most ``read_timeout_s`` for one read (:func:`bounded_reads`), then fails naming the file and the offset;
:func:`bounded` bounds an ``open()`` or a header read the same way.
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
from typing import Any, TypeVar

from vllm_diffusion_plugin.engine.errors import ReadTimeoutError

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


