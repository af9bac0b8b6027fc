"""``benchmarks/gpu_proof.py --cpu-check``: the GPU proof's plumbing end to end on the CPU, so that the one
run on a GPU host (minutes, lent rarely) cannot fail on a typo. Every step must run and report: the CUDA
tests are collected and skip, the floors and the benchmarks run at tiny sizes, the JSON report is assembled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1800)
def test_gpu_proof_cpu_check_runs_every_step_and_assembles_the_report(tmp_path):
    out = tmp_path / "proof.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_proof.py"), "--cpu-check",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=1700)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-4000:]
    report = json.loads(out.read_text())
    assert json.loads(done.stdout) == report  # one JSON object on stdout, the same as --out
    assert report["mode"] == "cpu-check" and report["environment"]["cuda_available"] is False
    steps = report["steps"]
    assert set(steps) == {"cuda_tests", "floors", "bench_load", "lora_device", "e2e_lora", "omni_serve"}
    # the CUDA tests were collected (none missing, none erroring at import) and skipped for want of a GPU
    tests = steps["cuda_tests"]["result"]
    assert steps["cuda_tests"]["status"] == "ran" and tests["counts"] == {"skipped": len(tests["tests"])}
    assert len(tests["tests"]) >= 6
    assert all("CUDA" in t["detail"] for t in tests["tests"].values())
    load = steps["bench_load"]["result"]
    assert load["device"] == "cpu" and load["bytes"] > 0
    assert {"ours_build_and_load", "diffusers_from_pretrained", "floor"} <= set(load["timings"])
    lora = steps["lora_device"]["result"]
    assert lora["tiny"] and lora["device_s"] > 0 and lora["hbm_floor_s"] > 0 and lora["raw_addmm_s"] > 0
    floors = steps["floors"]["result"]
    assert {f"page_cache_read_{n}_threads_gb_s" for n in (1, 4, 8, 16)} <= set(floors) and floors["device_rows"]
    e2e = steps["e2e_lora"]["result"]
    assert e2e["tiny"] and e2e["weights"]["elements"] > 0 and e2e["medians"]["ours"]["wall_s"] > 0
    assert steps["omni_serve"]["status"] == "skipped" and steps["omni_serve"]["reason"]
    assert {g["goal"].split(":")[0] for g in report["goals"]} == {"bench_load", "lora_device", "e2e_lora",
                                                                   "cuda_tests"}
