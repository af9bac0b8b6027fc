"""LyCORIS LoKr / LoHa fused exactly, the oracle being peft's own merge of the same adapter; DoRA and the forms
we do not fuse refused in one line naming the file and the key.

Each adapter is built by peft's LoKr / LoHa layers on a tiny model (factors seeded random), written as peft's
adapter state dict under LyCORIS / kohya key names (``testing.lycoris_files``), fused by us into a copy of the
base model and compared with peft's ``merge_and_unload()`` (fp32: per tensor max |diff| <= 1e-6 * max |W|, the
same set of changed tensors).
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vllm_diffusion_plugin.engine.lora import (
    LoraFormatError,
    LoraRankError,
    NonFiniteFusionError,
    UnsupportedLoraError,
    fuse_lora,
    fuse_lora_files,
    normalize_lora,
    prepare_lora_files,
)
from vllm_diffusion_plugin.engine.lora.lycoris import FactoredDelta
from vllm_diffusion_plugin.testing.lycoris_files import lycoris_state_dict, peft_lycoris, write_lycoris_file

TARGETS = ["blocks.0.to_q", "blocks.0.to_out", "blocks.1.to_q", "blocks.1.to_out"]


class Net(nn.Module):
    """Diffusers-like names; 96 x 64 and 64 x 96 linears (peft factorizes 96 as 8 x 12, 64 as 8 x 8)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"to_q": nn.Linear(64, 96), "to_out": nn.Linear(96, 64)})
                                    for _ in range(2))
        self.norm = nn.LayerNorm(64)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


CASES = {  # id: (peft kind, peft config)
    "lokr w1 whole, w2 factorized": ("lokr", dict(r=2, alpha=3)),
    "lokr both factorized": ("lokr", dict(r=2, alpha=3, decompose_both=True)),
    "lokr no decomposition": ("lokr", dict(r=16, alpha=16)),  # LyCORIS: alpha = dim there, scale 1
    "lokr decompose_factor 4": ("lokr", dict(r=3, alpha=5, decompose_factor=4)),
    "loha": ("loha", dict(r=3, alpha=5)),
}


def peft_merged(kind: str, config: dict, *, seed: int = 1, scale: float | None = None):
    """(base model, peft model, peft's merged state dict)."""
    base = Net()
    peft_model = peft_lycoris(copy.deepcopy(base), kind, seed=seed, target_modules=TARGETS, **config)
    if scale is not None:  # peft's own scaling API on every LyCORIS layer
        for module in peft_model.modules():
            if hasattr(module, "set_scale") and hasattr(module, "r") and "default" in getattr(module, "r", {}):
                module.set_scale("default", scale)
    merged = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    return base, peft_model, merged


def assert_equal_to(ours: dict, merged: dict, base: dict) -> None:
    assert ours.keys() == merged.keys()
    changed = {k for k in merged if not torch.equal(merged[k], base[k])}
    assert {k for k in ours if not torch.equal(ours[k], base[k])} == changed and changed
    for key in merged:
        bound = 1e-6 * float(merged[key].abs().max())
        assert float((ours[key] - merged[key]).abs().max()) <= bound, key


@pytest.mark.parametrize("case", list(CASES))
def test_fused_equals_peft_merge(case, tmp_path):
    kind, config = CASES[case]
    base, peft_model, merged = peft_merged(kind, config)
    path = write_lycoris_file(tmp_path / "lycoris.safetensors", peft_model)
    ours = copy.deepcopy(base)
    stats = fuse_lora_files(ours, [(path, 1.0)])
    assert stats.targets == len(TARGETS)
    assert_equal_to(ours.state_dict(), merged, base.state_dict())


