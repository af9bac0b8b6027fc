"""Qwen-Image through vllm-omni 0.30, in-process (the real servers are in ``tests/serve/test_serve_images.py``):

- ``write_tiny_pipeline(DIR, "qwen-image", runnable=True)`` writes a folder diffusers' own ``QwenImagePipeline``
  runs on the CPU (DiT in >= 3 shards + index, every component saved by transformers/diffusers), with the DiT at
  the tiny config the LoRA layout writers assume, and a tokenizer whose prompt template drops exactly the
  template's system part (``prompt_template_encode_start_idx`` 34), as Qwen's own does;
- ``--load-format diffusion-hsdp`` survives vllm-omni's generic diffusion stage (``QwenImagePipeline`` has no
  deploy YAML): vllm-omni's own config resolution of the folder gives the stage our load format and carries it
  to the workers (``patch_default_stage``); without the unit it is dropped and the server stops on our options;
- vllm-omni's own ``QwenImagePipeline`` builds from the folder (its text encoder, tokenizer, VAE, scheduler) and
  loads its DiT through our door with a kohya LoRA: equal to vllm-omni's ``load_weights`` fed the DiT diffusers
  merged (``load_lora_adapter`` + ``fuse_lora``), q/k/v of both streams stacked.
"""

from __future__ import annotations

import json

import pytest
import torch
from omni_support import import_omni, load_pipeline

from vllm_diffusion_plugin.tiny.models import write_tiny_pipeline

import_omni()  # skips this module where vllm-omni is not installed

FLAG = "diffusion-hsdp"
PROMPT = "a red cat walks on the beach"


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    return write_tiny_pipeline(tmp_path_factory.mktemp("qwen") / "qwen-image", "qwen-image", runnable=True)


