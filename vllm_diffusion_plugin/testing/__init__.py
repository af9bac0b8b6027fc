"""Test helpers shipped with the plugin: the ``fakeacc`` fake accelerator and its pytest plugin.

Importing this package is cheap; the names below load :mod:`.fake_accelerator` (and torch) on
first use.
"""

__all__ = ["DEVICE_TYPE", "FakeAccelerator", "fake_mesh", "install", "register_fake_process_group"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from . import fake_accelerator

        return getattr(fake_accelerator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
