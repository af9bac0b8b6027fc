"""vllm-omni integration: patches that make vllm-omni's diffusion loader run this plugin's load path.

``apply_patches()`` is called by ``register()`` when the plugin is enabled. Without vllm-omni installed it
returns at once and imports nothing of it. With it, each patch unit below is applied when the vllm-omni
module it patches is imported (at once when it already is); this package never imports vllm-omni itself.

Units (one module each, documented there: why, how, versions, when to remove):

- ``patch_load_format``: ``--load-format diffusion-hsdp`` accepted by ``DiffusersPipelineLoader`` (safetensors
  weights), and HSDP switched on with sizes from vllm-omni's own HSDP options or our extra-config;
- ``patch_postprocess``: ``DiffusersPipelineLoader._process_weights_after_loading`` replaced by our
  online-quant-finalizing, HSDP-aware ``postprocess.process_weights_after_loading``;
- ``patch_lora_device``: vllm-omni's LoRA compute-device resolution replaced by our probe-based rule, with a
  CPU fallback when the accelerator fails for one tensor.
"""

from __future__ import annotations

import importlib.util
import sys

PATCH_UNITS = ("patch_load_format", "patch_postprocess", "patch_lora_device")


def apply_patches() -> None:
    """Apply every vllm-omni patch unit now or when its target module is imported. Idempotent."""
    if "vllm_omni" not in sys.modules and importlib.util.find_spec("vllm_omni") is None:
        return
    from vllm_diffusion_plugin.doors.omni import _patching

    _patching.install(PATCH_UNITS)


def patch_status() -> dict[str, str]:
    """Each unit's state (``applied``, ``pending (...)``, ``skipped: ...``, ...); empty without vllm-omni."""
    if "vllm_diffusion_plugin.doors.omni._patching" not in sys.modules:
        return {}
    from vllm_diffusion_plugin.doors.omni import _patching

    return _patching.status()
