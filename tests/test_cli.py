"""``vllm-diffusion load`` / ``demo`` as a user runs them (subprocesses of the installed console script)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora

CLI = [sys.executable, "-m", "vllm_diffusion_plugin.doors.cli"]


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION")}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_console_script_is_installed():
    assert shutil.which("vllm-diffusion") or os.path.exists(os.path.join(os.path.dirname(sys.executable),
                                                                        "vllm-diffusion"))


def test_demo_runs_offline_and_fuses_loras():
    proc = run_cli("demo", "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert [c["name"] for c in report["components"]] == ["transformer", "transformer_2"]
    assert all(c["lora_keys_fused"] > 0 and c["files"] >= 3 for c in report["components"])
    assert report["bytes_read"] > 0 and report["seconds"]["total"] > 0
    # the launching process's phases too, so that what is outside reading and fusing shows (issue #15)
    assert {"imports", "demo_write", "validate", "wall"} <= report["seconds"].keys()
    assert report["seconds"]["wall"] >= report["seconds"]["imports"] + report["seconds"]["total"]
    # per component, the same figures the vllm-omni door's report line carries (one report type, issue #23)
    for c in report["components"]:
        assert c["lora_files"] == 1 and c["read_s"] > 0 and c["lora_s"] > 0, c
    assert sum(c["read_s"] for c in report["components"]) <= report["seconds"]["read"] + 1e-6
    assert sum(c["lora_s"] for c in report["components"]) <= report["seconds"]["lora"] + 1e-6


def test_load_json_fuse_and_save_fused_round_trips_through_diffusers(tiny_wan_dir, tmp_path):
    import diffusers

    lora = write_tiny_lora(tmp_path / "lora.safetensors", build_tiny_model("wan"), seed=3)
    out = tmp_path / "fused"
    proc = run_cli("load", str(tiny_wan_dir), "--component", "transformer", f"--lora={lora}@0.5",
                   "--device", "cpu", "--dtype", "float32", "--save-fused", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["lora_compute_device"] == "cpu" and report["lora_keys_fused"] == 16

    saved = diffusers.WanTransformer3DModel.from_pretrained(out / "transformer")
    original = diffusers.WanTransformer3DModel.from_pretrained(tiny_wan_dir / "transformer")
    from vllm_diffusion_plugin.engine.lora import load_lora

    sd = load_lora(lora).state_dict
    for name, param in original.named_parameters():
        expected = param.detach().double()
        key = f"transformer.{name.removesuffix('.weight')}"
        if name.endswith(".weight") and f"{key}.lora_A.weight" in sd:
            a, b = sd[f"{key}.lora_A.weight"].double(), sd[f"{key}.lora_B.weight"].double()
            expected = expected + 0.5 * (sd[f"{key}.alpha"].item() / a.shape[0]) * (b @ a)
        torch.testing.assert_close(dict(saved.named_parameters())[name].double(), expected,
                                   rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.multiproc
def test_load_two_ranks_hsdp_gathers_what_one_rank_loads(tiny_wan_dir, tmp_path):
    proc = run_cli("load", str(tiny_wan_dir), "--nproc", "2", "--device", "cpu", "--dtype", "float32",
                   "--save-fused", str(tmp_path / "out"), "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["world_size"] == 2 and report["layout"] == {"replicate": 1, "shard": 2}
    for rank in report["ranks"]:
        total = sum(c["param_bytes_total"] for c in report["components"])
        assert rank["param_bytes_local"] < 0.75 * total  # each rank holds about half
    import diffusers

    for name in ("transformer", "transformer_2"):
        saved = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "out" / name).state_dict()
        original = diffusers.WanTransformer3DModel.from_pretrained(tiny_wan_dir / name).state_dict()
        assert saved.keys() == original.keys()
        for key, tensor in original.items():
            assert torch.equal(saved[key], tensor), key


@pytest.mark.parametrize("args, message", [
    (["--nproc", "2", "--hsdp-replicate-size", "3"], "world size 2 is not divisible by HSDP replicate_size 3"),
    (["--nproc", "4", "--hsdp-replicate-size", "2", "--hsdp-shard-size", "3"],
     "replicate_size 2 x shard_size 3 = 6 does not equal the world size 4"),
    (["--component", "vae"], "unknown component"),
    (["--lora", "missing.safetensors"], "LoRA file missing.safetensors does not exist"),
])
def test_bad_input_is_one_clear_line_before_any_rank_starts(tiny_wan_dir, args, message, capsys, monkeypatch):
    from vllm_diffusion_plugin.doors import cli
    from vllm_diffusion_plugin.doors.cli import load as cli_load

    monkeypatch.setattr(cli_load, "rank_main", lambda *a, **k: pytest.fail("a rank started despite bad input"))
    assert cli.main(["load", str(tiny_wan_dir), "--device", "cpu", *args]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm_omni") is not None,
                    reason="vllm-omni is installed here: demo --serve would start a server (tests/serve)")
def test_demo_serve_without_vllm_omni_names_the_extra_to_install():
    proc = run_cli("demo", "--serve", timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "vllm-omni is not installed" in proc.stderr and "install .[omni]" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and not proc.stdout, proc.stderr  # one line, nothing started
