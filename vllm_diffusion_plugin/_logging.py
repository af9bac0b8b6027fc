"""Loggers for this package, made through vLLM's ``init_logger`` under vLLM's logger tree.

vLLM configures (handler, format, ``VLLM_LOGGING_LEVEL``) only the ``vllm`` logger and its children. A
plugin logger named ``vllm_diffusion_plugin.x`` would print nothing below WARNING, so ours are named
``vllm.vllm_diffusion_plugin.x``: same handler, same format, same level switch as vLLM's own messages.
"""

import logging

try:
    from vllm.logger import init_logger as _vllm_init_logger
except ImportError:  # no vLLM (e.g. a bare GPU image running benchmarks/gpu_proof.py): plain loggers, same names
    _vllm_init_logger = logging.getLogger

PREFIX = "vllm."


def init_logger(name: str):
    """``vllm.logger.init_logger`` for a module of this package (pass ``__name__``)."""
    return _vllm_init_logger(PREFIX + name)
