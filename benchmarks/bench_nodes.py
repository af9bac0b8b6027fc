"""Two nodes simulated on one host: ``vllm-diffusion load`` under ``torchrun --nnodes 2`` over 127.0.0.1, each node
in its own mount namespace where the checkpoint path is a bind mount of that node's own copy on its own ext4 loop
device (separate page caches, as separate machines have), each node's processes in its own read-capped cgroup
(``--bandwidth-mbps``, ``benchmarks/storage.py``). Per strategy (full / broadcast / rank_local) and layout: load
time (the slowest rank's, with its seconds per phase) and bytes read per node (the CLI's ``--json`` bytes per
rank, summed over the node's ranks).

Layouts (world = 2 x nproc-per-node; torchrun numbers node n's ranks n*P .. n*P+P-1, the mesh is (replicate,
shard) row-major, so the shard dim is the inner one):
  2x1        --hsdp-shard-size 2                          the shard dim spans the nodes
  2x2-S4     --hsdp-replicate-size 1 --hsdp-shard-size 4  the shard dim spans the nodes (each node 1/2)
  2x2-R2S2   --hsdp-replicate-size 2 --hsdp-shard-size 2  the replicate dim spans the nodes (each node a replica)

Goals (from issue 28): rank_local reads <= 0.55x the DiT bytes per node and loads >= 1.8x faster than full;
broadcast in between. Needs root, losetup, mkfs.ext4, unshare and a cgroup io/blkio controller (see README).

    python benchmarks/bench_nodes.py [--size-gb 1] [--layouts 2x1,2x2-S4,2x2-R2S2] [--bandwidth-mbps 200]
                                     [--repeats 1] [--json] [--plot PNG]

On two real machines, without namespaces or caps, run on each node (NODE = 0 or 1, HEAD = node 0's address):

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank NODE --master-addr HEAD --master-port 29511 \\
        -m vllm_diffusion_plugin.doors.cli load /path/to/transformer --hsdp-weight-load rank_local --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import ensure_checkpoint  # noqa: E402  (the shared, cached checkpoint)
import charts  # noqa: E402
from storage import capped_cgroup, loop_copy  # noqa: E402

from vllm_diffusion_plugin.tools.pagecache import evict, files_under  # noqa: E402

STRATEGIES = ("full", "broadcast", "rank_local")
LAYOUTS = {"2x1": (1, ["--hsdp-shard-size", "2"]),
           "2x2-S4": (2, ["--hsdp-replicate-size", "1", "--hsdp-shard-size", "4"]),
           "2x2-R2S2": (2, ["--hsdp-replicate-size", "2", "--hsdp-shard-size", "2"])}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def node_command(*, node: int, nproc: int, port: int, target: Path, copy: Path, cgroup: Path, log_dir: Path,
                 strategy: str, layout_args: list[str]) -> list[str]:
    """One node: join its cgroup, enter a private mount namespace, bind its copy at ``target``, run torchrun."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
                "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--redirects", "3", "--log-dir", str(log_dir),
                "-m", "vllm_diffusion_plugin.doors.cli", "load", str(target), "--device", "cpu", "--dtype",
                "bfloat16", "--hsdp-weight-load", strategy, *layout_args, "--json"]
    inner = (f"echo $$ > {shlex.quote(str(cgroup / 'cgroup.procs'))} && mount --bind {shlex.quote(str(copy))} "
             f"{shlex.quote(str(target))} && exec {shlex.join(torchrun)}")
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner]


def rank0_report(log_dir: Path) -> dict:
    """The JSON report rank 0 (node 0, local rank 0) printed, from torchrun's per-rank stdout log."""
    logs = sorted(log_dir.glob("**/attempt_*/0/stdout.log"))
    if not logs:
        raise RuntimeError(f"no rank-0 stdout under {log_dir}")
    text = logs[-1].read_text()
    return json.loads(text[text.index("\n{") + 1 if not text.startswith("{") else 0:])