def test_scale_dotted_names_and_a_peft_folder_with_its_config(tmp_path):
    base, peft_model, merged = peft_merged("lokr", dict(r=2, alpha=3), scale=0.5)
    dotted = tmp_path / "dotted.safetensors"
    save_file(lycoris_state_dict(peft_model, naming="dotted"), str(dotted))
    ours = copy.deepcopy(base)
    fuse_lora_files(ours, [(dotted, 0.5)])
    assert_equal_to(ours.state_dict(), merged, base.state_dict())

    _, peft_model, merged = peft_merged("loha", dict(r=3, alpha=5))
    peft_model.save_pretrained(tmp_path / "peft")  # base_model.model.<module>.hada_w1_a ..., alpha in the config
    assert not any(k.endswith(".alpha") for k in load_file(tmp_path / "peft" / "adapter_model.safetensors"))
    assert json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["alpha"] == 5
    ours = copy.deepcopy(base)
    fuse_lora_files(ours, [(tmp_path / "peft", 1.0)])
    assert_equal_to(ours.state_dict(), merged, base.state_dict())


def test_factors_stay_factored_until_fusion_and_row_slices_are_exact(tmp_path):
    """No full-size delta is held: the normal form keeps the factors; rows are materialized on demand (as
    ``rank_local`` slices them), equal to the same rows of the whole delta."""
    base, peft_model, _ = peft_merged("lokr", dict(r=2, alpha=3))
    deltas = normalize_lora(lycoris_state_dict(peft_model), base)
    for name, delta in deltas.items():
        full = delta.full_delta
        assert isinstance(full, FactoredDelta) and delta.A is None
        assert sum(t.numel() for t in full.factors()) < full.shape.numel() / 4
        whole = full.materialize()
        for rows in (slice(0, 5), slice(7, 40), slice(13, full.shape[0])):
            assert torch.equal(full[rows].materialize(), whole[rows]), (name, rows)
            assert torch.equal(full[rows][2:4].materialize(), whole[rows][2:4])


def test_rank_local_rows_fuse_their_slice_of_the_factored_delta():
    """``fuse_bound_rows`` (rank_local, also vllm-omni's stacked q/k/v): a target holding rows 40:70 of one
    checkpoint tensor and all rows of another gets exactly those rows of each LoKr delta."""
    from vllm_diffusion_plugin.engine.io.rows import RowBinding
    from vllm_diffusion_plugin.engine.lora.rows import fuse_bound_rows

    base, peft_model, merged = peft_merged("lokr", dict(r=2, alpha=3, decompose_both=True))
    deltas = normalize_lora(lycoris_state_dict(peft_model), base)
    w0, w1 = (base.state_dict()[f"blocks.{i}.to_q.weight"] for i in (0, 1))
    targets = {"part": w0[40:70].clone(), "stacked": torch.cat([w1, w0[:10]])}
    bindings = [RowBinding("blocks.0.to_q.weight", "part", start=0, key_start=40, rows=30),
                RowBinding("blocks.1.to_q.weight", "stacked", start=0, rows=96),
                RowBinding("blocks.0.to_q.weight", "stacked", start=96, rows=10)]
    wanted = {name: d for name, d in deltas.items() if name.endswith("to_q")}
    stats = fuse_bound_rows(targets, bindings, [wanted], modules=[n for n, _ in base.named_modules()], chunk_mb=1)
    assert stats.targets == 3
    m0, m1 = merged["blocks.0.to_q.weight"], merged["blocks.1.to_q.weight"]
    torch.testing.assert_close(targets["part"], m0[40:70], rtol=0, atol=1e-6)
    torch.testing.assert_close(targets["stacked"], torch.cat([m1, m0[:10]]), rtol=0, atol=1e-6)


