"""Facts about the installed vllm-omni that tests derive expectations from, instead of asserting one line's facts.

Probed by feature (a field, a class), never by version string, so the same tests hold on every vllm-omni line
the plugin supports (0.30, 0.31rc1, 0.32rc1).
"""

from __future__ import annotations

import dataclasses


def has_pre_sharded() -> bool:
    """Whether the installed vllm-omni has its own ``--hsdp-weight-load-strategy pre_sharded`` load (0.31+)."""
    try:
        from vllm_omni.diffusion.data import OmniDiffusionConfig
    except ImportError:
        return False
    return "hsdp_weight_load_strategy" in {f.name for f in dataclasses.fields(OmniDiffusionConfig)}
