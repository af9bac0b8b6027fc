"""Wan2.2 with two distill LoRAs from files to fused weights: our CLI against diffusers + PEFT, as ratios in one run.

The pipeline of ``bench_serve_startup.py``: Wan2.2 at A14B width (dim 5120, ffn 13824) with ``--blocks`` blocks in
each expert (``transformer``, ``transformer_2``), bf16, one rank-64 LightX2V distill LoRA per expert, tiny text
encoder and VAE (``--tiny``: the project's tiny Wan2.2 and diffusers-format LoRAs, to check the plumbing). Each
side runs in a fresh process per repeat (imports, page cache warm, alike for both), timed from start to exit:

- ours: ``vllm-diffusion load DIR --component transformer --component transformer_2 --lora transformer=HIGH
  --lora transformer_2=LOW --device D --dtype bfloat16 --json`` (its report's phases beside the wall time);
- diffusers: ``WanPipeline.from_pretrained(DIR, torch_dtype=bfloat16)``, ``.to(D)``, ``load_lora_weights`` of each
  file (the second ``load_into_transformer_2=True``), ``fuse_lora`` of both experts, ``unload_lora_weights``
  (PEFT underneath), each step timed in the child.

The last repeat of each also saves the fused experts (ours ``--save-fused``, diffusers ``save_pretrained``; the
saving's seconds are taken off its wall time) and every tensor is compared: elements equal, and the largest
difference in bf16 units in the last place of the largest
operand (PEFT adds a delta already rounded to bf16; ours rounds once).

Goals (ratios of medians): on an accelerator, ours ready >= 3x sooner than diffusers; on the CPU, our whole
``lora`` phase no longer than diffusers' ``load_lora_weights`` + ``fuse_lora``; the fused weights within 2 bf16
ulps everywhere.

    python benchmarks/bench_lora_phase.py [--device cpu|cuda] [--blocks 1] [--repeats 3] [--out-dir DIR]
        [--tiny] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

EXPERTS = ("transformer", "transformer_2")


def build(out: Path, *, blocks: int, tiny: bool) -> tuple[Path, list[Path]]:
    """The pipeline folder and one LoRA file per expert."""
    if not tiny:
        from bench_serve_startup import build as build_a14b_width

        return build_a14b_width(out, blocks=blocks)
    from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora, write_tiny_pipeline

    pipeline = out / "tiny-wan22"
    if not (pipeline / "model_index.json").exists():
        write_tiny_pipeline(pipeline, "wan", runnable=True)
    import torch
    from safetensors.torch import load_file, save_file

    loras = []
    for i, name in enumerate(EXPERTS):  # alpha=None: diffusers' Wan loader takes only lora_A / lora_B keys
        path = write_tiny_lora(out / f"lora_{name}.safetensors", build_tiny_model("wan", seed=i), seed=i, alpha=None)
        # bf16 factors, as distill LoRAs ship: diffusers would round fp32 factors to the model's dtype first
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, path)
        loras.append(path)
    return pipeline, loras


def run_child(cmd: list[str], env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {done.returncode}:\n{done.stderr[-3000:]}")
    return seconds, done.stdout


def ours(pipeline: Path, loras: list[Path], device: str, env: dict, save: Path | None = None) -> dict:
    cmd = [sys.executable, "-m", "vllm_diffusion_plugin.doors.cli", "load", str(pipeline),
           *(a for name in EXPERTS for a in ("--component", name)),
           *(f"--lora={name}={path}" for name, path in zip(EXPERTS, loras)),
           "--device", device, "--dtype", "bfloat16", "--json", *(["--save-fused", str(save)] if save else [])]
    seconds, out = run_child(cmd, env)
    report = json.loads(out)
    phases = report.get("seconds") or report.get("ranks", [{}])[0].get("seconds", {})
    return {"wall_s": seconds - phases.get("save", 0.0), "lora_s": phases.get("lora"), "phases": phases,
            "lora_rule": report.get("lora_host_rule"), "lora_device": report.get("lora_compute_device")}


def diffusers_child(pipeline: Path, loras: list[Path], device: str, save: Path | None) -> dict:
    """Runs in the child process: diffusers + PEFT from files to fused weights on ``device``."""
    import torch

    def timed(fn):
        start = time.perf_counter()
        fn()
        if device != "cpu":
            getattr(torch, torch.device(device).type).synchronize()
        return time.perf_counter() - start

    import diffusers

    holder = {}
    out = {"from_pretrained_s": timed(lambda: holder.setdefault(
        "pipe", diffusers.WanPipeline.from_pretrained(pipeline, torch_dtype=torch.bfloat16)))}
    pipe = holder["pipe"]
    out["to_device_s"] = timed(lambda: pipe.to(device))
    out["load_lora_weights_s"] = timed(lambda: (pipe.load_lora_weights(str(loras[0]), adapter_name="high"),
                                                pipe.load_lora_weights(str(loras[1]), adapter_name="low",
                                                                       load_into_transformer_2=True)))
    out["fuse_lora_s"] = timed(lambda: pipe.fuse_lora(components=list(EXPERTS), lora_scale=1.0))
    out["unload_lora_weights_s"] = timed(pipe.unload_lora_weights)
    if save is not None:
        out["save_s"] = timed(lambda: [getattr(pipe, name).save_pretrained(save / name) for name in EXPERTS])
    return out


def diffusers(pipeline: Path, loras: list[Path], device: str, env: dict, save: Path | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(pipeline), *map(str, loras),
           "--device", device, *(["--save", str(save)] if save else [])]
    seconds, out = run_child(cmd, env)
    phases = json.loads(out.strip().splitlines()[-1])
    return {"wall_s": seconds - phases.get("save_s", 0.0),
            "lora_s": phases["load_lora_weights_s"] + phases["fuse_lora_s"], "phases": phases}


def compare(ours_dir: Path, theirs_dir: Path, pipeline: Path) -> dict:
    """Every tensor of both experts: elements equal, and the largest difference in bf16 ulps of the largest operand
    (the base weight or either result: where ``W + delta`` cancels, an ulp of the result says nothing)."""
    import torch
    from safetensors import safe_open

    def tensors(folder: Path) -> dict:
        out = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
        return out

    elements = equal = 0
    worst = 0.0
    for name in EXPERTS:
        a, b, base = tensors(ours_dir / name), tensors(theirs_dir / name), tensors(pipeline / name)
        if a.keys() != b.keys():
            raise RuntimeError(f"{name}: keys differ: {sorted(a.keys() ^ b.keys())[:5]}")
        for key in a:
            x, y = a[key].double(), b[key].double()
            elements += x.numel()
            equal += int((x == y).sum())
            largest = torch.maximum(torch.maximum(x.abs(), y.abs()), base[key].double().abs())
            ulp = torch.finfo(torch.bfloat16).eps * largest.clamp_min(1e-30)
            worst = max(worst, float(((x - y).abs() / ulp).max()))
    return {"elements": elements, "equal_fraction": equal / elements, "max_diff_bf16_ulps": worst}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--blocks", type=int, default=1, help="blocks per expert at A14B width")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path(tempfile.gettempdir()) / "vllm-diffusion-lora-phase")
    parser.add_argument("--tiny", action="store_true", help="the tiny Wan2.2 and LoRAs: check the plumbing")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=3, metavar=("PIPELINE", "LORA_HIGH", "LORA_LOW"), help=argparse.SUPPRESS)
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(diffusers_child(Path(args.child[0]), [Path(p) for p in args.child[1:]], args.device,
                                         args.save)))
        return {}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    pipeline, loras = build(args.out_dir, blocks=args.blocks, tiny=args.tiny)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"))
    for file in [*pipeline.rglob("*.safetensors"), *loras]:  # warm page cache, alike for both
        with open(file, "rb") as f:
            while f.read(64 << 20):
                pass
    runs: dict[str, list[dict]] = {"ours": [], "diffusers": []}
    saved = args.out_dir / "fused"
    shutil.rmtree(saved, ignore_errors=True)
    for repeat in range(args.repeats):  # alternated, so drift on the host hits both; the last one saves
        last = repeat == args.repeats - 1
        runs["ours"].append(ours(pipeline, loras, args.device, env, save=saved / "ours" if last else None))
        runs["diffusers"].append(diffusers(pipeline, loras, args.device, env,
                                           save=saved / "diffusers" if last else None))
    weights = compare(saved / "ours", saved / "diffusers", pipeline)
    shutil.rmtree(saved, ignore_errors=True)

    med = {side: {k: statistics.median(r[k] for r in rows) for k in ("wall_s", "lora_s")}
           for side, rows in runs.items()}
    ratios = {"diffusers_vs_ours_ready": med["diffusers"]["wall_s"] / med["ours"]["wall_s"],
              "ours_vs_diffusers_lora_phase": med["ours"]["lora_s"] / med["diffusers"]["lora_s"]}
    goals = [{"goal": "fused weights within 2 bf16 ulps of diffusers + PEFT's (one rounding each, PEFT's delta one "
                      "more)",
              "ratio": round(weights["max_diff_bf16_ulps"], 2), "pass": weights["max_diff_bf16_ulps"] <= 2.0}]
    if args.device == "cpu":
        goals.append({"goal": "CPU: our lora phase <= diffusers' load_lora_weights + fuse_lora",
                      "ratio": round(ratios["ours_vs_diffusers_lora_phase"], 2),
                      "pass": ratios["ours_vs_diffusers_lora_phase"] <= 1.0})
    else:
        goals.append({"goal": "ours ready >= 3x sooner than diffusers + PEFT",
                      "ratio": round(ratios["diffusers_vs_ours_ready"], 2),
                      "pass": ratios["diffusers_vs_ours_ready"] >= 3.0})
    dit_bytes = sum(f.stat().st_size for name in EXPERTS for f in (pipeline / name).glob("*.safetensors"))
    report = {"device": args.device, "pipeline": str(pipeline), "blocks": args.blocks, "tiny": args.tiny,
              "dit_bytes": dit_bytes, "repeats": args.repeats, "medians": med, "runs": runs, "ratios": ratios,
              "weights": weights, "goals": goals}
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(f"{dit_bytes / 1e9:.2f} GB of DiT on {args.device}, medians of {args.repeats}:")
        for side, m in med.items():
            print(f"  {side:10s} ready {m['wall_s']:7.2f} s   lora phase {m['lora_s']:7.2f} s")
        for name, value in ratios.items():
            print(f"  {name:34s} {value:6.2f}x")
        print(f"  weights: {weights}")
        for g in goals:
            print(f"  goal {g['goal']:60s} {g['ratio']}  {'PASS' if g['pass'] else 'FAIL'}")
    return report


if __name__ == "__main__":
    sys.exit(0 if all(g["pass"] for g in main().get("goals", [])) else 1)
