"""The machinery shared by the vllm-omni patches: post-import hooks, sentinels, rebinding, skip warnings.

A patch unit is a module of this package with a docstring (why, how, which vllm-omni versions, when to
remove it) and three names:

- ``NAME``: a short label used in logs and in :func:`status`;
- ``TARGET``: the vllm-omni module it patches (e.g. ``vllm_omni.diffusion.lora.loader``);
- ``apply(module) -> str``: checks the module's shape (attributes, signatures) and patches it; returns
  ``"applied"`` or ``"already applied"``; raises :class:`UnrecognizedShape` when the shape is not one it
  knows, *before* changing anything.

:func:`install` runs each unit when its target module is imported -- at once when it already is,
otherwise from a ``sys.meta_path`` hook right after the target's code ran (so importing this plugin never
imports vllm-omni: in a plain vLLM process, importing ``vllm_omni`` would apply vllm-omni's own patches to
vLLM). A unit that does not recognize the installed vllm-omni logs one warning naming the vllm-omni
version and is skipped; an unexpected error inside a unit is logged the same way. Neither reaches the
user's server -- except for a unit that declares ``REQUIRED_BY_LOAD_FORMAT = True`` (the units that make
``--load-format diffusion-hsdp`` work) when that flag is on the command line: the server would otherwise
serve vllm-omni's own load under our flag, so :class:`LoadFormatUnavailable` is raised instead and the
server stops at startup with one message.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import inspect
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType
from typing import Any

from vllm_diffusion_plugin._logging import init_logger

logger = init_logger(__name__)

SENTINEL = "__vllm_diffusion_patch__"
"""Attribute set on every replacement object; its value names the patch unit. Its presence means
"already patched" (idempotence); ``__wrapped__`` holds the vllm-omni original."""

OMNI_PREFIX = "vllm_omni"

_lock = threading.RLock()
_status: dict[str, str] = {}
_finder: _PostImportFinder | None = None


class UnrecognizedShape(Exception):
    """The installed vllm-omni does not have the attribute/signature a patch unit expects."""


class LoadFormatUnavailable(RuntimeError):
    """``--load-format diffusion-hsdp`` was asked for, but a patch unit it needs is not applied."""


def load_format_requested(argv: Sequence[str] | None = None) -> bool:
    """Whether the command line (default ``sys.argv``; spawned workers inherit it) asks for our load format:
    ``--load-format diffusion-hsdp``, or ``load-format: diffusion-hsdp`` in the YAML file of vLLM's
    ``--config FILE`` (which vLLM expands into the same arguments)."""
    from vllm_diffusion_plugin.engine.config import LOAD_FORMAT

    argv = list(sys.argv if argv is None else argv)
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        flag = flag.replace("_", "-")
        if flag not in ("--load-format", "--config"):
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if flag == "--config":
            value = _config_file_load_format(value)
        if str(value).lower() == LOAD_FORMAT:
            return True
    return False


def _config_file_load_format(path: str) -> str:
    """``load-format`` (or ``load_format``) from a vLLM ``--config`` YAML file; "" when absent or unreadable
    (vLLM reports an unreadable file itself)."""
    try:
        import yaml

        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, ImportError, UnicodeDecodeError):
        return ""
    except Exception as exc:  # yaml.YAMLError: a malformed file, which vLLM's own parser reports
        if type(exc).__module__.startswith("yaml"):
            return ""
        raise
    if not isinstance(config, dict):
        return ""
    return str(config.get("load-format", config.get("load_format", "")) or "")


def unavailable(unit_name: str, state: str) -> LoadFormatUnavailable:
    return LoadFormatUnavailable(
        f"--load-format diffusion-hsdp was given, but vllm-omni {omni_version()} does not have the shape the "
        f"plugin's patch `{unit_name}` needs ({state}), so its diffusion workers would silently load with "
        f"vllm-omni's own code. Refusing to start: use a vllm-omni release this plugin supports (0.30) or drop "
        f"--load-format diffusion-hsdp.")


def not_applied(unit_names: Iterable[str]) -> dict[str, str]:
    """The named units that are not applied in this process, each with its state."""
    current = status()
    return {name: current.get(name, "not installed") for name in unit_names
            if current.get(name) not in ("applied", "already applied")}


def require_applied(unit_names: Iterable[str]) -> None:
    """Raise :class:`LoadFormatUnavailable` unless every named unit is applied in this process."""
    for name, state in not_applied(unit_names).items():
        raise unavailable(name, state)


def omni_version() -> str:
    """The installed vllm-omni's version from its distribution metadata (imports nothing of it)."""
    try:
        return importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def status() -> dict[str, str]:
    """Each unit's state: ``pending (<target> not imported yet)``, ``applied``, ``already applied``,
    ``skipped: <reason>`` or ``failed: <error>``."""
    with _lock:
        return dict(_status)


# ---- helpers for patch units ------------------------------------------------------------------------------
def is_patched(obj: Any) -> bool:
    return getattr(obj, SENTINEL, None) is not None


def mark(replacement: Any, *, unit: str, original: Any) -> Any:
    """Tag ``replacement`` as made by ``unit`` from ``original`` (sentinel + ``__wrapped__``)."""
    setattr(replacement, SENTINEL, unit)
    replacement.__wrapped__ = original
    return replacement


