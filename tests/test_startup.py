"""Startup cost: a diffusers-only load imports vLLM only where a vLLM object is involved.

A diffusers DiT has no vLLM layers, so the CLI load path must not import vLLM's attention or quantization
modules (seconds of import time: they pull in the kernels' registries). Checked in a fresh interpreter,
since this test process has long imported them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HEAVY = ("vllm.model_executor.layers.attention", "vllm.model_executor.layers.quantization",
         "vllm.model_executor.model_loader")

PROBE = """
import json, sys
from vllm_diffusion_plugin.doors.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "modules": sorted(m for m in sys.modules if m.startswith("vllm."))}),
      file=sys.stderr)
"""


def test_diffusers_only_cli_load_imports_no_vllm_layers(tiny_wan_dir, tmp_path):
    lora = tmp_path / "lora.safetensors"
    from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora

    write_tiny_lora(lora, build_tiny_model("wan", seed=3), seed=3)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), *sys.path]))
    done = subprocess.run([sys.executable, "-c", PROBE, "load", str(tiny_wan_dir), "--component", "transformer",
                           "--device", "cpu", "--lora", str(lora), "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    probe = json.loads(done.stderr.strip().splitlines()[-1])
    assert probe["code"] == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["components"][0]["lora_keys_fused"] > 0  # the load really ran, LoRA included
    heavy = [m for m in probe["modules"] if m.startswith(HEAVY)]
    assert heavy == [], f"a diffusers-only load imported {len(heavy)} vLLM layer/loader modules: {heavy[:8]}"
