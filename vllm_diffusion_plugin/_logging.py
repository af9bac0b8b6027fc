"""Loggers for this package, made through vLLM's ``init_logger`` under vLLM's logger tree.

vLLM configures (handler, format, ``VLLM_LOGGING_LEVEL``) only the ``vllm`` logger and its children. A
plugin logger named ``vllm_diffusion_plugin.x`` would print nothing below WARNING, so ours are named
``vllm.vllm_diffusion_plugin.x``: same handler, same format, same level switch as vLLM's own messages.

Where nobody configured logging, ours still print. vLLM 0.30 configures its tree when ``vllm.logger`` is
imported; from 0.31 on only a process that asks does (``configure_logging_if_needed``), and some of vllm-omni's
processes never ask: 0.31rc1's API server, 0.32rc1's workers of a multi-rank server. There our INFO lines -- the
API server's "carried" line, each worker's ``diffusion-hsdp load report`` -- would be dropped by the root
logger's WARNING. So each of our loggers, while no handler on its way to the root exists, counts as enabled at
``VLLM_LOGGING_LEVEL`` (default INFO), and :class:`FallbackHandler` on our top logger prints the record in vLLM's
text format to stderr (stdout when ``VLLM_LOGGING_STREAM=ext://sys.stdout``: a script's own output stays clean). As soon as the host configures a handler anywhere on
that way (vLLM's, a ``VLLM_LOGGING_CONFIG_PATH`` file, ``logging.basicConfig``), the host's levels and handlers
decide alone and the fallback stays silent. No logger but ours is touched.
"""

from __future__ import annotations

import logging
import os
import sys
from types import MethodType

try:
    from vllm.logger import init_logger as _vllm_init_logger
except ImportError:  # no vLLM (e.g. a bare GPU image running benchmarks/gpu_proof.py): plain loggers, same names
    _vllm_init_logger = logging.getLogger

PREFIX = "vllm."
TOP = PREFIX + "vllm_diffusion_plugin"
"""Our top logger: every module's logger is a child of it."""
FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
"""vLLM's text format and date format (``vllm.logger._FORMAT`` without its process-name field)."""


def init_logger(name: str):
    """``vllm.logger.init_logger`` for a module of this package (pass ``__name__``), printing where nobody
    configured logging (see the module docstring)."""
    _install_fallback()
    logger = _vllm_init_logger(PREFIX + name)
    if not isinstance(logger.__dict__.get("isEnabledFor"), MethodType):
        logger.isEnabledFor = MethodType(_is_enabled_for, logger)
    return logger


class FallbackHandler(logging.Handler):
    """Prints our records only while no other handler would see them (the host configured no logging)."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if host_configured(logging.getLogger(record.name)):
            return
        try:
            stream = sys.stdout if os.environ.get("VLLM_LOGGING_STREAM") == "ext://sys.stdout" else sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def host_configured(logger: logging.Logger) -> bool:
    """Whether a handler other than our fallback sits on the way from ``logger`` to the root."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, FallbackHandler) for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def fallback_level() -> int:
    """``VLLM_LOGGING_LEVEL`` (vLLM's default: INFO) as a number; INFO for a value logging does not know."""
    level = logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    return level if isinstance(level, int) else logging.INFO


def _is_enabled_for(self: logging.Logger, level: int) -> bool:
    enabled = logging.Logger.isEnabledFor(self, level)
    if enabled or _level_set_in_our_tree(self) or host_configured(self):
        return enabled
    return level >= fallback_level() and self.manager.disable < level


def _level_set_in_our_tree(logger: logging.Logger) -> bool:
    """Whether ``logger`` or an ancestor up to our top logger has its own level (the CLI's quiet mode, a test's
    capture): then that level decides, as logging's own rule says."""
    current: logging.Logger | None = logger
    while current is not None and current.name.startswith(TOP):
        if current.level != logging.NOTSET:
            return True
        current = current.parent
    return False


def _install_fallback() -> None:
    top = logging.getLogger(TOP)
    if not any(isinstance(h, FallbackHandler) for h in top.handlers):
        top.addHandler(FallbackHandler())