def test_a_packed_target_stacks_factored_slices(tmp_path):
    """vLLM-native models pack q/k/v: LoKr deltas of the slices are stacked by rows, still factored."""
    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = nn.Linear(64, 3 * 96)

    base, peft_model, merged = peft_merged("lokr", dict(r=2, alpha=3))
    tensors = lycoris_state_dict(peft_model, naming="dotted")
    sd = {}
    for sub, block in zip(("q_proj", "k_proj", "v_proj"), ("blocks.0.to_q", "blocks.1.to_q", None)):
        if block is None:  # v from a plain LoRA: the packed target mixes a LoKr and a B @ A slice
            sd |= {f"{sub}.lora_A.weight": torch.randn(2, 64) * 0.1, f"{sub}.lora_B.weight": torch.randn(96, 2) * 0.1}
            continue
        sd |= {k.replace(block, sub): v for k, v in tensors.items() if k.startswith(block + ".")}
    packed = Packed()
    deltas = normalize_lora(sd, packed, packed_modules={"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    full = deltas["qkv_proj"].full_delta
    assert isinstance(full, FactoredDelta) and full.shape == (288, 64)
    before = packed.qkv_proj.weight.detach().clone()
    fuse_lora(packed, deltas)
    fused = packed.qkv_proj.weight.detach()
    for i, block in enumerate(("blocks.0.to_q", "blocks.1.to_q")):
        expected = before[96 * i:96 * (i + 1)] + (merged[f"{block}.weight"] - base.state_dict()[f"{block}.weight"])
        torch.testing.assert_close(fused[96 * i:96 * (i + 1)], expected, rtol=0, atol=1e-6)


def test_fused_on_the_accelerator_and_a_failed_copy_falls_back_to_cpu(fake_accelerator, tmp_path):
    """The device rule holds for factored deltas: rows materialized and fused on the usable accelerator; an H2D
    failure mid-weight continues on the CPU from the first row not written back, same result."""
    base, peft_model, merged = peft_merged("loha", dict(r=3, alpha=5))
    deltas = normalize_lora(lycoris_state_dict(peft_model), base)
    on_device = copy.deepcopy(base)
    fake_accelerator.reset_counters()
    stats = fuse_lora(on_device, deltas)
    assert stats.compute_device == str(fake_accelerator.device) and stats.cpu_kernel is None
    weight_bytes = sum(base.get_submodule(t).weight.numel() * 4 for t in TARGETS)
    assert fake_accelerator.d2h_bytes >= weight_bytes  # fused rows came back
    assert_equal_to(on_device.state_dict(), merged, base.state_dict())

    fallback = copy.deepcopy(base)
    fake_accelerator.reset_counters()
    with fake_accelerator.fail_h2d_after(4096):
        stats = fuse_lora(fallback, deltas, chunk_mb=1)
    assert stats.fallbacks >= 1 and stats.cpu_kernel == "fp32-chunks"
    assert_equal_to(fallback.state_dict(), merged, base.state_dict())


def test_an_overflowing_product_is_refused_before_its_weight_is_written(tmp_path):
    base, peft_model, _ = peft_merged("lokr", dict(r=2, alpha=3))
    tensors = lycoris_state_dict(peft_model)
    for key in [k for k in tensors if k.startswith("lora_unet_blocks_1_to_out.lokr_")]:  # finite, huge product
        tensors[key] = torch.full_like(tensors[key], 3e38 if key.endswith("w1") else 1e3)
    model = copy.deepcopy(base)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NonFiniteFusionError, match=r"NaN/inf"):
        fuse_lora(model, {"blocks.1.to_out": normalize_lora(tensors, model)["blocks.1.to_out"]})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _refused():
    """id: (edit of a LoKr file's tensors, error, pattern naming the key)."""
    def add(key_tail, tensor):
        return lambda t: t | {f"lora_unet_blocks_0_to_q.{key_tail}": tensor}

    def drop(kind):
        return lambda t: {k: v for k, v in t.items() if not k.endswith(f"blocks_0_to_q.{kind}")}

    def reshape(kind, shape):
        return lambda t: {k: (torch.zeros(shape) if k.endswith(f"blocks_0_to_q.{kind}") else v) for k, v in t.items()}

    return {
        "tucker": (add("lokr_t2", torch.zeros(2, 2, 3, 3)), UnsupportedLoraError,
                   r"lora_unet_blocks_0_to_q\.lokr_t2: the LyCORIS Tucker/CP form"),
        "conv": (reshape("lokr_w2_b", (2, 8, 3, 3)), UnsupportedLoraError,
                 r"lora_unet_blocks_0_to_q\.lokr_w2_b is \(2, 8, 3, 3\): conv LoKr"),
        "missing factor": (drop("lokr_w2_b"), LoraFormatError,
                           r"LoKr for blocks\.0\.to_q lacks lokr_w2 .*lora_unet_blocks_0_to_q\.lokr_w2_a"),
        "rank": (reshape("lokr_w2_b", (3, 8)), LoraRankError,
                 r"rank mismatch for blocks\.0\.to_q: lora_unet_blocks_0_to_q\.lokr_w2_a is \(12, 2\)"),
        "mixed with lora_A": (add("lora_A.weight", torch.zeros(2, 64)), LoraFormatError,
                              r"LoRA keys for blocks\.0\.to_q mix adapter kinds"),
        "dora": (add("dora_scale", torch.ones(96, 1)), UnsupportedLoraError,
                 r"DoRA .* is not fused; 1 such key\(s\): lora_unet_blocks_0_to_q\.dora_scale"),
        "peft dora": (add("lora_magnitude_vector", torch.ones(96)), UnsupportedLoraError,
                      r"DoRA .* lora_unet_blocks_0_to_q\.lora_magnitude_vector"),
    }


@pytest.mark.parametrize("case", list(_refused()))
def test_forms_we_do_not_fuse_are_one_line_naming_file_and_key(case, tmp_path):
    edit, error, pattern = _refused()[case]
    base, peft_model, _ = peft_merged("lokr", dict(r=2, alpha=3))
    path = tmp_path / f"{case.replace(' ', '_')}.safetensors"
    save_file(edit(lycoris_state_dict(peft_model)), str(path))
    with pytest.raises(error) as caught:
        prepare_lora_files(base, [(path, 1.0)], component="transformer")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"LoRA file {path} for transformer (Net): "), message
    assert re.search(pattern, message), message


