"""LoRA key formats -> normalized, validated deltas; every bad input -> its own error, nothing touched."""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from vllm_diffusion_plugin.engine import platform
from vllm_diffusion_plugin.engine.lora import (
    LoraFormatError,
    LoraRankError,
    LoraShapeError,
    NonFiniteLoraError,
    PartialPackedLoraError,
    UnmatchedLoraKeysError,
    UnsupportedLoraError,
    fuse_lora_files,
    load_lora,
    load_lora_state_dict,
    normalize_lora,
    wan,
)
from vllm_diffusion_plugin.testing.logs import captured_logs

WAN_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                  text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


class Tiny(nn.Module):
    """Diffusers-like names: blocks.N.attn.{to_q,to_k,to_out.0}, blocks.N.ff (no bias), proj_out, norm."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList()
        for _ in range(2):
            block = nn.Module()
            block.attn = nn.Module()
            block.attn.to_q, block.attn.to_k = nn.Linear(16, 16), nn.Linear(16, 16)
            block.attn.to_out = nn.ModuleList([nn.Linear(16, 16)])
            block.ff = nn.Linear(16, 24, bias=False)
            self.blocks.append(block)
        self.proj_out = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(16)


class Packed(nn.Module):
    """vLLM-style packed projections: qkv_proj = [q (16 rows); k (8); v (8)], gate_up_proj = [gate; up]."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.qkv_proj, layer.gate_up_proj = nn.Linear(16, 32), nn.Linear(16, 48, bias=False)
            self.layers.append(layer)


PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


@pytest.fixture(autouse=True)
def cpu_host(monkeypatch):
    monkeypatch.setattr(platform, "local_device", lambda: torch.device("cpu"))


@pytest.fixture
def format_warnings():
    with captured_logs("vllm_diffusion_plugin.engine.lora.normal", logging.WARNING) as logs:
        yield logs.records


def ab(out_f: int, in_f: int, rank: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rank, in_f, generator=gen), torch.randn(out_f, rank, generator=gen)


def peft_keys(prefix: str, module: str, A: torch.Tensor, B: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"{prefix}{module}.lora_A.weight": A, f"{prefix}{module}.lora_B.weight": B}


def tiny_wan():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**WAN_CONFIG)


# ---- diffusers / PEFT ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["", "transformer.", "base_model.model.", "diffusion_model."])
def test_diffusers_peft_prefixes(prefix):
    A, B = ab(16, 16)
    deltas = normalize_lora(peft_keys(prefix, "blocks.1.attn.to_out.0", A, B), Tiny())
    assert list(deltas) == ["blocks.1.attn.to_out.0"]
    d = deltas["blocks.1.attn.to_out.0"]
    assert d.A is A and d.B is B and d.scale == 1.0 and d.rank == 4
    assert d.source_keys == (f"{prefix}blocks.1.attn.to_out.0.lora_A.weight",
                             f"{prefix}blocks.1.attn.to_out.0.lora_B.weight")


def test_scale_conventions_alpha_then_config_then_one():
    A, B = ab(16, 16)
    sd = peft_keys("transformer.", "blocks.0.attn.to_q", A, B) | peft_keys("transformer.", "blocks.0.attn.to_k", A, B)
    sd["transformer.blocks.0.attn.to_q.alpha"] = torch.tensor(2.0)  # alpha / rank = 0.5
    config = {"r": 4, "lora_alpha": 12}  # lora_alpha / r = 3, for keys without an alpha
    assert normalize_lora(sd, Tiny(), scale=2.0)["blocks.0.attn.to_q"].scale == 1.0
    assert normalize_lora(sd, Tiny(), scale=2.0)["blocks.0.attn.to_k"].scale == 2.0
    deltas = normalize_lora(sd, Tiny(), scale=2.0, adapter_config=config)
    assert deltas["blocks.0.attn.to_q"].scale == 1.0 and deltas["blocks.0.attn.to_k"].scale == 6.0
    rs = normalize_lora(sd, Tiny(), adapter_config={"r": 4, "lora_alpha": 8, "use_rslora": True})
    assert rs["blocks.0.attn.to_k"].scale == 4.0  # rslora: alpha / sqrt(r)


def test_peft_rank_and_alpha_patterns():
    sd = peft_keys("", "blocks.0.attn.to_q", *ab(16, 16, rank=4)) | peft_keys("", "blocks.0.ff", *ab(24, 16, rank=2))
    config = {"r": 4, "lora_alpha": 8, "rank_pattern": {"ff": 2}, "alpha_pattern": {"ff": 6}}
    deltas = normalize_lora(sd, Tiny(), adapter_config=config)
    assert deltas["blocks.0.attn.to_q"].scale == 2.0 and deltas["blocks.0.ff"].scale == 3.0


