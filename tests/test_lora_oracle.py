"""Oracle: diffusers' / PEFT's own LoRA loading and fusion on tiny real models equals ours.

Each LoRA file is written by the library that defines its format (diffusers' ``save_lora_weights``, PEFT's
``save_pretrained``) or, for the formats diffusers only reads (LightX2V/Wan original, musubi and kohya
FLUX), built key by key and read by diffusers' pipeline-level ``lora_state_dict`` (which applies
``alpha / rank`` the way we do). The models are fp32, so the only differences are fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from vllm_diffusion_plugin.engine import platform
from vllm_diffusion_plugin.engine.lora import fuse_lora_files

WAN_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                  text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
FLUX_CONFIG = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
TOL = dict(rtol=1e-5, atol=1e-5)


def seeded(kind: str) -> torch.nn.Module:
    """A tiny diffusers model whose every parameter (biases included) is seeded random."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    cls, config = (WanTransformer3DModel, WAN_CONFIG) if kind == "wan" else (FluxTransformer2DModel, FLUX_CONFIG)
    model = cls(**config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def pipeline_class(kind: str):
    from diffusers import FluxPipeline, WanPipeline

    return WanPipeline if kind == "wan" else FluxPipeline


def diffusers_fused(kind: str, lora, scale: float) -> dict[str, torch.Tensor]:
    """diffusers' own path: pipeline-level ``lora_state_dict`` -> ``load_lora_adapter`` -> ``fuse_lora``."""
    model = seeded(kind)
    state_dict, metadata = pipeline_class(kind).lora_state_dict(lora, return_lora_metadata=True)
    model.load_lora_adapter(state_dict, prefix="transformer", metadata=metadata)
    model.fuse_lora(lora_scale=scale)
    model.unload_lora()
    return model.state_dict()


def ours_fused(kind: str, path, scale: float):
    model = seeded(kind)
    stats = fuse_lora_files(model, [(path, scale)])
    return model.state_dict(), stats


def assert_same_state(ours: dict, theirs: dict, base: dict, *, expect_changed: int) -> None:
    assert ours.keys() == theirs.keys()
    changed = [k for k in base if not torch.equal(theirs[k], base[k])]
    assert len(changed) == expect_changed  # the oracle really fused something
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], **TOL, msg=key)


def randomized(state_dict: dict[str, torch.Tensor], seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.3 if v.dim() else v for k, v in state_dict.items()}


@pytest.fixture(params=["cpu", "accelerator"])
def host(request, monkeypatch):
    """Run once on a CPU-only host, once with the fake accelerator as the usable local device."""
    if request.param == "cpu":
        monkeypatch.setattr(platform, "local_device", lambda: torch.device("cpu"))
        return None
    return request.getfixturevalue("fake_accelerator")


def test_diffusers_peft_format_saved_by_diffusers(tmp_path, host):
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = seeded("wan")
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                        target_modules=["to_q", "to_k", "to_out.0", "net.0.proj", "proj_out", "linear_1"])
    model.add_adapter(config)
    layers = randomized(get_peft_model_state_dict(model))
    pipeline_class("wan").save_lora_weights(tmp_path, transformer_lora_layers=layers,
                                            transformer_lora_adapter_metadata=config.to_dict())
    path = tmp_path / "pytorch_lora_weights.safetensors"
    ours, stats = ours_fused("wan", path, 0.7)
    assert_same_state(ours, diffusers_fused("wan", str(path), 0.7), seeded("wan").state_dict(), expect_changed=17)
    assert stats.targets == 17 and stats.compute_device == ("cpu" if host is None else str(host.device))
    if host is not None:
        assert host.op_counts["aten::addmm"] + host.op_counts["aten::addmm_"] >= 17


@pytest.mark.filterwarnings("ignore:Adapter 'default'.*invalid shape")  # PEFT flags 1-D lora_B.bias as unsharded
def test_peft_folder_with_patterns_and_lora_bias(tmp_path):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, lora_bias=True,
                        target_modules=["to_q", "to_v", "net.2"], rank_pattern={"net.2": 2}, alpha_pattern={"to_v": 2})
    peft_model = get_peft_model(seeded("wan"), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape) * 0.3)
    peft_model.save_pretrained(tmp_path / "adapter")
    theirs = peft_model.merge_and_unload().state_dict()
    ours, stats = ours_fused("wan", tmp_path / "adapter", 1.0)
    assert stats.targets == 10 and stats.params == 20  # weight and bias of each target
    assert_same_state(ours, theirs, seeded("wan").state_dict(), expect_changed=20)


