"""Patch: vllm-omni's post-load weight processing becomes our online-quant-safe, HSDP-aware one.

Why. ``DiffusersPipelineLoader._process_weights_after_loading`` has changed shape three times:
0.22-0.24 move each quantized layer with ``module.to(target)`` and back, which raises "Cannot copy out of
meta tensor; no data!" on layers online quantization left on ``meta`` (vLLM's ``uses_meta_device`` methods)
and never calls vLLM's ``finalize_layerwise_processing``; 0.26-0.30 finalize first, but under online quant
move parameters one by one with ``param.data = param.data.to(...)``, which raises on FSDP-sharded DTensor
parameters ("Attempted to set the storage of a tensor on device cuda:0 to a storage on different device
cpu"); an intermediate main-branch commit did that for every model and broke HSDP loads.

How. The method is replaced by a call to ``vllm_diffusion_plugin.engine.postprocess.process_weights_after_loading``:
vLLM's finalize under online quant, whole-module moves otherwise, per-parameter moves of real (non-meta,
non-DTensor) parameters under online quant, layers already processed skipped, processed layers marked. The
loader has no vLLM ``ModelConfig``; vLLM attention layers (the only users of it: ``model_config.dtype``) get
a read-only view carrying vllm-omni's ``od_config.dtype``. Applies to every load format: in vllm-omni 0.30
the diffusion model runner builds its own ``LoadConfig()``, so a gate on the load format would never open.

Versions. Recognized shape: ``_process_weights_after_loading(self, model, target_device)`` (0.22-0.30; tested
on 0.30.0, 0.31.0rc1 and 0.32.0rc1).
Needed by 0.22-0.24 (meta stragglers) and by 0.26-0.30 for online quant on sharded models.

vllm-omni's own tests (``doors/omni/regression.py``). ``test_process_weights_skips_completed_online_quant_layer``
fails with the patch, on purpose: it asserts vLLM's finalize was called as ``(model, model_config=None)``; ours
passes the ``ModelConfig`` view above (vLLM's finalize hands it to attention layers, which read its ``dtype``;
``None`` holds only for a model without vLLM attention). Any other failure of that test is still unexpected
(the declaration below matches the message).

Remove when vllm-omni's own method passes both seed tests (a DTensor-parameter model and a meta straggler
under online quant) and vllm-omni passes its ``ModelConfig`` to vLLM's finalize.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni._patching import is_patched, mark, require_attr, require_params

logger = init_logger(__name__)

NAME = "postprocess"
REQUIRED_BY_LOAD_FORMAT = True
TARGET = "vllm_omni.diffusion.model_loader.diffusers_loader"
PARAMS = ("self", "model", "target_device")
EXPECTED_UPSTREAM_TEST_DIFFERENCES = {
    "*test_diffusers_loader.py::test_process_weights_skips_completed_online_quant_layer": (
        "vLLM's finalize gets a ModelConfig view carrying od_config.dtype, not model_config=None (vLLM attention "
        "layers read model_config.dtype); the test asserts the exact call", "*Actual*OmniModelConfigView(dtype=*"),
}
"""vllm-omni tests whose outcome this unit changes on purpose (see the docstring), for ``doors.omni.regression``."""


@dataclass(frozen=True)
class OmniModelConfigView:
    """What vLLM's attention post-processing reads from ``ModelConfig`` (``dtype``), taken from vllm-omni's
    ``OmniDiffusionConfig``. vLLM's finalize and our post-processing touch it only for attention layers."""

    dtype: Any


def apply(module: Any) -> str:
    where = f"{module.__name__}.DiffusersPipelineLoader"
    cls = require_attr(module, "DiffusersPipelineLoader", module.__name__)
    original = require_attr(cls, "_process_weights_after_loading", where)
    if is_patched(original):
        return "already applied"
    require_params(original, PARAMS, f"{where}._process_weights_after_loading")
    cls._process_weights_after_loading = mark(_replacement(original), unit=NAME, original=original)
    return "applied"


def _replacement(original):
    @functools.wraps(original)
    def _process_weights_after_loading(self, model, target_device):
        from vllm_diffusion_plugin.engine.session import process_weights_after_loading

        od_config = getattr(self, "od_config", None)
        view = OmniModelConfigView(dtype=od_config.dtype) if od_config is not None else None
        if target_device is None:  # vllm-omni's HSDP path passes load_model's optional `device` through
            target_device = _resident_device(model)
        process_weights_after_loading(model, target_device, model_config=view)

    return _process_weights_after_loading


def _resident_device(model: Any):
    """Where ``model``'s (non-meta) weights are: the target when vllm-omni gives none (its own code then
    moves layers with ``module.to(None)``, i.e. not at all)."""
    import torch

    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))
