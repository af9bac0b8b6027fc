"""Streams, events and page-locked host memory for ``fakeacc``, modelled so that ordering bugs show as wrong data.

A real accelerator runs a non-blocking copy from page-locked host memory asynchronously on the stream it was
issued on: the host may go on, and a staging buffer refilled before the copy's event completed hands the device
the *new* bytes. ``fakeacc`` models exactly that: a non-blocking copy between a device tensor and a buffer from
:func:`FakePinned.empty` issued on a side stream (inside ``torch.fakeacc.stream(s)``) is **queued**, not run; it
runs when something waits for it (``Event.synchronize``, ``Stream.synchronize``, ``wait_event`` /
``wait_stream``, ``torch.fakeacc.synchronize``), reading the host buffer *then*. Every other copy (pageable
memory, blocking, the default stream) runs at once, as a real device's synchronous copies appear to.

Nothing runs on its own, so ``Event.query()`` is False until someone waited: code that polls instead of waiting
would spin (a real device finishes eventually; code here must wait). ``torch.Stream`` / ``torch.Event`` (the
C++ generic ones) are dummies for a Python backend: the plugin uses ``torch.<device type>.Stream`` etc., as it
does for ``torch.cuda`` and ``torch.npu``.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_lock = threading.RLock()  # copies may be queued and flushed from several reader threads


class Stream:
    """A fake device stream: a queue of deferred copies, run in order when waited for."""

    def __init__(self, device: object = None, priority: int = 0) -> None:
        self.device = device
        self._pending: deque[tuple[int, Callable[[], None]]] = deque()
        self.enqueued = self.completed = 0

    def enqueue(self, work: Callable[[], None]) -> None:
        with _lock:
            self.enqueued += 1
            self._pending.append((self.enqueued, work))

    def run_until(self, mark: int) -> None:
        """Run the queued work up to (and including) the ``mark``-th item ever enqueued."""
        with _lock:
            while self._pending and self._pending[0][0] <= mark:
                _, work = self._pending.popleft()
                work()
                self.completed += 1

    def synchronize(self) -> None:
        self.run_until(self.enqueued)

    def query(self) -> bool:
        return not self._pending

    def wait_stream(self, other: Stream) -> None:
        other.synchronize()  # work on this stream runs at once, so waiting means finishing the other's queue

    def wait_event(self, event: Event) -> None:
        event.synchronize()


class Event:
    """A fake device event: a position in one stream's queue."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._stream: Stream | None = None
        self._mark = 0

    def record(self, stream: Stream | None = None) -> None:
        self._stream = stream or current_stream()
        self._mark = self._stream.enqueued

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.run_until(self._mark)

    def query(self) -> bool:
        return self._stream is None or self._stream.completed >= self._mark

    def wait(self, stream: Stream | None = None) -> None:
        self.synchronize()


_DEFAULT = Stream()
_current = threading.local()


def current_stream(device: object = None) -> Stream:
    return getattr(_current, "stream", _DEFAULT)


def default_stream(device: object = None) -> Stream:
    return _DEFAULT


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """``with torch.fakeacc.stream(s):`` -- ops issued inside go to ``s``."""
    previous = current_stream()
    _current.stream = s or previous
    try:
        yield
    finally:
        _current.stream = previous


def synchronize_all() -> None:
    """What ``torch.fakeacc.synchronize()`` waits for: every stream created so far."""
    for s in list(_streams):
        s.synchronize()


_streams: list[Stream] = []


def new_stream(device: object = None, priority: int = 0) -> Stream:
    s = Stream(device, priority)
    _streams.append(s)
    return s


class FakePinned:
    """Host buffers the fake device treats as page-locked (real torch cannot pin for a Python backend)."""

    def __init__(self) -> None:
        self._buffers: dict[int, tuple[StorageWeakRef, int]] = {}
        self.allocations = 0
        self.fails = False

    def empty(self, nbytes: int) -> torch.Tensor:
        if self.fails:
            raise RuntimeError("FAKEACC error: cannot allocate page-locked host memory "
                               "(simulated: FakeAccelerator.fail_pinned() is active)")
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self._buffers[buffer.untyped_storage().data_ptr()] = (StorageWeakRef(buffer.untyped_storage()), nbytes)
        self.allocations += 1
        return buffer

    def holds(self, t: torch.Tensor) -> bool:
        """Whether host tensor ``t`` lies in a live buffer from :meth:`empty`."""
        found = self._buffers.get(t.untyped_storage().data_ptr())
        return found is not None and not found[0].expired()

    def live_bytes(self) -> int:
        """Bytes of the page-locked buffers still alive."""
        for ptr, (ref, _) in list(self._buffers.items()):
            if ref.expired():
                del self._buffers[ptr]
        return sum(nbytes for _, nbytes in self._buffers.values())