def _lightx2v_state_dict(*, with_diff: bool) -> dict[str, torch.Tensor]:
    """Original Wan naming as LightX2V/Wan2.2 distill LoRAs: lora_down/up, alpha, diff_b (and diff)."""
    gen = torch.Generator().manual_seed(5)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * 0.3

    sd = {}
    for i in range(2):
        for attn in ("self_attn", "cross_attn"):
            for o in "qkvo":
                base = f"diffusion_model.blocks.{i}.{attn}.{o}"
                sd |= {f"{base}.lora_down.weight": rnd(4, 16), f"{base}.lora_up.weight": rnd(16, 4),
                       f"{base}.alpha": torch.tensor(8.0), f"{base}.diff_b": rnd(16)}
        for o, (out_f, in_f) in (("ffn.0", (32, 16)), ("ffn.2", (16, 32))):
            base = f"diffusion_model.blocks.{i}.{o}"
            sd |= {f"{base}.lora_down.weight": rnd(4, in_f), f"{base}.lora_up.weight": rnd(out_f, 4),
                   f"{base}.alpha": torch.tensor(2.0), f"{base}.diff_b": rnd(out_f)}
    sd |= {"diffusion_model.head.head.lora_down.weight": rnd(4, 16),
           "diffusion_model.head.head.lora_up.weight": rnd(16, 4),
           "diffusion_model.head.head.diff_b": rnd(16),
           "diffusion_model.text_embedding.0.lora_down.weight": rnd(4, 16),
           "diffusion_model.text_embedding.0.lora_up.weight": rnd(16, 4),
           "diffusion_model.time_embedding.2.lora_down.weight": rnd(4, 16),
           "diffusion_model.time_embedding.2.lora_up.weight": rnd(16, 4)}
    if with_diff:
        sd |= {"diffusion_model.blocks.1.norm3.diff": rnd(16),
               "diffusion_model.patch_embedding.diff": rnd(16, 4, 1, 2, 2)}
    return sd


def test_wan_lightx2v_format(tmp_path, host):
    sd = _lightx2v_state_dict(with_diff=False)
    save_file(sd, tmp_path / "distill.safetensors")
    ours, stats = ours_fused("wan", tmp_path / "distill.safetensors", 0.5)
    assert stats.targets == 2 * 10 + 3
    theirs = diffusers_fused("wan", dict(sd), 0.5)
    assert_same_state(ours, theirs, seeded("wan").state_dict(), expect_changed=2 * 10 * 2 + 2 + 2)


def test_wan_full_diffs_are_applied_where_diffusers_drops_them(tmp_path):
    sd = _lightx2v_state_dict(with_diff=True)
    save_file(sd, tmp_path / "distill.safetensors")
    ours, _ = ours_fused("wan", tmp_path / "distill.safetensors", 0.5)
    theirs = diffusers_fused("wan", dict(sd), 0.5)  # logs that it does not handle `.diff` keys
    theirs["blocks.1.norm2.weight"] = theirs["blocks.1.norm2.weight"] + 0.5 * sd["diffusion_model.blocks.1.norm3.diff"]
    patch_diff = sd["diffusion_model.patch_embedding.diff"]
    theirs["patch_embedding.weight"] = theirs["patch_embedding.weight"] + 0.5 * patch_diff
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], **TOL, msg=key)


def test_wan_musubi_kohya_format(tmp_path):
    gen = torch.Generator().manual_seed(9)
    sd = {}
    for i in range(2):
        for attn in ("self_attn", "cross_attn"):
            for o in "qkvo":
                base = f"lora_unet_blocks_{i}_{attn}_{o}"
                sd |= {f"{base}.lora_down.weight": torch.randn(4, 16, generator=gen),
                       f"{base}.lora_up.weight": torch.randn(16, 4, generator=gen), f"{base}.alpha": torch.tensor(1.0)}
        for o, (out_f, in_f) in (("ffn_0", (32, 16)), ("ffn_2", (16, 32))):
            base = f"lora_unet_blocks_{i}_{o}"
            sd |= {f"{base}.lora_down.weight": torch.randn(4, in_f, generator=gen),
                   f"{base}.lora_up.weight": torch.randn(out_f, 4, generator=gen), f"{base}.alpha": torch.tensor(16.0)}
    save_file(sd, tmp_path / "musubi.safetensors")
    ours, stats = ours_fused("wan", tmp_path / "musubi.safetensors", 0.8)
    assert stats.targets == 20
    assert_same_state(ours, diffusers_fused("wan", dict(sd), 0.8), seeded("wan").state_dict(), expect_changed=20)


def test_kohya_flux_original_naming(tmp_path):
    gen = torch.Generator().manual_seed(11)
    sd = {}
    for key, (out_f, in_f, alpha) in {"img_attn_proj": (32, 32, 2.0), "img_attn_qkv": (96, 32, 8.0),
                                      "img_mlp_0": (128, 32, 4.0), "txt_attn_proj": (32, 32, 4.0)}.items():
        base = f"lora_unet_double_blocks_0_{key}"
        sd |= {f"{base}.lora_down.weight": torch.randn(4, in_f, generator=gen),
               f"{base}.lora_up.weight": torch.randn(out_f, 4, generator=gen), f"{base}.alpha": torch.tensor(alpha)}
    save_file(sd, tmp_path / "kohya_flux.safetensors")
    ours, stats = ours_fused("flux", tmp_path / "kohya_flux.safetensors", 1.3)
    assert stats.targets == 6  # qkv split into to_q, to_k, to_v by diffusers' converter
    assert_same_state(ours, diffusers_fused("flux", dict(sd), 1.3), seeded("flux").state_dict(), expect_changed=6)
