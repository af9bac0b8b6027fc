"""Test helpers shipped with the plugin: the ``fakeacc`` fake accelerator and its pytest plugin.

Importing this package is cheap; the names below load their module (and torch) on first use.
"""

import importlib

_OWNERS = {"DEVICE_TYPE": "fake_accelerator", "FakeAccelerator": "fake_accelerator", "install": "fake_accelerator",
           "fake_mesh": "fake_mesh", "register_fake_process_group": "fake_mesh"}
__all__ = sorted(_OWNERS)


def __getattr__(name: str) -> object:
    if name in _OWNERS:
        return getattr(importlib.import_module(f"{__name__}.{_OWNERS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
