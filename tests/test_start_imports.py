"""What each start-up path of the CLI imports (issue 48): a process pays for what it uses.

Each case runs the command's ``main`` in a fresh interpreter and reads the modules it holds when it returns (what a
user's process imports, not this test process's): ``--help`` and an argument error import no torch; ``plan`` and a
1-rank ``load`` import vLLM's logger and nothing more of vLLM (not its layers, quantization or model loader: a
diffusers DiT has no vLLM layers), the one diffusers transformer the checkpoint names and none of the rest of
diffusers' zoo, and none of the packages diffusers would import for what a load never runs (flashinfer's FP4
kernels, peft and transformers for its own LoRA backend and text encoders).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora

RUN_CLI = """
import json, sys
from vllm_diffusion_plugin.doors.cli import main
try:
    code = main(sys.argv[2:])
finally:
    open(sys.argv[1], "w").write(json.dumps(sorted(sys.modules)))
sys.exit(code)
"""
NOT_FOR_A_LOAD = ("flashinfer", "peft", "transformers")
VLLM_BEYOND_ITS_LOGGER = ("vllm.config", "vllm.model_executor", "vllm.platforms", "vllm.distributed", "vllm.v1",
                          "vllm.engine", "vllm.entrypoints")


def imported(tmp_path, *args: str, ok: bool = True) -> tuple[set[str], str]:
    """The modules ``vllm-diffusion ARGS`` holds when it returns, and what it printed on stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION")}
    listing = tmp_path / "modules.json"
    proc = subprocess.run([sys.executable, "-c", RUN_CLI, str(listing), *args], capture_output=True, text=True,
                          timeout=300, env=env)
    assert (proc.returncode == 0) == ok, proc.stderr[-3000:]
    return set(json.loads(listing.read_text())), proc.stdout


def of(modules: set[str], *packages: str) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in packages))


@pytest.mark.parametrize("args", [("--help",), ("load", "--help"), ("plan", "--help"), ("load",)],
                         ids=["help", "load-help", "plan-help", "argument-error"])
def test_help_and_argument_errors_import_no_torch(tmp_path, args):
    modules, _ = imported(tmp_path, *args, ok=args != ("load",))
    assert of(modules, "torch", "diffusers", "vllm", "safetensors") == []


@pytest.fixture(scope="module")
def wan_and_lora(tiny_wan_dir, tmp_path_factory):
    lora = write_tiny_lora(tmp_path_factory.mktemp("lora") / "lora.safetensors", build_tiny_model("wan"))
    return tiny_wan_dir, lora


@pytest.mark.parametrize("command", [("plan",), ("load", "--device", "cpu", "--dtype", "float32", "--json")],
                         ids=["plan", "load-1-rank"])
def test_a_load_imports_its_one_model_class_and_nothing_a_load_never_uses(tmp_path, wan_and_lora, command):
    checkpoint, lora = wan_and_lora
    modules, out = imported(tmp_path, command[0], str(checkpoint), "--lora", f"transformer={lora}", *command[1:])
    if command[0] == "load":  # the load really ran, its LoRA fused
        assert json.loads(out)["components"][0]["lora_keys_fused"] > 0
    assert of(modules, *NOT_FOR_A_LOAD) == []
    assert of(modules, *VLLM_BEYOND_ITS_LOGGER) == []
    assert [m for m in modules if m.startswith("diffusers.models.transformers.")] == [
        "diffusers.models.transformers.transformer_wan"]
    assert of(modules, "diffusers.pipelines") == []
