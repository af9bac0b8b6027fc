"""What each CLI command costs a user before its work, as ratios to a Python process that imports torch (issue 48).

Fresh processes, round-robin, ``--repeats`` times each (medians of wall time, spawn to exit, and of CPU time,
the children's user + system):

- floor:      ``python -c "import torch"`` -- what any command that touches a tensor pays;
- help:       ``vllm-diffusion --help``;
- plan:       ``vllm-diffusion plan DIR --lora A --lora B`` on the tiny Wan2.2 demo pipeline (headers, configs,
              meta skeletons; no weight byte);
- load x1:    ``vllm-diffusion load DIR --device cpu --dtype float32 --lora A --lora B --nproc 1``;
- load x2:    the same with ``--nproc 2`` (two local ranks, HSDP over gloo);
- plan A14B:  with ``--a14b``, ``plan`` of a Wan2.2 A14B-width folder (sparse files, ``plan_real_size.py``'s) at
              8 ranks with its two rank-64 LoRAs.

Goals: help <= 1x floor, plan <= 2x, load x1 <= 3x, load x2 <= 1.3x load x1. The commands run with this
interpreter and its environment: set ``PYTHONPATH`` to another checkout to measure that one in the same way.

    python benchmarks/bench_cli_startup.py [--repeats 3] [--out-dir /tmp/vllm-diffusion-startup] [--a14b] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_startup import ensure_demo  # noqa: E402

CLI = [sys.executable, "-m", "vllm_diffusion_plugin.doors.cli"]
GOALS = {"help": ("floor", 1.0), "plan": ("floor", 2.0), "load x1": ("floor", 3.0), "load x2": ("load x1", 1.3)}


def run(cmd: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds (user + system of the process and its children) of a fresh process."""
    env = dict(os.environ, VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"))
    env.pop("VLLM_DIFFUSION_PLUGIN", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def commands(out_dir: Path, a14b: bool) -> dict[str, list[str]]:
    checkpoint, loras = ensure_demo(out_dir)
    lora_flags = [f"--lora={p}" for p in loras]
    load = [*CLI, "load", str(checkpoint), "--device", "cpu", "--dtype", "float32", *lora_flags]
    cmds = {"floor": [sys.executable, "-c", "import torch"], "help": [*CLI, "--help"],
            "plan": [*CLI, "plan", str(checkpoint), *lora_flags],
            "load x1": [*load, "--nproc", "1"], "load x2": [*load, "--nproc", "2"]}
    if a14b:
        from plan_real_size import write_pipeline

        manifest = write_pipeline(out_dir / "a14b")
        cmds["plan A14B"] = [*CLI, "plan", manifest["pipeline"], "--nproc", "8", "--hsdp-shard-size", "8",
                             "--device", "cpu", *(f"--lora={p}" for p in manifest["loras"])]
    return cmds


def measure(cmds: dict[str, list[str]], repeats: int) -> dict:
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in cmds}
    for _ in range(repeats):
        for name, cmd in cmds.items():  # round-robin: load from other processes hits every command alike
            runs[name].append(run(cmd))
    wall = {name: statistics.median(w for w, _ in r) for name, r in runs.items()}
    cpu = {name: statistics.median(c for _, c in r) for name, r in runs.items()}
    goals = [{"command": name, "ratio": round(wall[name] / wall[base], 2), "of": base, "goal": bound,
              "pass": wall[name] / wall[base] <= bound} for name, (base, bound) in GOALS.items()]
    return {"repeats": repeats, "unit": "seconds, medians (wall: spawn to exit; cpu: user + system)",
            "wall": wall, "cpu": cpu, "runs": runs, "goals": goals}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/vllm-diffusion-startup"))
    parser.add_argument("--a14b", action="store_true", help="also plan the A14B-width folder at 8 ranks")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    result = measure(commands(args.out_dir, args.a14b), args.repeats)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    floor = result["wall"]["floor"]
    print(f"fresh processes, medians of {args.repeats} (PYTHONPATH={os.environ.get('PYTHONPATH', '')!r}):")
    print(f"  {'command':<11}{'wall s':>8}{'cpu s':>8}{'x floor':>9}")
    for name, seconds in result["wall"].items():
        print(f"  {name:<11}{seconds:8.2f}{result['cpu'][name]:8.2f}{seconds / floor:9.2f}")
    for goal in result["goals"]:
        print(f"  [{'PASS' if goal['pass'] else 'FAIL'}] {goal['command']}: {goal['ratio']}x {goal['of']} "
              f"(goal <= {goal['goal']}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
