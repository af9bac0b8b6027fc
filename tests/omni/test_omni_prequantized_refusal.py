"""Pre-quantized checkpoints other than ModelOpt FP8 stay refused under ``--load-format diffusion-hsdp``, naming
vllm-omni's quantization, before any weight is read (issue 37: what stays refused is refused by name); ModelOpt FP8
loads (``test_omni_prequant_fp8.py``, ``test_omni_rank_local_prequant.py``).

vllm-omni builds these configs from a transformer's ``quantization_config`` (ModelOpt FP8 / FP8 per channel / NVFP4,
vLLM's serialized ``fp8``); each marks itself with its own ``is_checkpoint_<format>_serialized`` flag. The old check
looked for ``is_checkpoint_quantized``, which none of them sets: ModelOpt FP8 and NVFP4 checkpoints got through
to a path that reads unquantized diffusers checkpoints.
"""

from __future__ import annotations

import pytest
from omni_support import import_omni

import_omni()  # skips this module where vllm-omni is not installed


@pytest.mark.parametrize("spec, name, flag", [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt_fp4", "nvfp4"),
    ({"quant_method": "fp8", "is_checkpoint_fp8_serialized": True}, "fp8", "fp8"),
], ids=["modelopt-nvfp4", "vllm-fp8-serialized"])
def test_pre_quantized_checkpoint_configs_are_refused_by_name(omni, spec, name, flag):
    from vllm_omni.quantization import build_quant_config

    from vllm_diffusion_plugin.doors.omni.serve_options import checkpoint_strategy

    with pytest.raises(ValueError, match=rf"vllm-omni's quantization '{name}' with a .*pre-quantized checkpoint "
                                         rf"\(is_checkpoint_{flag}_serialized\) is not carried"):
        checkpoint_strategy(build_quant_config(spec))


@pytest.mark.parametrize("algo", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN"])
def test_modelopt_fp8_with_rank_local_needs_a_method_that_finishes_rows(omni, algo, monkeypatch):
    """vLLM's own ModelOpt FP8 method finishes whole layers with CUDA ops: refused with ``rank_local`` by name; a
    method registered as row-wise (the CPU stand-in, ``testing/cpu_modelopt.py``) loads (``test_omni_rank_local_prequant``)."""
    from vllm_omni.quantization import build_quant_config

    from vllm_diffusion_plugin.doors.omni.serve_options import checkpoint_strategy
    from vllm_diffusion_plugin.engine.quant import online as quant_shards

    monkeypatch.setattr(quant_shards, "ROW_WISE_METHODS", set())
    config = build_quant_config({"quant_method": "modelopt", "quant_algo": algo})
    assert checkpoint_strategy(config, "full") == "full"
    with pytest.raises(ValueError, match=r"pre-quantized ModelOpt FP8 checkpoint .* with hsdp_weight_load='rank_local'"
                                         r": .* does not declare how"):
        checkpoint_strategy(config, "rank_local")
    monkeypatch.setattr(quant_shards, "ROW_WISE_METHODS", {"modelopt"})
    assert checkpoint_strategy(config, "rank_local") == "rank_local"


def test_online_quantization_is_not_refused(omni):
    from vllm_omni.quantization import build_quant_config

    from vllm_diffusion_plugin.doors.omni.serve_options import checkpoint_strategy

    checkpoint_strategy(build_quant_config("fp8"))  # vLLM's online fp8: the checkpoint is unquantized
    checkpoint_strategy(None)
