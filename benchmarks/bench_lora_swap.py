"""Changing the fused LoRA set of a loaded Wan2.2: our swap against a restart, diffusers, and the floor, in one run.

The pipeline of ``bench_serve_startup.py``: Wan2.2 at A14B width (dim 5120, ffn 13824), ``--blocks`` blocks per expert,
bf16; two sets of rank-64 LightX2V-named distill LoRAs, one file per expert each (set A: seeds 0/1, set B: 2/3), on
every attention and FFN linear. Each side runs in a fresh process per repeat (page cache warm, alike for all):

- swap: ``vllm-diffusion load DIR --nproc N --hsdp-weight-load rank_local`` with set A, then ``--swap-lora`` B and
  ``--swap-lora`` A: the seconds of each swap as rank 0's report gives them (validation included);
- restart: the same command with set B and no swap, timed from start to exit (what a restart to the new set costs
  this CLI: process, imports, load; a vllm-omni server adds its own start and warm-up on top);
- diffusers: ``WanPipeline.from_pretrained``, set A loaded and fused, then the swap timed: ``unfuse_lora`` +
  ``unload_lora_weights`` + ``load_lora_weights`` (set B) + ``fuse_lora``; and what its unfuse leaves: the elements of
  the experts that differ from the checkpoint after fusing and unfusing set A (its drift);
- floor: one rank's share of the swap's work, with nothing of ours: reading set B's files, ``pread`` of this rank's rows
  (1/N) of every touched tensor, ``W[rows] = bf16(W[rows] + s * B[rows] @ A)`` in fp32 for each target.

With ``--serve`` (the [omni] extra), a real server too: ``vllm serve DIR --omni --load-format diffusion-hsdp`` on 2
ranks (``rank_local``) started with set A and ``lora_update_dirs``, its time to ready (what a restart costs it), then
``POST /v1/diffusion_hsdp/loras`` to set B timed from the client (``serve_swap_s``) beside the workers' own figure.

Goals (medians): swap <= 0.1x restart (the server's with ``--serve``, else the CLI's); swap <= 1.5x the floor (its
ranks work in parallel, one core each).

    python benchmarks/bench_lora_swap.py [--blocks 1] [--nproc 2] [--repeats 3] [--out-dir DIR] [--serve] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from bench_lora_phase import EXPERTS, run_child
from bench_lora_prepare import write_lora
from bench_serve_startup import build


def lora_sets(out: Path, blocks: int) -> tuple[Path, list[Path], list[Path]]:
    pipeline, first = build(out, blocks=blocks)
    second = [write_lora(out / f"lightx2v_rank64_{name}_{blocks}blocks_set_b.safetensors", blocks=blocks, seed=2 + i)
              for i, name in enumerate(("high", "low"))]
    return pipeline, first, second


def _set(loras: list[Path]) -> str:
    return ",".join(f"{name}={path}" for name, path in zip(EXPERTS, loras))


def ours(pipeline: Path, loras: list[Path], *, nproc: int, env: dict, swaps: list[list[Path]]) -> dict:
    cmd = [sys.executable, "-m", "vllm_diffusion_plugin.doors.cli", "load", str(pipeline),
           *(a for name in EXPERTS for a in ("--component", name)), *(f"--lora={n}={p}" for n, p in zip(EXPERTS, loras)),
           "--nproc", str(nproc), "--hsdp-weight-load", "rank_local", "--device", "cpu", "--dtype", "bfloat16",
           "--json", *(f"--swap-lora={_set(s)}" for s in swaps)]
    seconds, out = run_child(cmd, env)
    report = json.loads(out)
    return {"wall_s": seconds, "load_s": report["seconds"].get("total"),
            "swaps": [{"total_s": s["seconds"]["total"], "validate_s": s["seconds"]["validate"],
                       "bytes_read": s["bytes_read"], "modules": s["modules"], "peak_rss_growth": s["peak_rss_growth"],
                       "planned": s["planned_host_bytes"] + s["planned_device_bytes"]}
                      for s in report.get("swaps", [])]}


def diffusers_child(pipeline: Path, first: list[Path], second: list[Path]) -> dict:
    """Runs in the child process: diffusers + PEFT, set A fused, then swapped to set B."""
    import diffusers
    import torch

    pipe = diffusers.WanPipeline.from_pretrained(pipeline, torch_dtype=torch.bfloat16)
    base = {(n, k): v.clone() for n in EXPERTS for k, v in getattr(pipe, n).state_dict().items()}

    def load(loras: list[Path], tag: str) -> None:
        pipe.load_lora_weights(str(loras[0]), adapter_name=f"high_{tag}")
        pipe.load_lora_weights(str(loras[1]), adapter_name=f"low_{tag}", load_into_transformer_2=True)

    load(first, "a")
    pipe.fuse_lora(components=list(EXPERTS), lora_scale=1.0)
    start = time.perf_counter()
    pipe.unfuse_lora(components=list(EXPERTS))
    unfused = time.perf_counter()
    pipe.unload_lora_weights()
    drift = sum(int((getattr(pipe, n).state_dict()[k] != v).sum()) for (n, k), v in base.items())
    resumed = time.perf_counter()
    load(second, "b")
    pipe.fuse_lora(components=list(EXPERTS), lora_scale=1.0)
    return {"swap_s": (unfused - start) + (time.perf_counter() - resumed), "drift_elements": drift,
            "elements": sum(v.numel() for v in base.values())}


LIGHTX2V_NAMES = {f"{a}.{p}": f"{b}.{q}" for a, b in (("self_attn", "attn1"), ("cross_attn", "attn2"))
                  for p, q in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"))}
LIGHTX2V_NAMES |= {"ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2"}


def floor_child(pipeline: Path, second: list[Path], nproc: int) -> dict:
    """Runs in the child process: one rank's share of the swap's work (see the module doc)."""
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(1)  # one core per rank, as the ranks have
    start = time.perf_counter()
    touched, nbytes, read_s = 0, 0, 0.0
    for expert, path in zip(EXPERTS, second):
        lora = load_file(str(path))
        index = json.loads((pipeline / expert / "diffusion_pytorch_model.safetensors.index.json").read_text())
        for down in (k for k in lora if k.endswith(".lora_down.weight")):
            _, block, rest = down.removeprefix("diffusion_model.").removesuffix(".lora_down.weight").split(".", 2)
            key = f"blocks.{block}.{LIGHTX2V_NAMES[rest]}.weight"
            with open(pipeline / expert / index["weight_map"][key], "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                info = json.loads(f.read(header_len))[key]
                rows = -(-info["shape"][0] // nproc)
                w = torch.empty(rows, info["shape"][1], dtype=torch.bfloat16)
                began = time.perf_counter()
                os.preadv(f.fileno(), [w.view(torch.uint8).numpy()], 8 + header_len + info["data_offsets"][0])
                read_s += time.perf_counter() - began
            up = lora[down.replace("lora_down", "lora_up")]
            scale = float(lora[down.replace("lora_down.weight", "alpha")]) / up.shape[1]
            w.copy_((w.float() + scale * (up[:rows].float() @ lora[down].float())).to(torch.bfloat16))
            touched, nbytes = touched + 1, nbytes + w.numel() * 2
    return {"floor_s": time.perf_counter() - start, "read_s": read_s, "tensors": touched, "bytes_read": nbytes}


def serve_swap(pipeline: Path, first: list[Path], second: list[Path], out: Path) -> dict:
    """One real 2-rank server (``rank_local``) started with ``first``: its ready seconds, then its swap to ``second``
    through the update endpoint, timed from the client, with the workers' own report."""
    import urllib.request

    from bench_serve_startup import HSDP2, _cpu

    from vllm_diffusion_plugin.tools import servers as sv

    config = {"hsdp_weight_load": "rank_local", "lora_update_dirs": [str(out)],
              "lora_path": [f"{name}={path}" for name, path in zip(EXPERTS, first)]}
    spec = sv.ServerSpec("lora-swap-rank_local", pipeline, plugin=True, dtype="bfloat16",
                         args=("--init-timeout", "1800", "--stage-init-timeout", "1800", *HSDP2, "--load-format",
                               "diffusion-hsdp", "--additional-config", json.dumps({"diffusion_hsdp": config})))

    def swap(port: int, timeout_s: float, log: Path) -> bytes:
        body = json.dumps({"lora_path": [f"{name}={path}" for name, path in zip(EXPERTS, second)]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/diffusion_hsdp/loras", data=body,
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.read()

    run = sv.serve(spec, out / "logs", request=swap, cpu=_cpu(), ready_timeout_s=1800, request_timeout_s=600,
                   progress=lambda line: print(line, file=sys.stderr, flush=True))
    answer = json.loads(run.answers[0])
    return {"ready_s": run.ready_s, "swap_s": run.request_s[0], "answer": answer}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1, help="blocks per expert at A14B width")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path(tempfile.gettempdir()) / "vllm-diffusion-lora-phase")
    parser.add_argument("--serve", action="store_true", help="a real vllm-omni server too (the [omni] extra)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", choices=("diffusers", "floor"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    pipeline, first, second = lora_sets(args.out_dir, args.blocks)
    if args.child == "diffusers":
        print(json.dumps(diffusers_child(pipeline, first, second)))
        return {}
    if args.child == "floor":
        print(json.dumps(floor_child(pipeline, second, args.nproc)))
        return {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               VLLM_TARGET_DEVICE=os.environ.get("VLLM_TARGET_DEVICE", "cpu"))
    for file in [*pipeline.rglob("*.safetensors"), *first, *second]:  # warm page cache, alike for all
        with open(file, "rb") as f:
            while f.read(64 << 20):
                pass
    child = [sys.executable, str(Path(__file__).resolve()), "--blocks", str(args.blocks), "--nproc", str(args.nproc),
             "--out-dir", str(args.out_dir), "--child"]
    runs: dict[str, list[dict]] = {"swap": [], "restart": [], "diffusers": [], "floor": []}
    for _ in range(args.repeats):  # alternated, so drift on the host hits every side
        runs["swap"].append(ours(pipeline, first, nproc=args.nproc, env=env, swaps=[second, first]))
        runs["restart"].append(ours(pipeline, second, nproc=args.nproc, env=env, swaps=[]))
        runs["diffusers"].append(json.loads(run_child([*child, "diffusers"], env)[1].strip().splitlines()[-1]))
        runs["floor"].append(json.loads(run_child([*child, "floor"], env)[1].strip().splitlines()[-1]))
    med = {"swap_s": statistics.median(s["total_s"] for r in runs["swap"] for s in r["swaps"]),
           "restart_s": statistics.median(r["wall_s"] for r in runs["restart"]),
           "restart_load_s": statistics.median(r["load_s"] for r in runs["restart"]),
           "diffusers_swap_s": statistics.median(r["swap_s"] for r in runs["diffusers"]),
           "floor_s": statistics.median(r["floor_s"] for r in runs["floor"]),
           "floor_read_s": statistics.median(r["read_s"] for r in runs["floor"])}
    swaps = [s for r in runs["swap"] for s in r["swaps"]]
    memory = {"peak_rss_growth_max": max((s["peak_rss_growth"] or 0) for s in swaps),
              "planned": max(s["planned"] for s in swaps), "bytes_read_per_rank0": swaps[0]["bytes_read"]}
    ratios = {"swap_vs_restart": med["swap_s"] / med["restart_s"], "swap_vs_floor": med["swap_s"] / med["floor_s"],
              "diffusers_vs_swap": med["diffusers_swap_s"] / med["swap_s"]}
    served = serve_swap(pipeline, first, second, args.out_dir) if args.serve else None
    if served is not None:
        med |= {"serve_ready_s": served["ready_s"], "serve_swap_s": served["swap_s"]}
        ratios["serve_swap_vs_ready"] = served["swap_s"] / served["ready_s"]
    restart = ("serve_swap_vs_ready", "a real server's swap <= 0.1x its time to ready") if served else (
        "swap_vs_restart", "swap <= 0.1x a restart of the CLI with the new set")
    goals = [{"goal": restart[1], "ratio": round(ratios[restart[0]], 3), "pass": ratios[restart[0]] <= 0.1},
             {"goal": "swap <= 1.5x the floor (touched rows re-read + fused)", "ratio": round(ratios["swap_vs_floor"], 2),
              "pass": ratios["swap_vs_floor"] <= 1.5}]
    dit_bytes = sum(f.stat().st_size for name in EXPERTS for f in (pipeline / name).glob("*.safetensors"))
    report = {"pipeline": str(pipeline), "blocks": args.blocks, "nproc": args.nproc, "dit_bytes": dit_bytes,
              "repeats": args.repeats, "medians": med, "ratios": ratios, "memory": memory, "runs": runs, "goals": goals,
              "diffusers_drift_elements": runs["diffusers"][-1]["drift_elements"],
              "elements": runs["diffusers"][-1]["elements"], "served": served}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{dit_bytes / 1e9:.2f} GB of DiT, {args.nproc} ranks (rank_local), medians of {args.repeats}:")
        for name, value in med.items():
            print(f"  {name:18s} {value:8.2f} s")
        for name, value in ratios.items():
            print(f"  {name:18s} {value:8.3f}x")
        print(f"  swap on rank 0: {memory['bytes_read_per_rank0'] / 1e9:.2f} GB re-read, peak RSS +"
              f"{memory['peak_rss_growth_max'] / 2**20:.0f} MiB (planned {memory['planned'] / 2**20:.0f} MiB)")
        print(f"  diffusers' fuse + unfuse left {report['diffusers_drift_elements']} of {report['elements']} "
              f"elements different from the checkpoint")
        for g in goals:
            print(f"  goal {g['goal']:58s} {g['ratio']}  {'PASS' if g['pass'] else 'FAIL'}")
    return report


if __name__ == "__main__":
    sys.exit(0 if all(g["pass"] for g in main().get("goals", [])) else 1)
