"""pytest plugin providing the ``fake_accelerator`` fixture (entry point ``pytest11``).

Importing this module loads nothing heavy; torch and the backend load when the fixture is used.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from vllm_diffusion_plugin.testing.fake_accelerator import FakeAccelerator

_PLATFORM_MODULE = "vllm_diffusion_plugin.engine.platform"


def _clear_usable_device_cache() -> None:
    """Forget the per-process device probe results of ``platform.usable_device``.

    A platform module that was never imported has probed nothing, so it is not imported here.
    """
    platform = sys.modules.get(_PLATFORM_MODULE)
    cache_clear = getattr(getattr(platform, "usable_device", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


FAKE_SIDE_TIMINGS = {"cpu_s": 1.0, "device_s": 0.5}
"""What the fixture tells the LoRA device rule (``lora.fuse.record_side_timings``) about fusing host-resident weights:
through ``fakeacc`` is faster than on the CPU, as on the seed's NPU host, so the rule forwards to the device (what
fix #1's tests pin). Its real timing would measure Python dispatch, not a device; a test of the rule itself records
its own timings."""


def reset_fake_accelerator(accelerator: FakeAccelerator) -> None:
    """Zero the counters, turn off simulated failures, clear the platform's probe cache and set the LoRA rule's
    timings for the fake device (``FAKE_SIDE_TIMINGS``)."""
    import torch

    from vllm_diffusion_plugin.engine.lora.fuse import forget_side_timings, record_side_timings

    accelerator.reset_counters()
    accelerator.clear_failures()
    _clear_usable_device_cache()
    forget_side_timings()
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        record_side_timings(accelerator.device, dtype, **FAKE_SIDE_TIMINGS)


@pytest.fixture
def fake_accelerator() -> Iterator[FakeAccelerator]:
    """The ``fakeacc`` backend (installed once per process), reset on entry and on exit.

    Its ``device`` is a real non-CPU ``torch.device`` whose tensors hold real data; its counters
    tell where copies and math happened. See :mod:`vllm_diffusion_plugin.testing.fake_accelerator`.
    """
    from vllm_diffusion_plugin.testing.fake_accelerator import install

    accelerator = install()
    reset_fake_accelerator(accelerator)
    accelerator.available = True
    try:
        yield accelerator
    finally:
        accelerator.available = False  # outside the fixture, no test sees an accelerator on this host
        reset_fake_accelerator(accelerator)
