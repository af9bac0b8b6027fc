"""The GPU proof: one command on a fresh host with one CUDA GPU, one JSON report, under 8 minutes.

    python benchmarks/gpu_proof.py [--out proof.json] [--wheels DIR] [--budget-s 450] [--cpu-check]

Steps, each in its own subprocess with its own time limit (a hang or a crash costs that step, not the
report); the limits are cut to what is left of ``--budget-s``:

  env         python, torch, the GPU, which of diffusers / vllm / vllm_omni / peft are importable
  install     only when diffusers is missing: a venv with ``--system-site-packages`` (the image's CUDA torch
              stays), ``pip install --no-index --find-links DIR diffusers`` from ``--wheels DIR``, then this
              script again inside it (a host with no package index: carry the wheels)
  cuda_tests  ``pytest -m cuda tests/test_cuda.py``: the LoRA device rule on real CUDA, seed bugs #3 (NCCL
              DTensors) and #2 (vLLM's own online fp8; skipped where vLLM is not installed)
  floors      ``bench_floors.py``: this host's floors -- host->device pageable / pinned (1 and 4 streams),
              device->host, the device's copy bandwidth, page-cache reads with 1/4/8/16 threads, and our staging
              ring from the page cache to the device -- so every goal below is a ratio to the host it ran on
  bench_load  ``bench_load.py --device cuda --size-gb 2.6 --read-threads 8``: ours (through the staging ring) vs
              the naive pageable safetensors->GPU copy (goal >= 4x) and vs diffusers ``from_pretrained`` (>= 3x)
  lora_device ``bench_lora_device.py``: Wan2.2 A14B-shaped fusion on the GPU vs the HBM floor (goal <= 2x) and
              vs a bare ``addmm_`` loop; CPU-resident weights on the CPU, through the GPU, and as the rule picks
              (goal <= 1.2x the faster)
  e2e_lora    ``bench_lora_phase.py --device cuda --blocks 7``: Wan2.2 at A14B width, both experts (>= 10 GB bf16),
              two rank-64 LightX2V LoRAs: our CLI ``load --device cuda`` vs diffusers (``from_pretrained``,
              ``load_lora_weights``, ``fuse_lora``) on the same GPU, fused weights compared (goal >= 3x sooner)
  omni_serve  the vllm-omni serving proof (``.ci/omni-serve.sh``) when it exists and vllm_omni is importable;
              otherwise skipped, with the reason

``--cpu-check`` runs the same plumbing on the CPU at tiny sizes (the CUDA tests are collected and skip, the
benchmarks run tiny, the JSON is assembled), so the one GPU run cannot fail on a typo. Exit status 0 when
every step ran (or was skipped with a reason) and, on the GPU, every goal passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_LIMITS_S = {"cuda_tests": 90, "floors": 60, "bench_load": 120, "lora_device": 90, "e2e_lora": 210,
                 "omni_serve": 420}
"""Per step; ``omni_serve`` starts 8 servers (~4-5 min on a 2-core CPU host): with the other steps it needs
``--budget-s 900`` or a run of its own (``--steps omni_serve``)."""
OPTIONAL = ("diffusers", "vllm", "vllm_omni", "peft", "pytest", "safetensors")
IN_VENV = "VLLM_DIFFUSION_GPU_PROOF_VENV"


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
           "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count(),
           "modules": {name: importlib.util.find_spec(name) is not None for name in OPTIONAL}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return env


def install_into_venv(wheels: Path, argv: list[str]) -> dict:
    """A venv that sees the system packages, diffusers installed from local wheels, this script re-run there
    (``os.execv``: the report is written by the re-run). Returns why nothing was done otherwise."""
    if os.environ.get(IN_VENV):
        return {"status": "in-venv", "venv": sys.prefix}
    if not wheels.is_dir() or not any(wheels.glob("*.whl")):
        return {"status": "skipped", "reason": f"diffusers missing and no wheels in {wheels}"}
    venv = Path(tempfile.gettempdir()) / "vllm-diffusion-gpu-proof-venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                    "diffusers"], check=True, timeout=180)
    os.environ[IN_VENV] = "1"
    os.execv(str(python), [str(python), str(Path(__file__).resolve()), *argv])
    raise AssertionError("unreachable")


def run_step(name: str, cmd: list[str], *, limit_s: float, env: dict, parse) -> dict:
    """Run ``cmd`` under ``limit_s``; ``parse(stdout) -> dict`` reads its result. Never raises."""
    started = time.perf_counter()
    step = {"command": " ".join(cmd), "limit_s": round(limit_s)}
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired as exc:
        tail = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        step.update(status="timeout", stderr_tail=tail[-2000:])
    else:
        step["returncode"] = done.returncode
        try:
            step["result"] = parse(done.stdout)
            step["status"] = "ran"
        except Exception as exc:  # a crash before the report: keep what it printed
            step.update(status="error", error=f"{type(exc).__name__}: {exc}", stderr_tail=done.stderr[-3000:],
                        stdout_tail=done.stdout[-1000:])
    step["seconds"] = round(time.perf_counter() - started, 1)
    print(f"[gpu_proof] {name}: {step['status']} in {step['seconds']} s", file=sys.stderr, flush=True)
    return step


def junit_outcomes(path: Path) -> dict:
    tests = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, detail = child.tag, (child.get("message") or "")[:500]
        tests[f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"] = (
            {"outcome": outcome, "detail": detail} if detail else {"outcome": outcome})
    counts = {}
    for test in tests.values():
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    return {"counts": counts, "tests": tests}


def omni_command(cpu_check: bool) -> tuple[list[str] | None, str]:
    script = ROOT / ".ci" / "omni-serve.sh"
    if not script.is_file():
        return None, f"{script.relative_to(ROOT)} does not exist in this tree"
    if importlib.util.find_spec("vllm_omni") is None:
        return None, "vllm_omni is not importable here (carry its wheels and vLLM's to run it)"
    if cpu_check:
        return None, "--cpu-check: the serving proof runs only on the GPU"
    return ["bash", str(script)], ""


def goals_of(steps: dict) -> list[dict]:
    goals = []
    load = steps.get("bench_load", {}).get("result")
    if load:
        ratios = load["ratios (medians)"]
        goals += [{"goal": "bench_load: ours >= 3x faster than diffusers (build+load)",
                   "ratio": round(ratios["diffusers_vs_ours_build_and_load_time"], 2),
                   "pass": ratios["diffusers_vs_ours_build_and_load_time"] >= 3.0},
                  {"goal": "bench_load: ours >= 4x the naive pageable safetensors->device copy",
                   "ratio": round(ratios["ours_preallocated_vs_floor_throughput"], 2),
                   "pass": ratios["ours_preallocated_vs_floor_throughput"] >= 4.0}]
        floors = steps.get("floors", {}).get("result") or {}
        ring = floors.get("staging_ring_8_threads_gb_s")
        if ring:  # ours against what this host's own pinned pipeline reaches (bench_floors)
            ours_gb_s = load["timings"]["ours_preallocated"]["gb_per_s_best"]
            goals.append({"goal": "bench_load: ours >= 0.8x the host's staging floor (page cache -> device, 8 threads)",
                          "ratio": round(ours_gb_s / ring, 2), "pass": ours_gb_s >= 0.8 * ring})
    for step in ("lora_device", "e2e_lora"):
        result = steps.get(step, {}).get("result")
        if result:
            goals += [{**g, "goal": f"{step}: {g['goal']}"} for g in result["goals"]]
    tests = steps.get("cuda_tests", {}).get("result")
    if tests:
        bad = tests["counts"].get("failure", 0) + tests["counts"].get("error", 0)
        goals.append({"goal": "cuda_tests: no failures", "ratio": None, "pass": bad == 0})
    return goals


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="local wheels for the venv")
    parser.add_argument("--budget-s", type=float, help="wall-clock budget for all steps (450 s; --cpu-check: 1500 s, "
                        "no per-step limits: a loaded CI host is slow, not hung)")
    parser.add_argument("--cpu-check", action="store_true", help="tiny sizes on the CPU: check the plumbing")
    parser.add_argument("--steps", default="cuda_tests,floors,bench_load,lora_device,e2e_lora,omni_serve")
    parser.add_argument("--plot", type=Path, help="also chart the GPU figures as a PNG (benchmarks/charts.py)")
    args = parser.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 1500.0 if args.cpu_check else 450.0
    started = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    if args.cpu_check:
        env.update(CUDA_VISIBLE_DEVICES="", VLLM_TARGET_DEVICE="cpu")
    report = {"mode": "cpu-check" if args.cpu_check else "gpu", "environment": environment(), "steps": {}}
    if not report["environment"]["modules"]["diffusers"]:
        report["install"] = install_into_venv(args.wheels, argv)
    device = "cpu" if args.cpu_check else "cuda"
    work = Path(tempfile.mkdtemp(prefix="gpu-proof-"))
    py = sys.executable
    plans = {
        "cuda_tests": ([py, "-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={work / 'cuda.xml'}"], lambda out: junit_outcomes(work / "cuda.xml")),
        "floors": ([py, "benchmarks/bench_floors.py", "--device", device, "--json", "--out-dir", str(work),
                    *(["--tiny"] if args.cpu_check else [])], json.loads),
        "bench_load": ([py, "benchmarks/bench_load.py", "--device", device, "--json", "--out-dir", str(work),
                        "--read-threads", "8",
                        *(["--tiny", "--repeats", "1"] if args.cpu_check else ["--size-gb", "2.6", "--repeats", "3"])],
                       json.loads),
        "e2e_lora": ([py, "benchmarks/bench_lora_phase.py", "--device", device, "--json", "--out-dir", str(work),
                      "--repeats", "1", *(["--tiny"] if args.cpu_check else ["--blocks", "7"])], json.loads),
        "lora_device": ([py, "benchmarks/bench_lora_device.py", "--device", device, "--json",
                         *(["--tiny", "--reps", "1"] if args.cpu_check else [])], json.loads),
    }
    for name in args.steps.split(","):
        left = args.budget_s - (time.perf_counter() - started)
        if name == "omni_serve":
            cmd, reason = omni_command(args.cpu_check)
            if cmd is None:
                report["steps"][name] = {"status": "skipped", "reason": reason}
                continue
            plans[name] = (cmd, lambda out: {"stdout_tail": out[-2000:]})
        if left < 10:
            report["steps"][name] = {"status": "skipped", "reason": f"budget of {args.budget_s} s spent"}
            continue
        cmd, parse = plans[name]
        limit = left if args.cpu_check else min(STEP_LIMITS_S[name], left)
        report["steps"][name] = run_step(name, cmd, limit_s=limit, env=env, parse=parse)
    report["goals"] = goals_of(report["steps"])
    report["seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.plot:  # after the report is saved; a --cpu-check report has no GPU figures and draws nothing
        import charts  # benchmarks/charts.py, beside this script

        charts.plot("gpu_proof", report, args.plot)
    complete = all(s["status"] in ("ran", "skipped") for s in report["steps"].values())
    omni = report["steps"].get("omni_serve", {})
    complete = complete and omni.get("returncode", 0) == 0
    if args.cpu_check:  # tiny sizes on a CPU: the goals' ratios mean nothing, the plumbing is what is checked
        return 0 if complete else 1
    return 0 if complete and all(g["pass"] for g in report["goals"]) else 1


if __name__ == "__main__":
    sys.exit(main())
