"""Reading checkpoint bytes with several threads, in the consumer's order, with bounded bytes ahead.

One thread faulting a tensor in from a mapped file (or ``pread``-ing its rows) waits for each request in turn: on
storage where every request costs latency (network file systems, object-store mounts, a FUSE layer) that wait,
not the bandwidth, decides the load time. :func:`read_ahead` runs the reads of the next jobs on ``threads`` worker
threads (the copies and page faults happen in torch and the kernel, outside the GIL) while the consumer handles
the current one, and hands the results back **in job order**, so whatever the consumer does with them -- copy into
parameters, fuse a LoRA, send a broadcast bucket -- happens exactly as with one thread: the loaded weights are
bit-identical. At most ``max_bytes`` of jobs are read ahead of the consumer (a single larger job is read alone),
so the memory a read-ahead holds is bounded whatever the checkpoint. ``threads=1`` reads inline, as before.

Two kinds of job use it: a safetensors tensor viewing a private mapping of its file (``full``, ``broadcast``, the
vllm-omni door; :func:`fault_in` touches every page of it once), and this rank's rows of a tensor read with
``pread`` straight into its shard (``rank_local``).
"""

from __future__ import annotations

import mmap
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

J = TypeVar("J")
R = TypeVar("R")

DEFAULT_THREADS = 4
"""Read threads when nothing says otherwise: vllm-omni's own default (``num_weight_load_threads``)."""
DEFAULT_AHEAD_BYTES = 256 << 20
"""Bytes read ahead of the consumer at most (a single larger job is read alone)."""
THREAD_NAME = "diffusion-hsdp-read"


def read_ahead(jobs: Iterable[J], read: Callable[[J], R], *, threads: int, nbytes: Callable[[J], int],
               max_bytes: int = DEFAULT_AHEAD_BYTES) -> Iterator[tuple[J, R]]:
    """``(job, read(job))`` for every job, in job order, with up to ``threads`` reads running ahead of the
    consumer and at most ``max_bytes`` (by ``nbytes(job)``) and ``2 * threads`` jobs read but not yet handed back.

    A read's exception is raised to the consumer when it reaches that job; leaving early (an exception in the
    consumer, ``close()``) cancels the reads not started and waits for the running ones, so no thread outlives
    the iteration."""
    if threads < 1:
        raise ValueError(f"read threads must be >= 1, got {threads}")
    if threads == 1:
        for job in jobs:
            yield job, read(job)
        return
    pending: deque[tuple[J, int, Future]] = deque()
    ahead = 0
    with ThreadPoolExecutor(threads, thread_name_prefix=THREAD_NAME) as pool:
        try:
            for job in jobs:
                size = nbytes(job)
                while pending and (ahead + size > max_bytes or len(pending) >= 2 * threads):
                    done, done_size, future = pending.popleft()
                    ahead -= done_size
                    yield done, future.result()
                pending.append((job, size, pool.submit(read, job)))
                ahead += size
            while pending:
                done, _, future = pending.popleft()
                yield done, future.result()
        finally:
            for _, _, future in pending:
                future.cancel()


def fault_in(tensor: torch.Tensor) -> None:
    """Touch every page of a tensor viewing a mapped file once, so the consumer's copy finds it in memory."""
    if tensor.numel() == 0 or not tensor.is_contiguous():
        return
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    flat[::mmap.PAGESIZE].max()  # one byte per page: the kernel reads the page (and its readahead) here
    flat[-1].item()  # the last page, when the bytes do not start on a page boundary
