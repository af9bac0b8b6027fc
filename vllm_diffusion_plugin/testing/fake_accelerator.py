"""``fakeacc``: a pure-Python accelerator for tests that must know *where* math ran.

Tensors on ``torch.device("fakeacc", 0)`` are real tensors with real data: each device storage is backed by one
host storage, and every op dispatched to the device runs on CPU views of it, so numbers equal CPU numbers bit for
bit while every host<->device copy, allocation and op is counted, and probe / copy / pinned-memory failures can be
simulated. Built on PyTorch's PrivateUse1 Python backend (renamed ``fakeacc``) with ``torch.library`` kernels: a
boxed fallback, ``_copy_from`` (H2D/D2H counting), ``_local_scalar_dense`` and ``resize_``. What works, what does
not (FSDP2's forward, real collectives, ``pin_memory()``) and what the counters mean: docs/development.md, "The fake
accelerator".
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from vllm_diffusion_plugin.testing import fake_streams

__all__ = ["DEVICE_TYPE", "FakeAccelerator", "install"]

DEVICE_TYPE = "fakeacc"
_CPU = torch.device("cpu")
_META = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)
# Indexing ops accept CPU index tensors for device inputs on real accelerators too.
_MIXED_DEVICE_OK = frozenset({"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})
_aten = torch.ops.aten


class _Backing(NamedTuple):
    """The host storage behind one device storage, and a weak reference to that device storage."""

    device_ref: StorageWeakRef
    host: torch.UntypedStorage
    nbytes: int


class _RestoreOnExit(contextlib.AbstractContextManager):
    """Returned by the failure switches: they act at once, and ``with`` also undoes them on exit."""

    def __init__(self, undo: Callable[[], None]) -> None:
        self._undo = undo

    def __exit__(self, *exc_info: object) -> None:
        self._undo()


def _is_dev(x: object) -> bool:
    return isinstance(x, (torch.Tensor, torch.UntypedStorage)) and x.device.type == DEVICE_TYPE


def _geometry(t: torch.Tensor) -> tuple[torch.Size, tuple[int, ...], int]:
    return t.size(), t.stride(), t.storage_offset()


def _set_metadata(t: torch.Tensor, storage: torch.UntypedStorage, size, stride, offset: int) -> None:
    """Point device tensor ``t`` at ``storage`` with the given geometry (no data moves).

    The Meta kernels of ``set_`` and ``as_strided_`` only touch metadata, so they work for any
    device. Device storages are not resizable, which Meta ``set_`` refuses unless the size is
    empty: so attach the storage with zero elements, then ``as_strided_`` (bounds-checked).
    """
    _aten.set_.source_Storage_storage_offset.redispatch(_META, t, storage, 0, (0,), (1,))
    _aten.as_strided_.default.redispatch(_META, t, tuple(size), tuple(stride), offset)


class FakeAccelerator:
    """State of the ``fakeacc`` backend: the storage registry, counters and failure switches.

    There is one per process, returned by :func:`install` (and by the ``fake_accelerator`` fixture).
    """

    def __init__(self) -> None:
        self.device = torch.device(DEVICE_TYPE, 0)
        self.pinned = fake_streams.FakePinned()
        """Page-locked host buffers (``torch.fakeacc.pinned_empty``); see :mod:`.fake_streams`."""
        self.available = False
        """What ``torch.fakeacc.is_available()`` answers. The ``fake_accelerator`` fixture sets it only for
        the duration of a test, so code that looks for "the local accelerator" sees none elsewhere."""
        self._storages: dict[int, _Backing] = {}
        self.reset_counters()
        self.clear_failures()

    # -- counters and failure switches (the test-facing API) ------------------------------------
    def reset_counters(self) -> None:
        """Zero every counter; the peak restarts from the bytes live now."""
        self.h2d_copies = self.h2d_bytes = self.d2h_copies = self.d2h_bytes = self.allocations = 0
        self.h2d_async_bytes = self.d2h_async_bytes = 0
        """Of those bytes, the ones copied asynchronously: non-blocking, from/to pinned memory, on a side stream."""
        self.pinned.allocations = 0
        self.op_counts: Counter[str] = Counter()
        self.peak_bytes = self.memory_allocated()
        """The most bytes live on the device at once since the last reset (taken at each allocation)."""

    def fail_probe(self) -> contextlib.AbstractContextManager:
        """Make every device allocation raise a driver-like ``RuntimeError`` (a failing probe).

        Acts at once until :meth:`clear_failures`; used as ``with fa.fail_probe():`` it ends on exit.
        """
        self._probe_fails = True
        return _RestoreOnExit(lambda: setattr(self, "_probe_fails", False))

    def fail_h2d_after(self, nbytes: int) -> contextlib.AbstractContextManager:
        """Make a host->device copy raise ``torch.OutOfMemoryError`` once the H2D bytes copied since
        this call would exceed ``nbytes``. Acts at once; ``with`` also ends it on exit."""
        self._h2d_budget, self._h2d_spent = nbytes, 0
        return _RestoreOnExit(lambda: setattr(self, "_h2d_budget", None))

    def fail_pinned(self) -> contextlib.AbstractContextManager:
        """Make every page-locked host allocation (``torch.fakeacc.pinned_empty``) raise. Acts at once; ``with``
        also ends it on exit."""
        self.pinned.fails = True
        return _RestoreOnExit(lambda: setattr(self.pinned, "fails", False))

    def clear_failures(self) -> None:
        """Turn off every simulated failure."""
        self._probe_fails = False
        self.pinned.fails = False
        self._h2d_budget: int | None = None
        self._h2d_spent = 0

    def memory_allocated(self) -> int:
        """Bytes of host memory backing live device storages."""
        self._sweep()
        return sum(b.nbytes for b in self._storages.values())

    # -- storage registry -----------------------------------------------------------------------
    def _sweep(self) -> None:
        """Release host storages whose device storage is gone."""
        for ptr, backing in list(self._storages.items()):
            if backing.device_ref.expired():
                del self._storages[ptr]

    def _register(self, host: torch.UntypedStorage) -> torch.UntypedStorage:
        """Make a new device storage backed by ``host`` (an owning CPU storage); count an allocation."""
        if self._probe_fails:
            raise RuntimeError(
                "FAKEACC error: no FAKEACC-capable device is detected "
                "(simulated driver failure: FakeAccelerator.fail_probe() is active)"
            )
        nbytes = host.nbytes()
        if nbytes == 0:  # empty storages share address 0; give each its own
            host = torch.empty(1, dtype=torch.uint8).untyped_storage()
        ptr = host.data_ptr()
        if ptr in self._storages:  # would alias a device storage the op was not given
            raise RuntimeError(f"fakeacc internal error: host memory {ptr:#x} is already a device storage")
        storage = torch._C._construct_storage_from_data_pointer(ptr, self.device, nbytes)
        self._storages[ptr] = _Backing(StorageWeakRef(storage), host, nbytes)
        self.allocations += 1
        self.peak_bytes = max(self.peak_bytes, self.memory_allocated())  # sweeps: what is live right now
        return storage

    def _host_storage(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        """A non-resizable CPU alias of a device storage's backing memory."""
        backing = self._storages.get(storage.data_ptr())
        if backing is None:
            raise RuntimeError("fakeacc: this device storage has no host backing (not created by fakeacc)")
        return torch._C._construct_storage_from_data_pointer(storage.data_ptr(), _CPU, backing.nbytes)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """The CPU view of device tensor ``t``: same memory, dtype, sizes, strides and offset."""
        host_storage = self._host_storage(t.untyped_storage())
        return torch.empty(0, dtype=t.dtype).set_(host_storage, t.storage_offset(), t.size(), t.stride())

    def _on_device(self, storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
        """A device tensor on ``storage`` with the geometry of host tensor ``like``."""
        t = torch._C._acc.create_empty_tensor((0,), like.dtype)
        _set_metadata(t, storage, like.size(), like.stride(), like.storage_offset())
        return t

    # -- kernels --------------------------------------------------------------------------------
    def _fallback(self, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
        """Run any aten op for the device on CPU views of its operands; map results back."""
        name = op._schema.name
        self.op_counts[name] += 1
        leaves = pytree.tree_leaves((args, kwargs))
        if name not in _MIXED_DEVICE_OK and any(_is_dev(x) for x in leaves):
            for x in leaves:
                if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0:
                    raise RuntimeError(
                        f"Expected all tensors to be on the same device, but found at least two "
                        f"devices, {self.device} and cpu! ({name} on fakeacc)"
                    )
        # Host storage address -> device storage, for every device operand; (host view, device
        # tensor, host address before the op) for every device tensor operand.
        dev_storages: dict[int, torch.UntypedStorage] = {}
        pairs: list[tuple[torch.Tensor, torch.Tensor, int]] = []

        def to_host(x: Any) -> Any:
            if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
                return _CPU
            if isinstance(x, torch.UntypedStorage) and _is_dev(x):
                dev_storages[x.data_ptr()] = x
                return self._host_storage(x)
            if not _is_dev(x):
                return x
            # An empty operand (typically an out= result about to be resized) gets its own
            # resizable host tensor; there is no data to alias.
            h = self._host(x) if x.numel() else torch.empty_strided(x.size(), x.stride(), dtype=x.dtype)
            ptr = h.untyped_storage().data_ptr()
            dev_storages[ptr] = x.untyped_storage()
            pairs.append((h, x, ptr))
            return h

        host_args, host_kwargs = pytree.tree_map(to_host, (args, kwargs))
        result = op(*host_args, **host_kwargs)

        def device_storage_of(h: torch.Tensor) -> torch.UntypedStorage:
            storage = dev_storages.get(h.untyped_storage().data_ptr())
            return self._register(h.untyped_storage()) if storage is None else storage

        for h, d, ptr in pairs:  # out= resizes and set_ change their operands' storage or geometry
            moved = h.untyped_storage().data_ptr() != ptr
            if moved or _geometry(h) != _geometry(d):
                storage = device_storage_of(h) if moved else d.untyped_storage()
                _set_metadata(d, storage, h.size(), h.stride(), h.storage_offset())
        same_object = {id(h): d for h, d, _ in pairs}

        def to_device(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) in same_object:  # in-place and out= ops return their operand
                return same_object[id(x)]
            return self._on_device(device_storage_of(x), x)

        return pytree.tree_map(to_device, result)

    def _copy_from(self, src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """``dst.copy_(src)`` where either side is on the device; counts H2D/D2H transfers."""
        self.op_counts["aten::_copy_from"] += 1
        host_side = dst if _is_dev(src) else src
        stream = fake_streams.current_stream()
        deferred = non_blocking and stream is not fake_streams.default_stream() and self.pinned.holds(host_side)
        if not _is_dev(src):
            nbytes = dst.numel() * dst.element_size()
            if self._h2d_budget is not None and self._h2d_spent + nbytes > self._h2d_budget:
                raise torch.OutOfMemoryError(
                    f"FAKEACC out of memory. Tried to copy {nbytes} bytes host->device; "
                    f"{self._h2d_spent} of the {self._h2d_budget}-byte budget set by "
                    f"FakeAccelerator.fail_h2d_after() are used."
                )
            self._h2d_spent += nbytes
            self.h2d_copies += 1
            self.h2d_bytes += nbytes
            self.h2d_async_bytes += nbytes if deferred else 0
        elif not _is_dev(dst):
            self.d2h_copies += 1
            self.d2h_bytes += dst.numel() * src.element_size()
            self.d2h_async_bytes += dst.numel() * src.element_size() if deferred else 0
        host_dst = self._host(dst) if _is_dev(dst) else dst
        host_src = self._host(src) if _is_dev(src) else src
        if deferred:  # runs when waited for, reading the pinned buffer then (fake_streams' module doc)
            stream.enqueue(lambda: host_dst.copy_(host_src))
        else:
            host_dst.copy_(host_src)
        return dst

    def _local_scalar_dense(self, t: torch.Tensor) -> int | float | bool | complex:
        """``t.item()``: a one-element device->host copy."""
        self.op_counts["aten::_local_scalar_dense"] += 1
        self.d2h_copies += 1
        self.d2h_bytes += t.element_size()
        return self._host(t).item()

    def _resize_(self, t: torch.Tensor, size, memory_format=None) -> torch.Tensor:
        """``t.resize_(size)``: keeps the storage when it is big enough, else moves to a bigger one."""
        self.op_counts["aten::resize_"] += 1
        layout = memory_format or torch.contiguous_format
        stride = torch.empty(size, device="meta", memory_format=layout).stride()
        needed = (t.storage_offset() + math.prod(size)) * t.element_size()
        storage = t.untyped_storage()
        if needed > storage.nbytes():
            host = torch.empty(needed, dtype=torch.uint8)
            old = torch.empty(0, dtype=torch.uint8).set_(self._host_storage(storage))
            host[: old.numel()].copy_(old)
            storage = self._register(host.untyped_storage())
        _set_metadata(t, storage, size, stride, t.storage_offset())
        return t


class _DeviceModule:
    """``torch.fakeacc``: what generic code calls through ``getattr(torch, device.type)``."""

    _acc: FakeAccelerator  # set by install() once the device type exists

    def is_available(self) -> bool:
        return self._acc.available

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def set_device(self, device: int | str | torch.device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if index not in (None, 0):
            raise RuntimeError(f"fakeacc has one device (index 0); got {device!r}")

    def synchronize(self, device: object = None) -> None:
        """Run every queued asynchronous copy (all other ops ran synchronously on the host)."""
        fake_streams.synchronize_all()

    # Streams, events and page-locked memory, modelled in fake_streams (torch.cuda / torch.npu have the same calls)
    Stream = staticmethod(fake_streams.new_stream)
    Event = fake_streams.Event
    stream = staticmethod(fake_streams.stream)
    current_stream = staticmethod(fake_streams.current_stream)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` host bytes the device treats as page-locked (torch's own pinning needs C++ hooks)."""
        return self._acc.pinned.empty(nbytes)

    def empty_cache(self) -> None:
        self._acc._sweep()

    def memory_allocated(self, device: object = None) -> int:
        return self._acc.memory_allocated()

    def manual_seed_all(self, seed: int) -> None:
        """Device randomness uses the CPU generator, which ``torch.manual_seed`` already seeds."""


_accelerator: FakeAccelerator | None = None
_libraries: list[torch.library.Library] = []  # registrations live as long as these objects


def install() -> FakeAccelerator:
    """Register the ``fakeacc`` backend (once per process) and return its :class:`FakeAccelerator`.

    Raises ``RuntimeError`` if PrivateUse1 already belongs to another backend, or if this torch
    lacks the private APIs the backend is built on.
    """
    global _accelerator
    if _accelerator is not None:
        return _accelerator
    from torch.utils import backend_registration

    setup = getattr(backend_registration, "_setup_privateuseone_for_python_backend", None)
    acc_module = getattr(torch._C, "_acc", None)
    if (
        setup is None
        or not hasattr(acc_module, "create_empty_tensor")
        or not hasattr(torch._C, "_construct_storage_from_data_pointer")
    ):
        raise RuntimeError(
            "fakeacc needs torch's private _setup_privateuseone_for_python_backend, "
            f"torch._C._acc.create_empty_tensor and torch._C._construct_storage_from_data_pointer; "
            f"torch {torch.__version__} lacks at least one of them (written against torch 2.14)."
        )
    current = torch._C._get_privateuse1_backend_name()
    if current != "privateuseone":
        raise RuntimeError(
            f"Cannot install the fakeacc test backend: PrivateUse1 is already registered as "
            f"{current!r} in this process (it can be registered only once). Run fakeacc tests in a "
            f"process that does not load another PrivateUse1 backend."
        )
    device_module = _DeviceModule()
    setup(DEVICE_TYPE, backend_module=device_module)
    accelerator = device_module._acc = FakeAccelerator()
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(accelerator._fallback, "PrivateUse1")
    kernels = torch.library.Library("aten", "IMPL")
    kernels.impl("_copy_from", accelerator._copy_from, "PrivateUse1")
    kernels.impl("_local_scalar_dense", accelerator._local_scalar_dense, "PrivateUse1")
    kernels.impl("resize_", accelerator._resize_, "PrivateUse1")
    _libraries.extend([fallback, kernels])
    _accelerator = accelerator
    return accelerator


