"""Startup of a diffusers-only CLI load, per phase, against diffusers itself, as ratios measured in one run.

The tiny Wan2.2 demo pipeline (two ``WanTransformer3DModel`` components, several shards each, one LoRA per
transformer; written once into ``--out-dir`` by ``write_tiny_pipeline`` / ``write_tiny_lora``) is loaded in
fresh processes, round-robin, ``--repeats`` times each (medians):

- ours:        ``vllm-diffusion load DIR --device cpu --dtype float32 --lora ... --lora ... --json``; the report's
               ``seconds`` name every phase (``startup``, ``imports``, ``validate``, the ranks' ``resolve``,
               ``lora``, ``build``, ``read``, ``postprocess``, ``shard``; ``wall``: process start to the report);
- diffusers:   ``WanTransformer3DModel.from_pretrained`` of both transformers (no LoRA), timed from process start;
- import floor: a process that only imports diffusers and ``WanTransformer3DModel`` (what any diffusers load
               pays before it reads a byte: torch, diffusers and what diffusers imports -- peft, transformers,
               flashinfer where installed).

Goal (issue #15): ours spends < 0.5 s outside reading, fusing and importing diffusers, from its own report:
``wall - imports - read - lora`` (``wall``: process start to the report; ``imports``: torch, diffusers and the
classes the checkpoint names, which the import floor shows any diffusers load pays; ``lora`` includes checking
the LoRA files against meta skeletons before any read). Also printed: ours outside reading and fusing with the
imports, ours vs diffusers and vs the import floor (spawn to exit, interpreter teardown included: ~1.5-2.5 s
after diffusers' imports on a 2-core host, for all three alike).

    python benchmarks/bench_startup.py [--repeats 5] [--out-dir /tmp/vllm-diffusion-startup] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

GOAL_S = 0.5

IMPORT_FLOOR = """
import diffusers
diffusers.WanTransformer3DModel
"""

DIFFUSERS = """
import sys, torch, diffusers
for name in ("transformer", "transformer_2"):
    diffusers.WanTransformer3DModel.from_pretrained(sys.argv[1], subfolder=name, torch_dtype=torch.float32)
"""


def ensure_demo(out_dir: Path) -> tuple[Path, list[Path]]:
    """The demo pipeline and its two LoRA files (written on first use)."""
    checkpoint = out_dir / "Wan2.2-tiny"
    loras = [out_dir / f"lora_{name}.safetensors" for name in ("transformer", "transformer_2")]
    if not (checkpoint / "model_index.json").is_file() or not all(p.is_file() for p in loras):
        from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora, write_tiny_pipeline

        write_tiny_pipeline(checkpoint, "wan")
        for seed, path in enumerate(loras):
            write_tiny_lora(path, build_tiny_model("wan", seed=seed), seed=seed)
    return checkpoint, loras


def run(cmd: list[str]) -> tuple[float, str]:
    """Wall seconds of a fresh process (spawn to exit) and its stdout."""
    env = dict(os.environ, VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"))
    env.pop("VLLM_DIFFUSION_PLUGIN", None)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, done.stdout


def measure(checkpoint: Path, loras: list[Path], repeats: int) -> dict:
    ours_cmd = [sys.executable, "-m", "vllm_diffusion_plugin.doors.cli", "load", str(checkpoint), "--device", "cpu",
                "--dtype", "float32", *(f"--lora={p}" for p in loras), "--json"]
    variants = {"import floor": [sys.executable, "-c", IMPORT_FLOOR],
                "diffusers": [sys.executable, "-c", DIFFUSERS, str(checkpoint)],
                "ours": ours_cmd}
    walls: dict[str, list[float]] = {name: [] for name in variants}
    phases: list[dict[str, float]] = []
    for _ in range(repeats):
        for name, cmd in variants.items():  # round-robin: load from other processes hits every variant alike
            wall, out = run(cmd)
            walls[name].append(wall)
            if name == "ours":
                phases.append(json.loads(out)["seconds"])
    med = {name: statistics.median(ts) for name, ts in walls.items()}
    keys = dict.fromkeys(k for p in phases for k in p)
    ours_phases = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in keys}
    outside = statistics.median(p["wall"] - p.get("read", 0.0) - p.get("lora", 0.0) for p in phases)
    own = statistics.median(p["wall"] - p["imports"] - p.get("read", 0.0) - p.get("lora", 0.0) for p in phases)
    return {
        "repeats": repeats, "unit": "seconds (medians; wall: process spawn to exit)",
        "wall": med, "runs": walls, "ours_phases": ours_phases,
        "ours_outside_read_and_fuse": outside,
        "ours_outside_read_fuse_and_imports": own,
        "ratios": {"ours vs diffusers wall": med["ours"] / med["diffusers"],
                   "ours vs import floor wall": med["ours"] / med["import floor"]},
        "goals": [{"goal": f"outside reading, fusing and importing diffusers < {GOAL_S} s",
                   "seconds": round(own, 3), "pass": own < GOAL_S}],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/vllm-diffusion-startup"))
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    checkpoint, loras = ensure_demo(args.out_dir)
    result = measure(checkpoint, loras, args.repeats)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"tiny Wan2.2 demo pipeline, fresh processes, median of {args.repeats}:")
        for name, seconds in result["wall"].items():
            print(f"  {name:<14}{seconds:8.3f} s wall")
        print("  ours per phase: " + ", ".join(f"{k} {v:.3f}" for k, v in result["ours_phases"].items()))
        print(f"  ours outside reading and fusing (report wall): {result['ours_outside_read_and_fuse']:.3f} s, "
              f"of which not importing diffusers: {result['ours_outside_read_fuse_and_imports']:.3f} s")
        for name, value in result["ratios"].items():
            print(f"  {name}: {value:.2f}")
        for goal in result["goals"]:
            print(f"  [{'PASS' if goal['pass'] else 'FAIL'}] {goal['goal']}: {goal['seconds']} s")
    return 0 if all(g["pass"] for g in result["goals"]) else 1


if __name__ == "__main__":
    sys.exit(main())
