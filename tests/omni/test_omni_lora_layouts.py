"""Trainer-layout LoRA files through the vllm-omni door, one layout per family (diffusers 0.40, vllm-omni 0.30).

vllm-omni's own FLUX, Qwen-Image and Z-Image DiTs (their names, q/k/v stacked) read by our door from a checkpoint
diffusers wrote, with a LoRA in a trainer's layout (``vllm_diffusion_plugin.testing.lora_layouts``), equal
vllm-omni's own ``load_weights`` fed the checkpoint with the LoRA merged in float64 -- the LoRA as diffusers'
own pipeline-level ``lora_state_dict`` converts it. Wan2.2 with a LightX2V-layout file through this door:
``test_omni_serve_door.py::test_a_wan_format_lora_with_bias_diffs_fuses_exactly``.
"""

from __future__ import annotations

import json

import pytest
import torch
from omni_support import FAMILIES, OneDitPipeline, build_family_dit, import_omni

import_omni()  # skips this module where vllm-omni is not installed

from test_omni_serve_door import FLAG, checkpoint, runner_loader, stage_fields  # noqa: E402

from vllm_diffusion_plugin.testing.lora_layouts import FAMILIES as LAYOUT_FAMILIES  # noqa: E402
from vllm_diffusion_plugin.testing.lora_layouts import write_layout  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
SCALE = 0.7
ONE_LAYOUT = {"flux": "comfyui", "qwen_image": "kohya", "z_image": "kohya"}


def merged_as_diffusers_converts(base: dict[str, torch.Tensor], lora, family: str) -> dict[str, torch.Tensor]:
    """``W + SCALE * alpha / r * B @ A`` (alpha/r = 1 where diffusers bakes it in) in float64, on the keys
    diffusers' ``<Family>Pipeline.lora_state_dict`` converts the file into."""
    import diffusers

    converted = getattr(diffusers, LAYOUT_FAMILIES[family][0]).lora_state_dict(str(lora))
    converted = converted[0] if isinstance(converted, tuple) else converted
    out = {k: v.double() for k, v in base.items()}
    for key, A in converted.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
            B = converted[key.replace("lora_A", "lora_B")].double()
            out[f"{module}.weight"] += SCALE * B @ A.double()
    return out


@pytest.mark.parametrize("family", list(ONE_LAYOUT))
def test_a_trainer_layout_lora_fuses_through_the_omni_door(omni_world, family, tmp_path):
    import diffusers
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    _, name, config = FAMILIES[family]
    torch.manual_seed(0)
    getattr(diffusers, name)(**config).save_pretrained(tmp_path / "transformer", max_shard_size="40KB")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "OneDit", "transformer": ["diffusers", name]}))
    lora = tmp_path / f"{ONE_LAYOUT[family]}.safetensors"
    write_layout(family, ONE_LAYOUT[family], lora)
    base = checkpoint(tmp_path / "transformer")
    want_state = merged_as_diffusers_converts(base, lora, family)

    def omni_load(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pipeline = OneDitPipeline(build_family_dit(family))
        pipeline.load_weights((f"transformer.{k}", v.float()) for k, v in state.items())
        return {n: p.detach() for n, p in pipeline.named_parameters()}

    ours = OneDitPipeline(build_family_dit(family))
    ours.weights_sources = [DiffusersPipelineLoader.ComponentSource(str(tmp_path), "transformer", None, "transformer.")]
    loader = runner_loader(OmniDiffusionConfig(**stage_fields(model=str(tmp_path), load_format=FLAG, additional_config={
        "diffusion_hsdp": {"lora_path": [f"transformer={lora}@{SCALE}"]}})))
    loader.load_weights(ours)

    want, unfused = omni_load(want_state), omni_load(base)
    got = {n: p.detach() for n, p in ours.named_parameters()}
    assert sorted(got) == sorted(want)
    for param in want:
        torch.testing.assert_close(got[param], want[param], rtol=0, atol=1e-6, msg=f"{family}: {param}")
    changed = [p for p in want if not torch.equal(want[p], unfused[p])]
    assert len(changed) >= 8 and any("qkv" in p for p in changed), (family, changed)