def test_peft_lora_bias_is_scaled_like_b_at_a():
    A, B = ab(8, 16)
    sd = peft_keys("", "proj_out", A, B) | {"proj_out.lora_B.bias": torch.ones(8), "proj_out.alpha": torch.tensor(8.0)}
    d = normalize_lora(sd, Tiny(), scale=0.5)["proj_out"]
    assert d.scale == 1.0 and torch.equal(d.bias_delta, torch.ones(8))


def test_load_peft_folder_and_diffusers_metadata(tmp_path):
    A, B = ab(16, 16)
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file(peft_keys("base_model.model.", "blocks.0.attn.to_q", A, B), folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 16, "peft_type": "LORA"}))
    lora = load_lora(folder)
    assert lora.adapter_config["lora_alpha"] == 16 and lora.path.name == "adapter_model.safetensors"
    assert set(load_lora_state_dict(folder)) == {"base_model.model.blocks.0.attn.to_q.lora_A.weight",
                                                 "base_model.model.blocks.0.attn.to_q.lora_B.weight"}
    # diffusers' save_lora_weights stores the config in the safetensors header instead
    file = tmp_path / "pytorch_lora_weights.safetensors"
    save_file(peft_keys("transformer.", "blocks.0.attn.to_q", A, B), file,
              metadata={"lora_adapter_metadata": json.dumps({"transformer.r": 4, "transformer.lora_alpha": 2})})
    assert load_lora(file).adapter_config == {"r": 4, "lora_alpha": 2}
    model = Tiny()
    before = model.blocks[0].attn.to_q.weight.detach().double().clone()
    fuse_lora_files(model, [(file, 3.0)])
    expected = before + 1.5 * (B.double() @ A.double())
    torch.testing.assert_close(model.blocks[0].attn.to_q.weight.detach().double(), expected, rtol=1e-6, atol=1e-5)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_lora(tmp_path / "does-not-exist.safetensors")
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(LoraFormatError, match=r"x\.bin is not a \.safetensors file"):
        load_lora(tmp_path / "x.bin")
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        save_file({"t": torch.zeros(1)}, folder / name)
    with pytest.raises(LoraFormatError, match=r"found \['a.safetensors', 'b.safetensors'\]"):
        load_lora(folder)


# ---- kohya ----------------------------------------------------------------------------------------------------
def test_kohya_keys_map_back_by_module_names():
    A, B = ab(16, 16)
    sd = {"lora_unet_blocks_1_attn_to_out_0.lora_down.weight": A, "lora_unet_blocks_1_attn_to_out_0.lora_up.weight": B,
          "lora_unet_blocks_1_attn_to_out_0.alpha": torch.tensor(1.0),
          "lora_transformer_proj_out.lora_down.weight": A, "lora_transformer_proj_out.lora_up.weight": B[:8]}
    deltas = normalize_lora(sd, Tiny())
    assert set(deltas) == {"blocks.1.attn.to_out.0", "proj_out"}
    assert deltas["blocks.1.attn.to_out.0"].scale == 0.25 and deltas["proj_out"].scale == 1.0


def test_kohya_ambiguity_is_an_error():
    model = nn.Module()
    model.a_b = nn.Module()
    model.a_b.c = nn.Linear(4, 4)
    model.a = nn.Module()
    model.a.b_c = nn.Linear(4, 4)
    A, B = ab(4, 4, rank=1)
    with pytest.raises(LoraFormatError, match=r"lora_unet_a_b_c.*ambiguous.*\['a.b_c', 'a_b.c'\]"):
        normalize_lora({"lora_unet_a_b_c.lora_down.weight": A, "lora_unet_a_b_c.lora_up.weight": B}, model)


def test_layouts_only_diffusers_converts_need_it_in_one_line(monkeypatch):
    from diffusers import FluxTransformer2DModel

    from vllm_diffusion_plugin.tiny.models import TINY_CONFIGS

    with torch.device("meta"):
        flux = FluxTransformer2DModel(**TINY_CONFIGS["flux"])
    monkeypatch.setitem(sys.modules, "diffusers.loaders.lora_pipeline", None)  # import -> ImportError
    sd = {"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": torch.zeros(2, 32),
          "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": torch.zeros(32, 2)}
    with pytest.raises(UnmatchedLoraKeysError, match=r"lora_unet_double_blocks_0_img_attn_proj.*diffusers, not "
                       r"installed here.*pip install \"vllm-diffusion-plugin\[cli\]\"") as err:
        normalize_lora(sd, flux)
    assert "\n" not in str(err.value)


