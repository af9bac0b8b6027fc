"""The ``diffusion-hsdp`` loader inside real vLLM: in-process ``get_model()`` on CPU (gloo, world 1).

vLLM's CPU forward needs attention kernels the PyPI wheel lacks, so the comparisons are on every parameter
(with all weights equal the model's logits are equal) plus ``compute_logits`` of a fixed hidden state (vLLM's
real LM head and logits processor). The token-level proof through a served model is ``tests/e2e``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCENARIOS = Path(__file__).parent / "vllm_scenarios" / "get_model_scenarios.py"


def write_tiny_llama(root: Path) -> dict[str, Path]:
    """A tiny Llama (transformers), a peft LoRA for it, and the peft-merged checkpoint."""
    from vllm_diffusion_plugin.testing.tiny_models import add_tiny_llama_lora, build_tiny_llama

    base = build_tiny_llama(vocab_size=256, max_position_embeddings=128)
    base.save_pretrained(root / "base", safe_serialization=True)
    peft_model = add_tiny_llama_lora(base, seed=1, b_std=0.05)
    peft_model.save_pretrained(root / "lora")
    peft_model.merge_and_unload().save_pretrained(root / "merged", safe_serialization=True)
    return {"base": root / "base", "lora": root / "lora", "merged": root / "merged"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    paths = write_tiny_llama(root)
    spec = [
        {"name": "default_base", "model": str(paths["base"]), "load_format": "auto"},
        {"name": "ours_base", "model": str(paths["base"]), "load_format": "diffusion-hsdp"},
        {"name": "default_merged", "model": str(paths["merged"]), "load_format": "auto"},
        {"name": "ours_lora", "model": str(paths["base"]), "load_format": "diffusion-hsdp",
         "extra": {"lora_path": str(paths["lora"])}},
        {"name": "ours_hsdp", "model": str(paths["base"]), "load_format": "diffusion-hsdp",
         "extra": {"hsdp_block_pattern": r"model\.layers\.\d+"}},
        {"name": "bad_key", "model": str(paths["base"]), "load_format": "diffusion-hsdp",
         "extra": {"lora_paht": str(paths["lora"])}},
        {"name": "bad_type", "model": str(paths["base"]), "load_format": "diffusion-hsdp",
         "extra": {"lora_scale": "0.5"}},
        {"name": "bad_strategy", "model": str(paths["base"]), "load_format": "diffusion-hsdp",
         "extra": {"hsdp_weight_load": "rank_local"}},
        {"name": "missing_lora", "model": str(paths["base"]), "load_format": "diffusion-hsdp",
         "extra": {"lora_path": str(root / "nope.safetensors")}},
    ]
    (root / "spec.json").write_text(json.dumps(spec))
    out = root / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION")}
    proc = subprocess.run([sys.executable, str(SCENARIOS), str(root / "spec.json"), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {s["name"]: torch.load(out / f"{s['name']}.pt", weights_only=False) for s in spec}


def ok(result: dict) -> dict:
    assert "error" not in result, result.get("traceback")
    return result


def test_plain_load_equals_vllm_default_loader(results):
    default, ours = ok(results["default_base"]), ok(results["ours_base"])
    assert default["params"].keys() == ours["params"].keys()
    for name, tensor in default["params"].items():
        assert torch.equal(tensor, ours["params"][name]), name
    assert torch.equal(default["logits"], ours["logits"])


def test_lora_fused_at_load_equals_peft_merged_checkpoint(results):
    merged, ours, base = ok(results["default_merged"]), ok(results["ours_lora"]), ok(results["default_base"])
    changed = [n for n in merged["params"] if not torch.equal(merged["params"][n], base["params"][n])]
    # every packed projection moved: qkv_proj and gate_up_proj (packed) plus o_proj and down_proj
    assert {n.split(".")[-2] for n in changed} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    for name, tensor in merged["params"].items():
        torch.testing.assert_close(ours["params"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(ours["logits"], merged["logits"], rtol=1e-5, atol=1e-5)


def test_hsdp_when_extra_config_names_a_block_pattern(results):
    default, ours = ok(results["default_base"]), ok(results["ours_hsdp"])
    assert any(name.startswith("model.layers.0.") for name in ours["dtensors"])
    for name, tensor in default["params"].items():
        assert torch.equal(tensor, ours["params"][name]), name


@pytest.mark.parametrize("name, error_type, match", [
    ("bad_key", "ValueError", r"Unknown key\(s\) 'lora_paht'.*known keys: allow_pickle"),
    ("bad_type", "TypeError", r"'lora_scale' must be a number, got str '0.5'"),
    ("bad_strategy", "StrategyError", r"hsdp_weight_load='rank_local' is not available in the vLLM loader"),
    ("missing_lora", "FileNotFoundError", r"lora_path .*nope.safetensors does not exist"),
])
def test_bad_extra_config_fails_before_any_weight_is_read(results, name, error_type, match):
    import re

    result = results[name]
    assert result.get("error_type") == error_type, result
    assert re.search(match, result["error"]), result["error"]
    # raised while vLLM builds the loader (get_model_loader), before initialize_model or any read
    assert "get_model_loader" in result["traceback"] and "load_weights" not in result["traceback"]