def require_attr(owner: Any, name: str, where: str) -> Any:
    value = inspect.getattr_static(owner, name, None) if isinstance(owner, type) else getattr(owner, name, None)
    if value is None:
        raise UnrecognizedShape(f"{where} has no `{name}`")
    return value


def require_params(func: Any, expected: Sequence[str], where: str) -> inspect.Signature:
    """Check that ``func``'s parameters start with ``expected`` (names, in order)."""
    target = func.__func__ if isinstance(func, (classmethod, staticmethod)) else func
    if not callable(target):
        raise UnrecognizedShape(f"{where} is not callable ({type(target).__name__})")
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError) as exc:
        raise UnrecognizedShape(f"{where}: no inspectable signature ({exc})") from exc
    names = tuple(signature.parameters)
    if names[: len(expected)] != tuple(expected):
        raise UnrecognizedShape(f"{where}{signature} does not start with parameters ({', '.join(expected)})")
    return signature


def rebind(original: Any, replacement: Any, *, prefix: str = OMNI_PREFIX) -> list[str]:
    """Replace ``original`` by ``replacement`` in every loaded module named ``prefix`` or ``prefix.*`` that
    holds it as a global (``from x import name`` copies the reference); returns ``module.name`` rebound."""
    rebound = []
    for mod_name, module in list(sys.modules.items()):
        if module is None or not (mod_name == prefix or mod_name.startswith(prefix + ".")):
            continue
        namespace = getattr(module, "__dict__", {})
        for attr, value in list(namespace.items()):
            if value is original:
                setattr(module, attr, replacement)
                rebound.append(f"{mod_name}.{attr}")
    return rebound


# ---- running units ---------------------------------------------------------------------------------------
def run_unit(unit: ModuleType, module: ModuleType) -> str:
    """Apply ``unit`` to its imported target ``module``; raises only :class:`LoadFormatUnavailable` (see the
    module docstring)."""
    name = unit.NAME
    try:
        result = unit.apply(module)
    except UnrecognizedShape as exc:
        result = f"skipped: {exc}"
        logger.warning("vllm-omni %s: patch `%s` skipped, this vllm-omni's %s is not a shape it knows: %s. "
                       "vllm-omni's own behaviour is kept.", omni_version(), name, module.__name__, exc)
    except Exception as exc:  # a bug or an unforeseen vllm-omni: never crash the user's server
        result = f"failed: {type(exc).__name__}: {exc}"
        logger.warning("vllm-omni %s: patch `%s` on %s failed (%s: %s) and was skipped; vllm-omni's own "
                       "behaviour is kept.", omni_version(), name, module.__name__, type(exc).__name__, exc,
                       exc_info=True)
    else:
        logger.debug("vllm-omni %s: patch `%s` on %s: %s", omni_version(), name, module.__name__, result)
    with _lock:
        _status[name] = result
    if result.startswith(("skipped", "failed")) and getattr(unit, "REQUIRED_BY_LOAD_FORMAT", False) \
            and load_format_requested():
        raise unavailable(name, result)
    return result


def install(unit_names: Iterable[str]) -> None:
    """Run each unit (module ``vllm_diffusion_plugin.doors.omni.<name>``) once its target is imported.
    Idempotent: a unit already pending or run is not registered again."""
    global _finder
    units = [importlib.import_module(f"{__package__}.{name}") for name in unit_names]
    with _lock:
        for unit in units:
            if unit.NAME in _status:
                continue
            target = sys.modules.get(unit.TARGET)
            if target is not None:
                run_unit(unit, target)
                continue
            _status[unit.NAME] = f"pending ({unit.TARGET} not imported yet)"
            if _finder is None:
                _finder = _PostImportFinder()
                sys.meta_path.insert(0, _finder)
            _finder.add(unit.TARGET, lambda module, unit=unit: run_unit(unit, module))


def reset_for_tests() -> None:
    """Forget every unit's state and remove the import hook (the patches themselves stay applied)."""
    global _finder
    with _lock:
        _status.clear()
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched module name it asks the other finders for the spec and wraps
    its loader, so callbacks run right after the module's code ran. Unwatches a name once it fired."""

    def __init__(self) -> None:
        self._callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}
        self._busy: set[str] = set()

    def add(self, fullname: str, callback: Callable[[ModuleType], None]) -> None:
        self._callbacks.setdefault(fullname, []).append(callback)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self._callbacks or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            logger.warning("Cannot watch the import of %s (loader %r); its vllm-omni patches are not applied.",
                           fullname, spec.loader)
            return spec
        spec.loader = _CallbackLoader(spec.loader, self._fired)
        return spec

    def _fired(self, module: ModuleType) -> None:
        with _lock:
            callbacks = self._callbacks.pop(module.__name__, [])
        for callback in callbacks:
            callback(module)


class _CallbackLoader(importlib.abc.Loader):
    """Delegates to the real loader; after ``exec_module`` restores it on the module and runs the callback."""

    def __init__(self, inner: importlib.abc.Loader, callback: Callable[[ModuleType], None]) -> None:
        self._inner, self._callback = inner, callback

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        module.__loader__ = self._inner
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._inner
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._inner, name)