# ---- Wan / LightX2V --------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:cutlass.*deprecated:DeprecationWarning")  # flashinfer, imported by diffusers
@pytest.mark.parametrize("i2v", [False, True])
def test_wan_rename_table_agrees_with_diffusers_checkpoint_converter(i2v):
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    config = WAN_CONFIG | ({"image_dim": 24, "added_kv_proj_dim": 16} if i2v else {})
    names = [n for n, _ in WanTransformer3DModel(**config).named_parameters()]
    for name in names:
        owner, _, leaf = name.rpartition(".")
        original = wan.diffusers_to_wan_name(name) if leaf == "scale_shift_table" else (
            f"{wan.diffusers_to_wan_name(owner)}.{leaf}" if owner else name)
        converted = convert_wan_transformer_to_diffusers({f"model.diffusion_model.{original}": None})
        assert list(converted) == [name], (name, original)
        assert wan.wan_to_diffusers_name(original.rpartition(".")[0] if owner and leaf != "scale_shift_table"
                                             else original) == (owner if leaf != "scale_shift_table" else name)


def test_wan_lightx2v_keys():
    model = tiny_wan()
    A, B = ab(16, 16, rank=4)
    sd = {}
    for i in range(2):
        for o in "qkvo":
            for attn in ("self_attn", "cross_attn"):
                base = f"diffusion_model.blocks.{i}.{attn}.{o}"
                sd |= {f"{base}.lora_down.weight": A, f"{base}.lora_up.weight": B, f"{base}.alpha": torch.tensor(8.0),
                       f"{base}.diff_b": torch.ones(16)}
        ffn_a, ffn_b = ab(32, 16)
        sd |= {f"diffusion_model.blocks.{i}.ffn.0.lora_down.weight": ffn_a,
               f"diffusion_model.blocks.{i}.ffn.0.lora_up.weight": ffn_b}
        sd[f"diffusion_model.blocks.{i}.norm3.diff"] = torch.full((16,), 0.5)
        sd[f"diffusion_model.blocks.{i}.norm3.diff_b"] = torch.full((16,), 0.25)
        sd[f"diffusion_model.blocks.{i}.self_attn.norm_q.diff"] = torch.ones(16)
        sd[f"diffusion_model.blocks.{i}.modulation.diff"] = torch.ones(1, 6, 16)
    sd |= {"diffusion_model.head.head.lora_A.weight": A, "diffusion_model.head.head.lora_B.weight": ab(16, 16)[1],
           "diffusion_model.head.head.diff_b": torch.ones(16),
           "diffusion_model.text_embedding.0.lora_down.weight": A, "diffusion_model.text_embedding.0.lora_up.weight": B,
           "diffusion_model.time_projection.1.diff_b": torch.ones(96),
           "diffusion_model.patch_embedding.diff": torch.ones(16, 4, 1, 2, 2)}
    deltas = normalize_lora(sd, model, scale=2.0)
    d = deltas["blocks.1.attn2.to_out.0"]
    assert d.A is A and d.scale == 2.0 * 8.0 / 4 and torch.equal(d.bias_delta, torch.full((16,), 2.0))
    assert deltas["blocks.0.ffn.net.0.proj"].scale == 2.0
    norm = deltas["blocks.0.norm2"]  # Wan's norm3 is diffusers' norm2 (the cross-attention norm)
    assert norm.A is None and torch.equal(norm.full_delta, torch.ones(16))
    assert torch.equal(norm.bias_delta, torch.full((16,), 0.5))
    assert torch.equal(deltas["blocks.1.attn1.norm_q"].full_delta, torch.full((16,), 2.0))
    assert deltas["blocks.0.scale_shift_table"].full_delta.shape == (1, 6, 16)
    assert {"proj_out", "condition_embedder.text_embedder.linear_1", "condition_embedder.time_proj",
            "patch_embedding"} <= set(deltas)
    assert len(deltas) == 2 * (8 + 1 + 1 + 1 + 1) + 4


