"""diffusers model classes imported one at a time, not with diffusers' whole model zoo.

``getattr(diffusers, "WanTransformer3DModel")`` imports ``diffusers.models.transformers``, whose ``__init__`` imports
every transformer diffusers ships (~80 modules and what they pull in: seconds on a small host). diffusers' lazy
modules already say which module defines each class (``_class_to_module``): ``model_class`` imports that module
alone. A subpackage on the way is registered uninitialised and runs its own ``__init__`` the first time anything
asks it for a name, so ``from diffusers.models.transformers import X`` elsewhere still works. A diffusers whose
lazy modules look different falls back to ``getattr(diffusers, name)``.

``import_diffusers`` is for a process that only loads (the CLI and its ranks): diffusers decides at import which
optional packages it uses and imports them whenever they are installed -- flashinfer (vLLM installs it) for FP4
kernels, peft and transformers for its own LoRA backend and text encoders: seconds of imports a load never
uses (it fuses LoRAs itself; diffusers' LoRA converters, which it calls, read the same without them). Hidden
from that check, diffusers leaves them alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types

_LOCK = threading.RLock()
UNUSED_BY_A_LOAD = ("flashinfer", "peft", "transformers")
"""Optional packages diffusers imports when installed, for what loading weights never runs."""


def import_diffusers() -> types.ModuleType:
    """``import diffusers`` and its model base, with ``UNUSED_BY_A_LOAD`` hidden from them when this process has
    not imported diffusers yet (``sys.modules[name] = None``: ``importlib.util.find_spec`` says "not installed",
    an import raises ``ImportError``, which diffusers' optional imports expect). The packages stay importable
    afterwards; diffusers just does not use them in this process."""
    if "diffusers.utils.import_utils" in sys.modules:
        import diffusers

        return diffusers
    hidden = [name for name in UNUSED_BY_A_LOAD if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    try:
        import diffusers.models.modeling_utils  # diffusers' flags are set here, once per process
    finally:
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
    import diffusers

    return diffusers


def class_module(name: str) -> str | None:
    """The module that defines the diffusers model class ``name`` (``diffusers.models.transformers.transformer_wan``)
    from diffusers' lazy import tables, without importing it; None for a name they do not list as a model."""
    import diffusers

    if getattr(diffusers, "_class_to_module", {}).get(name) != "models":
        return None
    module = getattr(importlib.import_module("diffusers.models"), "_class_to_module", {}).get(name)
    return f"diffusers.models.{module}" if isinstance(module, str) else None


def model_class(name: str) -> object:
    """The diffusers class ``name``, importing only the module that defines it (``AttributeError`` or
    ``ImportError`` for a class this diffusers does not provide or cannot import)."""
    module = class_module(name)
    if module is None:
        import diffusers

        return getattr(diffusers, name)
    with _LOCK:
        _register_parents(module)
        return getattr(importlib.import_module(module), name)


def _register_parents(module: str) -> None:
    """Register each package between ``module`` and the nearest imported one uninitialised (see the module
    docstring), so importing ``module`` runs none of their ``__init__``."""
    parts = module.split(".")
    for end in range(2, len(parts)):
        package = ".".join(parts[:end])
        if package in sys.modules:
            continue
        spec = importlib.util.find_spec(package)
        if spec is None or spec.submodule_search_locations is None:
            return
        pending = importlib.util.module_from_spec(spec)
        pending.__getattr__ = _initialise_on_demand(pending, spec)
        sys.modules[package] = pending
        setattr(sys.modules[".".join(parts[:end - 1])], parts[end - 1], pending)


def _initialise_on_demand(pending: types.ModuleType, spec) -> object:
    def __getattr__(attr: str) -> object:
        if attr.startswith("__") and attr.endswith("__"):  # introspection (``__wrapped__`` ...): not a model name
            raise AttributeError(attr)
        with _LOCK:
            if pending.__dict__.pop("__getattr__", None) is not None:  # first request: run the real ``__init__``
                spec.loader.exec_module(pending)
        return getattr(pending, attr)

    return __getattr__