def run_once(*, copies: list[tuple[Path, Path]], target: Path, strategy: str, layout: str, port: int,
             timeout_s: float) -> dict:
    nproc, layout_args = LAYOUTS[layout]
    for copy, _ in copies:
        evict(files_under([copy]))
    with tempfile.TemporaryDirectory(prefix="bench-nodes-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION")}
        env.update(OMP_NUM_THREADS="1", VLLM_TARGET_DEVICE="cpu", PYTHONPATH=os.environ.get("PYTHONPATH", ""))
        procs = [subprocess.Popen(node_command(node=n, nproc=nproc, port=port, target=target, copy=copy,
                                               cgroup=cg, log_dir=Path(tmp) / f"node{n}", strategy=strategy,
                                               layout_args=layout_args),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
                 for n, (copy, cg) in enumerate(copies)]
        start = time.perf_counter()
        errors = []
        for n, proc in enumerate(procs):
            try:
                _, err = proc.communicate(timeout=max(1.0, timeout_s - (time.perf_counter() - start)))
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode != 0:
                errors.append(f"node {n} exit {proc.returncode}: {err[-1500:]}")
        wall = time.perf_counter() - start
        if errors:
            raise RuntimeError(f"{strategy} {layout}: " + "\n".join(errors))
        report = rank0_report(Path(tmp) / "node0")
    per_node = [sum(r["bytes_read"] for r in report["ranks"] if r["rank"] // nproc == n) for n in range(2)]
    slowest = max(report["ranks"], key=lambda r: r["seconds"]["total"])
    return {"strategy": strategy, "layout": layout, "wall_s": wall, "load_s_max_rank": slowest["seconds"]["total"],
            "phases_s_max_rank": slowest["seconds"], "bytes_read_per_node": per_node}


def judge(rows: dict[str, dict], total: int) -> tuple[dict, dict]:
    full, bcast, local = rows["full"], rows["broadcast"], rows["rank_local"]
    ratios = {"rank_local max bytes per node / DiT bytes": max(local["bytes_read_per_node"]) / total,
              "broadcast max bytes per node / DiT bytes": max(bcast["bytes_read_per_node"]) / total,
              "full / rank_local load time": full["load_s_max_rank"] / local["load_s_max_rank"],
              "full / broadcast load time": full["load_s_max_rank"] / bcast["load_s_max_rank"]}
    goals = {"rank_local bytes per node <= 0.55x DiT": ratios["rank_local max bytes per node / DiT bytes"] <= 0.55,
             "rank_local >= 1.8x faster than full": ratios["full / rank_local load time"] >= 1.8,
             "broadcast between full and rank_local": (ratios["full / rank_local load time"]
                                                       >= ratios["full / broadcast load time"] >= 1.0)}
    return ratios, goals


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/vllm-diffusion-bench"))
    parser.add_argument("--layouts", default="2x1,2x2-S4,2x2-R2S2")
    parser.add_argument("--bandwidth-mbps", type=float, default=200.0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per strategy and layout; the row is the run of median load time")
    parser.add_argument("--port", type=int, default=29511)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per run (both nodes)")
    parser.add_argument("--json", action="store_true")
    charts.add_plot_option(parser)
    args = parser.parse_args(argv)
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    folder = ensure_checkpoint(args.out_dir, args.size_gb)
    total = sum(p.stat().st_size for p in files_under([folder]))
    target = Path(tempfile.mkdtemp(prefix="node-ckpt-", dir=args.out_dir))
    report = {"checkpoint": str(folder), "bytes": total, "cap_mbps_per_node": args.bandwidth_mbps, "layouts": {}}
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: target.rmdir())
        copies = []
        for n in range(2):
            copy, device = stack.enter_context(loop_copy(folder, args.out_dir / f"node{n}"))
            cg, _ = stack.enter_context(capped_cgroup(device, int(args.bandwidth_mbps * 1e6),
                                                      name=f"vdp-node{n}-{os.getpid()}"))
            copies.append((copy, cg))
            _log(f"node {n}: copy on loop device {device}, read cap {args.bandwidth_mbps:.0f} MB/s ({cg})")
        for i, layout in enumerate(layouts):
            rows = {}
            for j, strategy in enumerate(STRATEGIES):
                runs = [run_once(copies=copies, target=target, strategy=strategy, layout=layout,
                                 port=args.port + 3 * (args.repeats * i + r) + j, timeout_s=args.timeout_s)
                        for r in range(args.repeats)]
                runs.sort(key=lambda run: run["load_s_max_rank"])
                rows[strategy] = {**runs[len(runs) // 2], "load_s_runs": [run["load_s_max_rank"] for run in runs]}
                phases = ", ".join(f"{k} {v:.1f}" for k, v in rows[strategy]["phases_s_max_rank"].items()
                                   if k != "total")
                _log(f"  {layout} {strategy}: load {rows[strategy]['load_s_max_rank']:.1f} s ({phases}), bytes per "
                     f"node {[round(b / 1e9, 2) for b in rows[strategy]['bytes_read_per_node']]} GB")
            ratios, goals = judge(rows, total)
            report["layouts"][layout] = {"runs": rows, "ratios": ratios, "goals": goals}
    print(json.dumps(report, indent=2))
    if args.plot:
        charts.plot("nodes", report, args.plot)
    return report


if __name__ == "__main__":
    main()
