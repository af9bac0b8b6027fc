"""The ``hsdp_weight_load`` strategies side by side: full / broadcast / rank_local on N local gloo ranks.

The checkpoint is ``bench_load.py``'s: a real ``WanTransformer3DModel`` at Wan2.2-A14B width (5120 hidden,
13824 FFN), bf16, with as many blocks as ``--size-gb`` needs, saved in ~0.6 GB safetensors shards with an
index (generated once, cached in ``--out-dir``). The page cache is warmed first, so every strategy reads from
memory and the comparison is about bytes and copies, not about the disk.

Each strategy runs as users run it: ``vllm-diffusion load DIR --nproc N --hsdp-weight-load S --json`` (N
spawned ranks, HSDP over (1, N), the DiT ending sharded), ``--repeats`` times. Reported per strategy: wall
seconds of the command, each rank's load seconds (per phase), checkpoint bytes read per rank (counted by the
readers) and peak RSS per rank (``ru_maxrss`` of the rank process, imports included).

Goals (S = N): rank_local bytes per rank <= 1.1 x total / S; rank_local peak RSS per rank <= 0.6 x full's;
broadcast: ranks other than 0 read 0 bytes.

    python benchmarks/bench_distributed_load.py [--size-gb 2] [--nproc 2] [--repeats 1]
                                                [--out-dir /tmp/vllm-diffusion-bench] [--json]
                                                [--storage warm,cold,throttled,latency|all] [--plot PNG]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import charts  # noqa: E402
from bench_load import ensure_checkpoint, warm_page_cache  # noqa: E402  (the shared, cached checkpoint)

STRATEGIES = ("full", "broadcast", "rank_local")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_strategy(folder: Path, strategy: str, nproc: int) -> dict:
    """One ``vllm-diffusion load`` run; returns its merged JSON report plus the command's wall seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION")}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "vllm_diffusion_plugin.doors.cli", "load", str(folder), "--nproc", str(nproc),
           "--device", "cpu", "--dtype", "bfloat16", "--hsdp-weight-load", strategy, "--json"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    report = json.loads(proc.stdout)
    report["wall_s"] = wall
    return report


def summarize(runs: list[dict]) -> dict:
    """Median over repeats of wall time, per-rank load time / phases / bytes / peak RSS."""
    ranks = sorted(r["rank"] for r in runs[0]["ranks"])

    def med(values):
        return statistics.median(values)

    per_rank = []
    for rank in ranks:
        entries = [next(x for x in run["ranks"] if x["rank"] == rank) for run in runs]
        phases = sorted({p for e in entries for p in e["seconds"]})
        per_rank.append({"rank": rank,
                         "load_s": med([e["seconds"]["total"] for e in entries]),
                         "phases_s": {p: round(med([e["seconds"].get(p, 0.0) for e in entries]), 3) for p in phases},
                         "bytes_read": med([e["bytes_read"] for e in entries]),
                         "peak_rss_bytes": med([e["peak_rss_bytes"] for e in entries]),
                         "param_bytes_local": entries[0]["param_bytes_local"]})
    return {"strategy": runs[0]["strategy"], "wall_s": med([r["wall_s"] for r in runs]), "ranks": per_rank,
            "wall_runs_s": [round(r["wall_s"], 2) for r in runs]}


def checked_run(folder: Path, strategy: str, nproc: int) -> dict:
    report = run_strategy(folder, strategy, nproc)
    if report["strategy"] != strategy:
        raise RuntimeError(f"asked for {strategy}, the load reports {report['strategy']}")
    return report


def judge(results: dict, total: int, s: int) -> tuple[dict, dict]:
    """Ratios and goals of the three strategies' summaries (``summarize``) at ``s`` ranks."""
    full, bcast, local = results["full"], results["broadcast"], results["rank_local"]
    max_rss = {name: max(r["peak_rss_bytes"] for r in res["ranks"]) for name, res in results.items()}
    ratios = {
        "rank_local_max_bytes_per_rank_vs_total_over_S": max(r["bytes_read"] for r in local["ranks"]) / (total / s),
        "rank_local_vs_full_peak_rss_max_rank": max_rss["rank_local"] / max_rss["full"],
        "broadcast_vs_full_peak_rss_max_rank": max_rss["broadcast"] / max_rss["full"],
        "broadcast_vs_full_wall_time": bcast["wall_s"] / full["wall_s"],
        "rank_local_vs_full_wall_time": local["wall_s"] / full["wall_s"],
        "broadcast_vs_full_load_time_max_rank": (max(r["load_s"] for r in bcast["ranks"])
                                                 / max(r["load_s"] for r in full["ranks"])),
        "rank_local_vs_full_load_time_max_rank": (max(r["load_s"] for r in local["ranks"])
                                                  / max(r["load_s"] for r in full["ranks"])),
    }
    goals = {
        "rank_local bytes per rank <= 1.1 x total/S": ratios["rank_local_max_bytes_per_rank_vs_total_over_S"] <= 1.1,
        "rank_local peak RSS per rank <= 0.6 x full's": ratios["rank_local_vs_full_peak_rss_max_rank"] <= 0.6,
        "broadcast: ranks != 0 read 0 bytes": all(r["bytes_read"] == 0 for r in bcast["ranks"] if r["rank"] != 0),
    }
    return ratios, goals