def test_the_tiny_folder_is_what_the_layout_writers_and_the_pipelines_expect(qwen_folder):
    index = json.loads((qwen_folder / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert {k: v[1] for k, v in index.items() if isinstance(v, list)} == {
        "transformer": "QwenImageTransformer2DModel", "text_encoder": "Qwen2_5_VLForConditionalGeneration",
        "tokenizer": "Qwen2Tokenizer", "vae": "AutoencoderKLQwenImage", "scheduler": "FlowMatchEulerDiscreteScheduler"}
    assert len(list((qwen_folder / "transformer").glob("*.safetensors"))) >= 3
    assert (qwen_folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    size = sum(p.stat().st_size for p in qwen_folder.rglob("*") if p.is_file())
    assert size < 3 * 2**20, size


def test_the_template_drops_exactly_its_system_part(qwen_folder):
    from diffusers import QwenImagePipeline
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer.from_pretrained(qwen_folder / "tokenizer")
    template = QwenImagePipeline.__init__.__code__.co_consts  # diffusers keeps the template in __init__
    template = next(c for c in template if isinstance(c, str) and c.startswith("<|im_start|>system"))
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(template.format(PROMPT)).input_ids)
    assert tokens[34:37] == ["<|im_start|>", "user", "Ċ"], tokens  # what the pipelines keep starts at the user turn
    assert len(tokens) > 34 + 3 + 3


def test_diffusers_runs_the_folder_and_the_dit_matters(qwen_folder):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(qwen_folder, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def image(prompt):
        return pipe(prompt, height=32, width=32, num_inference_steps=2, true_cfg_scale=1.0, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    a = image(PROMPT)
    assert a.shape == (1, 32, 32, 3) and 255 * a.std() > 10  # not a flat grey: the VAE passes the latents on
    assert 255 * abs(a - image(PROMPT)).max() == 0
    assert 255 * abs(a - image("a blue dog runs in the street")).mean() > 0.2  # the prompt reaches the DiT


def _stage(folder, load_format, options):
    from vllm_omni.config.resolver import resolve_omni_config

    overrides = {"model": str(folder), "dtype": "float32", "load_format": load_format}
    if options is not None:
        overrides["additional_config"] = {"diffusion_hsdp": options}
    resolution = resolve_omni_config(str(folder), trust_remote_code=False, deploy_config_path=None,
                                     cli_overrides=overrides, stage_overrides=None, strategy_config_path=None)
    (stage,) = resolution.stage_configs
    return stage


def test_the_flag_survives_the_generic_diffusion_stage(omni, qwen_folder):
    from vllm_diffusion_plugin.doors.omni.serve_options import CARRIED_KEY

    stage = _stage(qwen_folder, FLAG, {})
    assert stage.load_config.load_format == FLAG
    assert stage.diffusion_config.additional_config[CARRIED_KEY] == FLAG
    plain = _stage(qwen_folder, "auto", None)  # any other format: as vllm-omni leaves it
    assert CARRIED_KEY not in (plain.diffusion_config.additional_config or {})


def test_without_the_unit_the_generic_stage_drops_the_flag(omni, qwen_folder, monkeypatch):
    from vllm_omni.config.config_factory import StageConfigFactory

    wrapped = StageConfigFactory.__dict__["_normalize_default_diffusion"].__func__
    monkeypatch.setattr(StageConfigFactory, "_normalize_default_diffusion", classmethod(wrapped.__wrapped__))
    with pytest.raises(ValueError, match=r"read only with --load-format diffusion-hsdp \(this stage's load format: "
                                         r"None\)"):
        _stage(qwen_folder, FLAG, {})


def test_the_unit_is_idempotent_and_refuses_an_unknown_shape(omni):
    import types

    from vllm_omni.config import config_factory

    from vllm_diffusion_plugin.doors.omni import _patching, patch_default_stage

    assert patch_default_stage.apply(config_factory) == "already applied"
    assert _patching.is_patched(config_factory.StageConfigFactory.__dict__["_normalize_default_diffusion"].__func__)

    class Factory:  # a vllm-omni whose method is a plain function
        def _normalize_default_diffusion(self, kwargs): ...

    with pytest.raises(_patching.UnrecognizedShape, match="no longer a classmethod"):
        patch_default_stage.apply(types.SimpleNamespace(__name__=patch_default_stage.TARGET,
                                                        StageConfigFactory=Factory))


def diffusers_merged_dit(folder, lora) -> dict[str, torch.Tensor]:
    """The DiT's state dict with ``lora`` fused by diffusers (what the serving proof's reference folder holds)."""
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel.from_pretrained(folder / "transformer", torch_dtype=torch.float32)
    state_dict, metadata = QwenImagePipeline.lora_state_dict(str(lora), return_lora_metadata=True)
    model.load_lora_adapter(state_dict, prefix="transformer", metadata=metadata)
    model.fuse_lora(lora_scale=1.0)
    model.unload_lora()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_vllm_omnis_pipeline_builds_the_folder_and_loads_the_kohya_lora_through_our_door(omni_world, qwen_folder,
                                                                                         tmp_path):
    from vllm_diffusion_plugin.testing.lora_layouts import write_layout

    lora = tmp_path / "kohya.safetensors"
    write_layout("qwen_image", "kohya", lora)
    model, loader = load_pipeline(qwen_folder, "QwenImagePipeline", omni_world, {"lora_path": [f"transformer={lora}"]})
    od_config = loader.od_config
    assert type(model).__name__ == "QwenImagePipeline"
    assert type(model.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"

    def omni_load(state):  # vllm-omni's own DiT of the same config, loaded by its own load_weights
        from vllm.utils.torch_utils import set_default_torch_dtype
        from vllm_omni.diffusion.utils.tf_utils import get_transformer_config_kwargs

        cls = type(model.transformer)
        with set_default_torch_dtype(torch.float32):
            dit = cls(od_config=od_config, **get_transformer_config_kwargs(od_config.tf_model_config, cls))
        dit.load_weights(iter(state.items()))
        return {n: p.detach() for n, p in dit.named_parameters()}

    want = omni_load(diffusers_merged_dit(qwen_folder, lora))
    unfused = omni_load(_checkpoint(qwen_folder))
    got = {n: p.detach() for n, p in model.transformer.named_parameters()}
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)
    changed = {n for n in want if not torch.equal(want[n], unfused[n])}
    assert {"transformer_blocks.0.attn.to_qkv.weight", "transformer_blocks.0.attn.add_kv_proj.weight",
            "img_in.weight", "proj_out.weight"} <= changed, sorted(changed)
    (report,) = loader._diffusion_hsdp_state["report"].components
    assert report.name == "transformer" and report.lora_keys_fused == 20, report


def _checkpoint(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for file in (folder / "transformer").glob("*.safetensors"):
        state.update(load_file(str(file)))
    return state
