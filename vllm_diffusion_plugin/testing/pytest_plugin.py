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


def reset_fake_accelerator(accelerator: FakeAccelerator) -> None:
    """Zero the counters, turn off simulated failures and clear the platform's probe cache."""
    accelerator.reset_counters()
    accelerator.clear_failures()
    _clear_usable_device_cache()


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