def test_wan_musubi_kohya_keys():
    model = tiny_wan()
    A, B = ab(16, 16)
    sd = {"lora_unet_blocks_1_cross_attn_o.lora_down.weight": A, "lora_unet_blocks_1_cross_attn_o.lora_up.weight": B,
          "lora_unet_blocks_1_cross_attn_o.alpha": torch.tensor(2.0),
          "lora_unet_blocks_0_ffn_2.lora_down.weight": ab(16, 32)[0], "lora_unet_blocks_0_ffn_2.lora_up.weight": B}
    deltas = normalize_lora(sd, model)
    assert set(deltas) == {"blocks.1.attn2.to_out.0", "blocks.0.ffn.net.2"}
    assert deltas["blocks.1.attn2.to_out.0"].scale == 0.5


# ---- packed targets ---------------------------------------------------------------------------------------------
def test_packed_slices_stack_exactly():
    model = Packed()
    sd, ref_parts = {}, []
    for name, out_f, rank, alpha in (("q_proj", 16, 4, 8.0), ("k_proj", 8, 2, 2.0), ("v_proj", 8, 4, 4.0)):
        A, B = ab(out_f, 16, rank=rank, seed=out_f + rank)
        sd |= peft_keys("", f"layers.0.{name}", A, B) | {f"layers.0.{name}.alpha": torch.tensor(alpha)}
        ref_parts.append(0.5 * alpha / rank * (B.double() @ A.double()))
    sd["layers.0.v_proj.lora_B.bias"] = torch.ones(8)
    deltas = normalize_lora(sd, model, scale=0.5, packed_modules=PACKED)
    d = deltas["layers.0.qkv_proj"]
    assert d.A.shape == (10, 16) and d.B.shape == (32, 10)
    torch.testing.assert_close(d.scale * (d.B.double() @ d.A.double()), torch.cat(ref_parts), rtol=1e-6, atol=1e-6)
    assert torch.equal(d.bias_delta, torch.cat([torch.zeros(24), torch.ones(8) * 0.5]))


def test_packed_kohya_and_equal_scales_keep_dtype():
    model = Packed()
    A, B = ab(24, 16)
    sd = {}
    for name in ("gate_proj", "up_proj"):
        sd |= {f"lora_unet_layers_1_{name}.lora_down.weight": A.bfloat16(),
               f"lora_unet_layers_1_{name}.lora_up.weight": B.bfloat16()}
    d = normalize_lora(sd, model, packed_modules=PACKED)["layers.1.gate_up_proj"]
    assert d.A.dtype == d.B.dtype == torch.bfloat16 and d.scale == 1.0
    assert torch.equal(d.B[:24, 4:], torch.zeros(24, 4)) and torch.equal(d.B[24:, :4], torch.zeros(24, 4))


def test_partial_packed_slices_are_an_error():
    sd = peft_keys("", "layers.0.q_proj", *ab(16, 16)) | peft_keys("", "layers.0.v_proj", *ab(8, 16))
    pattern = r"layers\.0\.qkv_proj .*\['q_proj', 'v_proj'\] but not for \['k_proj'\]"
    with pytest.raises(PartialPackedLoraError, match=pattern):
        normalize_lora(sd, Packed(), packed_modules=PACKED)


def test_packed_slice_sizes_must_add_up():
    sd = {}
    for name in ("q_proj", "k_proj", "v_proj"):
        sd |= peft_keys("", f"layers.0.{name}", *ab(8, 16))
    with pytest.raises(LoraShapeError, match=r"sum to 24 rows but its weight is \(32, 16\)"):
        normalize_lora(sd, Packed(), packed_modules=PACKED)