def per_storage(args, folder: Path, total: int) -> dict:
    """``--storage``: the three strategies per storage kind (``benchmarks/storage.py``), ratios within a kind."""
    from storage import Unavailable, open_storage, parse_kinds

    out: dict[str, dict] = {}
    for kind in parse_kinds(args.storage):
        try:
            with open_storage(kind, folder, workdir=args.out_dir, bandwidth_mbps=args.bandwidth_mbps,
                              latency_ms=args.latency_ms) as st:
                _log(f"storage {kind}: {st.note or st.path}")
                results = {}
                for strategy in STRATEGIES:
                    runs = []
                    for _ in range(args.repeats):
                        st.prepare()
                        runs.append(checked_run(st.path, strategy, args.nproc))
                    results[strategy] = summarize(runs)
                ratios, goals = judge(results, total, args.nproc)
                out[kind] = {"note": st.note, "strategies": results, "ratios": ratios, "goals": goals}
        except Unavailable as err:
            _log(f"storage {kind}: could not make it here: {err}")
            out[kind] = {"unavailable": str(err)}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/vllm-diffusion-bench"))
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--storage", help="warm,cold,throttled,latency (comma list) or all (benchmarks/storage.py): "
                        "the strategies per storage kind, one JSON report")
    parser.add_argument("--bandwidth-mbps", type=float, default=200.0, help="'throttled' read cap (MB/s)")
    parser.add_argument("--latency-ms", type=float, default=4.0, help="'latency' delay per read request")
    charts.add_plot_option(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_component

    folder = ensure_checkpoint(args.out_dir, args.size_gb)
    source = resolve_component(folder)
    total = source.total_bytes
    _log(f"checkpoint: {folder} ({len(source.files)} shards, {total / 1e9:.2f} GB); {args.nproc} ranks, gloo")
    if args.storage:
        report = {"checkpoint": str(folder), "bytes": total, "nproc": args.nproc, "repeats": args.repeats,
                  "storage": per_storage(args, folder, total)}
    else:
        warm_page_cache(source.files)
        results = {}
        for strategy in STRATEGIES:
            runs = []
            for i in range(args.repeats):
                _log(f"  {strategy} run {i + 1}/{args.repeats} ...")
                runs.append(checked_run(folder, strategy, args.nproc))
            results[strategy] = summarize(runs)
        ratios, goals = judge(results, total, args.nproc)
        report = {"checkpoint": str(folder), "bytes": total, "shards": len(source.files), "nproc": args.nproc,
                  "repeats": args.repeats, "strategies": results, "ratios": ratios, "goals": goals}
    print(json.dumps(report, indent=2) if args.json or args.storage else table(report))
    if args.plot:
        charts.plot("distributed_load", report, args.plot)
    return report


def table(report: dict) -> str:
    lines = [f"{report['bytes'] / 1e9:.2f} GB checkpoint, {report['shards']} shards, {report['nproc']} ranks on "
             f"CPU/gloo, median of {report['repeats']} run(s)",
             f"  {'strategy':<11}{'wall s':>8}{'load s/rank':>18}{'GB read/rank':>22}{'peak RSS GB/rank':>22}"]
    for name, res in report["strategies"].items():
        load = " / ".join(f"{r['load_s']:.1f}" for r in res["ranks"])
        read = " / ".join(f"{r['bytes_read'] / 1e9:.2f}" for r in res["ranks"])
        rss = " / ".join(f"{r['peak_rss_bytes'] / 1e9:.2f}" for r in res["ranks"])
        lines.append(f"  {name:<11}{res['wall_s']:>8.1f}{load:>18}{read:>22}{rss:>22}")
    lines += [f"  {name} phases (rank 0): {res['ranks'][0]['phases_s']}" for name, res in report["strategies"].items()]
    lines += [f"  {name:48s} {value:6.2f}" for name, value in report["ratios"].items()]
    lines += [f"  goal {name:48s} {'PASS' if ok else 'FAIL'}" for name, ok in report["goals"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
