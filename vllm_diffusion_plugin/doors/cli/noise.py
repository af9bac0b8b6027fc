"""The CLI's stderr without ``--verbose``: our warnings and errors, progress bars, and nothing else of ours.

Every run and every rank used to print torch deprecation notices (``torch._opaque_base is deprecated``...),
vLLM's "Failed to import from vllm._C" on a CPU build and "No CUDA runtime is found" on hosts without one,
and about twenty of our own INFO lines (``Built ... on meta``, ``Normalized ... LoRA keys``, ...) before the
table a newcomer ran the command for. ``quiet_third_party()`` drops exactly those third-party messages (a
``logging`` filter on the handlers of the root, ``torch`` and ``vllm`` loggers, and ``warnings`` filters) and
raises our loggers' level to WARNING; any other third-party warning passes. ``--verbose`` keeps everything.
Idempotent; call it again after something replaced the handlers.
"""

from __future__ import annotations

import logging
import re
import warnings

HARMLESS = re.compile(
    r"is deprecated|deprecated, use|Failed to import from vllm\._C|No CUDA runtime is found"
    r"|Triton is not installed|Triton not installed")
"""Messages dropped without ``--verbose``; the record's logger must be a third-party one (below)."""
THIRD_PARTY = ("torch", "vllm", "py.warnings", "transformers", "diffusers", "huggingface_hub")
EMITTERS = ("torch._opaque_base", "torch._library.opaque_object", "torch.utils.cpp_extension", "vllm.platforms",
            "vllm.platforms.cpu", "vllm.platforms.rocm", "vllm._custom_ops")
"""Loggers that warn while torch / vLLM are being imported, before their handlers exist: filtered at the
logger itself (a logger's filters see every record it creates), set up before the import."""
OURS = "vllm.vllm_diffusion_plugin"


class _HarmlessFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        if name.startswith(OURS) or not name.startswith(THIRD_PARTY) or record.levelno >= logging.ERROR:
            return True
        return not HARMLESS.search(record.getMessage())


_FILTER = _HarmlessFilter()


def quiet_third_party(*, verbose: bool) -> None:
    """Drop harmless third-party warnings and our own INFO lines from now on in this process, unless ``verbose``."""
    if verbose:
        return
    logging.getLogger(OURS).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=HARMLESS.pattern)
    for name in EMITTERS:
        if _FILTER not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_FILTER)
    for name in (None, "torch", "vllm"):
        for handler in logging.getLogger(name).handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)