# ---- every bad input: its error, and the module bit-identical --------------------------------------------------
def _bad_inputs():
    A, B = ab(16, 16)
    base = peft_keys("", "blocks.0.attn.to_q", A, B)
    nan_a = A.clone()
    nan_a[0, 0] = float("nan")
    inf_b = B.clone()
    inf_b[1, 2] = float("inf")
    return {
        "unmatched": (base | peft_keys("", "blocks.7.attn.to_q", A, B), {}, UnmatchedLoraKeysError,
                      r"2 of 4 LoRA keys match no module of Tiny: blocks\.7\.attn\.to_q\.lora_A\.weight"),
        "not a lora key": (base | {"blocks.0.attn.to_q.weight": A}, {}, UnmatchedLoraKeysError,
                           r"blocks\.0\.attn\.to_q\.weight$"),
        "shape": (peft_keys("", "blocks.0.ff", A, B), {}, LoraShapeError,
                  r"shape mismatch for blocks\.0\.ff: B @ A is \(16, 16\) .* but the weight is \(24, 16\)"),
        "rank": (peft_keys("", "blocks.0.attn.to_q", A, B[:, :3]), {}, LoraRankError,
                 r"rank mismatch for blocks\.0\.attn\.to_q: .*lora_A\.weight is \(4, 16\) "
                 r"and .*lora_B\.weight is \(16, 3\)"),
        "config rank": (base, {"adapter_config": {"r": 8, "lora_alpha": 8}}, LoraRankError,
                        r"adapter config says r=8 for blocks\.0\.attn\.to_q but .* has rank 4"),
        "nan A": (peft_keys("", "blocks.0.attn.to_q", nan_a, B), {}, NonFiniteLoraError,
                  r"lora_A\.weight \(4, 16\) holds NaN"),
        "inf B": (peft_keys("", "blocks.0.attn.to_q", A, inf_b), {}, NonFiniteLoraError,
                  r"lora_B\.weight \(16, 4\) holds NaN or inf"),
        "nan alpha": (base | {"blocks.0.attn.to_q.alpha": torch.tensor(float("nan"))}, {}, NonFiniteLoraError,
                      r"to_q\.alpha"),
        "alpha shape": (base | {"blocks.0.attn.to_q.alpha": torch.ones(2)}, {}, LoraShapeError,
                        r"must hold one number"),
        "nan scale": (base, {"scale": float("inf")}, NonFiniteLoraError, r"LoRA scale inf is not finite"),
        "no B": ({"blocks.0.attn.to_q.lora_A.weight": A}, {}, LoraFormatError, r"has lora_A/lora_down but no lora_B"),
        "bias without bias": (peft_keys("", "blocks.0.ff", *ab(24, 16)) | {"blocks.0.ff.lora_B.bias": torch.ones(24)},
                              {},
                              LoraShapeError, r"bias delta for blocks\.0\.ff but that module has no bias"),
        "full delta shape": ({"blocks.0.attn.to_q.diff": torch.ones(16, 8)}, {}, LoraShapeError,
                             r"full delta for blocks\.0\.attn\.to_q is \(16, 8\) but the weight is \(16, 16\)"),
        "dora": (base | {"blocks.0.attn.to_q.lora_magnitude_vector": torch.ones(16)}, {}, UnsupportedLoraError,
                 r"DoRA"),
        "lora on a norm": (peft_keys("", "norm", A, B), {}, LoraShapeError,
                           r"need a 2-D \(linear\) weight; norm\.weight is \(16,\)"),
        "partial packed": (peft_keys("", "layers.0.gate_proj", *ab(24, 16)), {"packed_modules": PACKED},
                           PartialPackedLoraError, r"not for \['up_proj'\]"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_input_errors_before_any_write(case, tmp_path):
    sd, kwargs, error, pattern = _bad_inputs()[case]
    model = Packed() if "packed" in case else Tiny()
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    with pytest.raises(error, match=pattern):
        normalize_lora(sd, model, **kwargs)
    if "scale" not in kwargs and "adapter_config" not in kwargs:  # the same through the one-call API
        good = tmp_path / "good.safetensors"
        save_file(peft_keys("", "blocks.0.attn.to_k", *ab(16, 16)) if case != "partial packed"
                  else peft_keys("", "layers.1.qkv_proj", *ab(32, 16)), good)
        bad = tmp_path / "bad.safetensors"
        save_file({k: v.clone() for k, v in sd.items()}, bad)
        with pytest.raises(error):
            fuse_lora_files(model, [(good, 1.0), (bad, 1.0)], packed_modules=kwargs.get("packed_modules"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{case}: {name} was modified"


def test_non_strict_skips_unmatched_keys_with_one_warning(format_warnings):
    A, B = ab(16, 16)
    sd = peft_keys("", "blocks.0.attn.to_q", A, B)
    sd |= {f"blocks.{i}.attn.missing.lora_A.weight": A for i in range(25)}
    deltas = normalize_lora(sd, Tiny(), strict=False)
    assert list(deltas) == ["blocks.0.attn.to_q"]
    assert len(format_warnings) == 1
    message = format_warnings[0].getMessage()
    assert "25 of 27 LoRA keys match no module of Tiny" in message and "(and 5 more)" in message
    with pytest.raises(UnmatchedLoraKeysError, match=r"\(and 5 more\)$"):
        normalize_lora(sd, Tiny())


def test_duplicate_keys_for_one_target_are_an_error():
    A, B = ab(16, 16)
    sd = peft_keys("transformer.", "blocks.0.attn.to_q", A, B) | peft_keys("", "blocks.0.attn.to_q", A, B)
    with pytest.raises(LoraFormatError, match=r"both give the A of blocks\.0\.attn\.to_q"):
        normalize_lora(sd, Tiny())