def test_cli_fuses_a_lokr_and_a_loha_into_a_tiny_wan_pipeline_equal_to_peft(tiny_wan_dir, tmp_path, capsys,
                                                                              monkeypatch):
    """End to end through ``vllm-diffusion load --lora A --lora B --save-fused``: LoKr for ``transformer``, LoHa for
    ``transformer_2`` (by position), each equal to peft's merge on the diffusers DiT itself."""
    from diffusers import WanTransformer3DModel

    from vllm_diffusion_plugin.doors import cli

    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    targets = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    expected, files = {}, []
    for name, kind, config in (("transformer", "lokr", dict(r=1, alpha=2)),
                               ("transformer_2", "loha", dict(r=2, alpha=3))):
        peft_model = peft_lycoris(WanTransformer3DModel.from_pretrained(tiny_wan_dir / name), kind, seed=7,
                                  target_modules=targets, **config)
        files.append(write_lycoris_file(tmp_path / f"{name}_{kind}.safetensors", peft_model))
        expected[name] = peft_model.merge_and_unload().state_dict()
    out = tmp_path / "fused"
    assert cli.main(["load", str(tiny_wan_dir), *(f"--lora={f}" for f in files), "--device", "cpu",
                     "--dtype", "float32", "--save-fused", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lora_keys_fused"] == sum(len({k.rpartition(".")[0] for k in load_file(f)}) for f in files) == 40
    for name, merged in expected.items():
        base = WanTransformer3DModel.from_pretrained(tiny_wan_dir / name).state_dict()
        ours = WanTransformer3DModel.from_pretrained(out / name).state_dict()
        assert_equal_to(ours, merged, base)
