"""A CPU platform for vllm-omni (diffusion pipelines), for development, tests and CI.

vllm-omni resolves its platform from the entry-point group ``vllm_omni.platform_plugins``; this package's
entry point is :func:`platform_plugin`. It applies only when ``VLLM_DIFFUSION_OMNI_CPU=1`` -- independently
of ``VLLM_DIFFUSION_PLUGIN``, so vllm-omni's own loader can be served on the CPU as a reference -- and
returns None otherwise, leaving vllm-omni's platform detection untouched.

    VLLM_DIFFUSION_OMNI_CPU=1 VLLM_TARGET_DEVICE=cpu vllm serve DIR --omni --enforce-eager --dtype float32

The platform itself is :class:`vllm_diffusion_plugin.doors.omni.cpu.platform.CpuOmniPlatform` (imported by
vllm-omni by name, so this module imports nothing of vLLM or vllm-omni).
"""

from __future__ import annotations

from vllm_diffusion_plugin import envs
from vllm_diffusion_plugin._logging import init_logger

logger = init_logger(__name__)

PLATFORM = "vllm_diffusion_plugin.doors.omni.cpu.platform.CpuOmniPlatform"


def platform_plugin() -> str | None:
    """Entry point (``vllm_omni.platform_plugins``): the CPU platform's qualified name when
    ``VLLM_DIFFUSION_OMNI_CPU`` is on, else None. An invalid value raises, naming the variable."""
    try:
        enabled = envs.get("VLLM_DIFFUSION_OMNI_CPU")
    except ValueError as exc:  # vllm-omni logs a failing platform plugin at debug level only
        logger.error("%s", exc)
        raise
    return PLATFORM if enabled else None
