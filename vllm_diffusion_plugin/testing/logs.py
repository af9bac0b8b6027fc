"""Capture this package's log records in tests.

Our loggers live under vLLM's tree (``vllm.vllm_diffusion_plugin.*``), and once vLLM configures logging that
tree no longer propagates to the root logger, so pytest's ``caplog`` may see nothing. ``captured_logs``
attaches a handler to the module's own logger instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from vllm_diffusion_plugin._logging import PREFIX


class RecordList(logging.Handler):
    """A handler that keeps every record it receives."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.WARNING) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@contextmanager
def captured_logs(module_name: str, level: int = logging.DEBUG) -> Iterator[RecordList]:
    """Records at ``level`` and above from the logger of ``module_name`` (e.g. ``"vllm_diffusion_plugin.engine.lora.fuse"``).

    The logger's level is lowered to ``level`` for the duration when it would filter them out (``setLevel``,
    which also clears logging's ``isEnabledFor`` cache), and restored afterwards.
    """
    logger = logging.getLogger(PREFIX + module_name)
    handler = RecordList(level)
    old_level = logger.level
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
