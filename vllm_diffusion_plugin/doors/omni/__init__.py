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
  CPU fallback when the accelerator fails for one tensor;
- ``patch_load_path``: under our load format the diffusion workers' loader reads the DiTs through our path
  (manifests, reader, LoRA fusion per component, strict check; ``load_path``) with options from
  ``--additional-config diffusion_hsdp`` (``serve_options``);
- ``patch_serve_flag``: ``vllm serve --omni --load-format diffusion-hsdp`` carried from the stage's load config
  (dropped by vllm-omni) to the workers, options validated in the API server before any worker starts;
- ``patch_default_stage``: the flag kept in the generic diffusion stage vllm-omni builds for a pipeline without
  a deploy YAML (FLUX.1, ...), whose engine arguments otherwise lose ``load_format``;
- ``patch_worker_death``: a diffusion worker that dies while the workers start (its load, the warm-up) is named in
  the server's error with how it died (a signal: the cause) before the peers that failed after it;
- ``patch_lora_update``: the diffusion workers answer the runtime LoRA update (``lora_update``: the fused set swapped
  between requests);
- ``patch_lora_routes``: ``/v1/diffusion_hsdp/loras`` in the API server when ``lora_update_dirs`` is set
  (``lora_routes``, ``lora_policy``).

``load-format``, ``postprocess``, ``load-path``, ``serve-flag`` and ``default-stage`` are required by the flag:
when one of them does not recognize the installed vllm-omni and ``--load-format diffusion-hsdp`` is on the command
line, the server stops at startup (``_patching.LoadFormatUnavailable``) instead of serving vllm-omni's own load.
"""

from __future__ import annotations

import importlib.util
import sys

PATCH_UNITS = ("patch_load_format", "patch_postprocess", "patch_lora_device", "patch_load_path", "patch_serve_flag",
               "patch_default_stage", "patch_worker_death", "patch_lora_update", "patch_lora_routes")


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
