"""Z-Image without a server (the omni stage): the tiny runnable folder diffusers runs, and the CPU platform's
activation kernels (``cpu.patch_activation_ops``; vllm-omni's default diffusion stage keeping the flag is tested
once, with the Qwen-Image folder, in test_omni_qwen_image.py). The servers themselves:
``tests/serve/test_serve_images.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from omni_support import import_omni

from vllm_diffusion_plugin.tiny.models import TINY_CONFIGS, write_tiny_pipeline

import_omni()  # skips this module where vllm-omni is not installed



@pytest.fixture(scope="module")
def z_image(tmp_path_factory) -> Path:
    return write_tiny_pipeline(tmp_path_factory.mktemp("z-image") / "pipe", "z-image", runnable=True)


def test_the_tiny_z_image_folder_runs_in_diffusers(z_image):
    from diffusers import ZImagePipeline

    index = json.loads((z_image / "model_index.json").read_text())
    assert index["_class_name"] == "ZImagePipeline" and index["text_encoder"] == ["transformers", "Qwen3Model"]
    assert len(list((z_image / "transformer").glob("*.safetensors"))) >= 3
    text = json.loads((z_image / "text_encoder" / "config.json").read_text())
    vae = json.loads((z_image / "vae" / "config.json").read_text())
    assert text["hidden_size"] == TINY_CONFIGS["z-image"]["cap_feat_dim"]
    assert vae["latent_channels"] == TINY_CONFIGS["z-image"]["in_channels"]
    pipe = ZImagePipeline.from_pretrained(z_image, torch_dtype=torch.float32)
    prompt = pipe.tokenizer.apply_chat_template([{"role": "user", "content": "a red cat"}], tokenize=False,
                                                add_generation_prompt=True, enable_thinking=True)
    assert prompt == "<|im_start|>user\na red cat<|im_end|>\n<|im_start|>assistant\n"
    assert len(pipe.tokenizer(prompt).input_ids) < 32  # special tokens are single tokens
    image = pipe("a red cat walks on the beach", height=64, width=64, num_inference_steps=2, guidance_scale=0.0,
                 generator=torch.Generator().manual_seed(0), output_type="np").images
    assert image.shape == (1, 64, 64, 3) and image.std() > 0.05


ACTIVATION_PROBE = textwrap.dedent("""
    import json, torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import activation as act
    from vllm_diffusion_plugin.doors.omni.cpu import patch_activation_ops as unit

    def build_each():  # op -> True, or the error building its layer the way a model does
        built = {}
        for op, (name, args, _) in unit.OPS.items():
            try:
                built[op] = getattr(act, name)(*args)
            except AttributeError as exc:
                built[op] = str(exc)
        return built

    with set_current_vllm_config(VllmConfig()):
        before = {op: layer if isinstance(layer, str) else True for op, layer in build_each().items()}
        result = {"failed_before": sorted(op for op, ok in before.items() if ok is not True),
                  "errors_before": [e for e in before.values() if e is not True],
                  "apply": [unit.apply(act), unit.apply(act)], "defined": unit._state["defined"]}
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
        diffs = {}
        for op, layer in build_each().items():
            assert not isinstance(layer, str), layer
            if hasattr(layer, "op"):  # bound on this platform: the kernel must be vLLM's own math
                out = torch.empty_like(layer.forward_native(x))
                layer.op(out, x)
                diffs[op] = float((out - layer.forward_native(x)).abs().max())
        result["diffs"] = diffs
    print("RESULT " + json.dumps(result))
""")


def test_the_cpu_activation_kernels_vllm_binds_are_defined_with_its_native_math():
    """In a fresh process on vLLM's CPU platform (torch.ops state is per process): the layers whose ``__init__``
    binds a ``_C`` kernel on this vLLM fail to build before the unit, as FLUX.1's T5 and Z-Image did in real
    servers (which ones depends on the vLLM line: all six on 0.30, the three GELUs from 0.31 on); the unit defines
    exactly those ops, every layer builds afterwards, and each bound op computes vLLM's own ``forward_native``."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_DIFFUSION_PLUGIN": "0"}
    done = subprocess.run([sys.executable, "-c", ACTIVATION_PROBE], env=env, capture_output=True, text=True,
                          timeout=300)
    line = [s for s in done.stdout.splitlines() if s.startswith("RESULT ")]
    assert done.returncode == 0 and line, done.stderr[-3000:]
    result = json.loads(line[0].removeprefix("RESULT "))
    assert result["failed_before"], "no activation layer binds a _C kernel here: the unit would be dead code"
    assert all("_C" in e for e in result["errors_before"]), result["errors_before"]
    assert result["apply"] == ["applied", "already applied"]
    assert sorted(result["defined"]) == result["failed_before"]
    assert set(result["diffs"]) >= set(result["failed_before"]) and max(result["diffs"].values()) <= 1e-6, result
