"""Capacity: vllm-omni's own HSDP load against ours (``rank_local``) inside one memory limit, and how each scales.

Real ``vllm serve DIR --omni`` servers on the CPU platform (the ``[omni]`` environment), on the pipeline of
``bench_serve_startup.py``: Wan2.2 at A14B width (dim 5120, ffn 13824) with ``--blocks`` blocks per transformer,
bf16, one rank-64 LightX2V distill LoRA per transformer, tiny text encoder and VAE. Settings, each with
``--use-hsdp --hsdp-shard-size S`` when S > 1 and both LoRAs (``--lora-path H L --lora-backend distill``):

- ``omni``: vllm-omni's own load (every rank reads and fuses the whole DiTs, then ``apply_hsdp_to_model``);
- ``omni-broadcast``: the same with ``--enable-broadcast-weight-load``;
- ``ours``: ``--load-format diffusion-hsdp`` with ``hsdp_weight_load=rank_local`` (at S = 1 it runs as ``full``);
- ``omni-fp8`` / ``ours-fp8``: ``omni`` / ``ours`` with ``--quantization torch_fp8`` (online fp8 with the LoRAs fused
  first; on the CPU platform the pure-torch stand-in for vLLM's ``fp8``) -- ``--settings ours,omni-fp8,ours-fp8``.

Two runs (``--runs``):

- ``limit``: at ``--blocks`` and S = ``--shard-size``, every setting inside the same memory limit
  (``--limit-gib``), set by a memory cgroup the benchmark creates under its own cgroup, starts the whole server
  in (API server, engine, workers) and removes afterwards (cgroup v1 ``memory`` or v2 with the memory
  controller; root needed, "unavailable" said otherwise). An out-of-memory kill in the group (its ``oom_kill``
  counter) stops the server and is reported as ``oom``, never a crash of the benchmark; a server of ours that our
  pre-flight refuses before any worker starts (it cannot fit, and says so) as ``refused``.
- ``scaling``: at ``--scaling-blocks`` and each S of ``--scaling-sizes``, ``omni`` and ``ours``, inside a safety
  limit (this host's RAM minus 2 GiB) only.

Per server: served a video or not (``oom`` / ``failed`` with the error), ready seconds, and per worker its
baseline (ours: the ``baseline_rss`` of our door's report line, under ``rank_local`` its RSS once the DiTs
vllm-omni built are released to ``meta``, before the first weight byte; vllm-omni's own load, which logs
nothing there: its RSS when ``load_model`` began, logged by our CPU platform), its peak RSS at the end of its
load (``VmHWM`` sampled right after vllm-omni's "Model loading took" line, before its warm-up run) and over its
life (the warm-up's FSDP all-gathers and activations included), the sums over workers and the cgroup's own peak.
For ``ours`` also the plan (``engine.plan.plan_load`` for the same folder, LoRAs and S: the CLI's ``rank_local``,
which binds q/k/v one by one where vllm-omni stacks them) against the measured load peak above the baseline.
Goals (ratios in one run): under the limit ours serves and vllm-omni's own loads do not; at every S ours' load
peak per worker <= baseline + 1.15 x DiT bytes / S; plan within 15% (the load's peak against the load peak, the first
run's against the life peak).

    python benchmarks/bench_capacity.py --out-dir /tmp/bench-capacity [--runs limit,scaling] [--blocks 6]
        [--shard-size 2] [--limit-gib 19.5] [--scaling-blocks 1] [--scaling-sizes 1,2,4] [--json] [--plot PNG]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import charts  # noqa: E402
from bench_serve_startup import _dit_bytes, build, worker_rank  # noqa: E402

from vllm_diffusion_plugin.tools import servers as sv  # noqa: E402

SETTINGS = ("omni", "omni-broadcast", "ours", "omni-fp8", "ours-fp8")
LIMIT_SETTINGS = ("omni", "omni-broadcast", "ours")
"""The limit run's default settings; ``--settings ours,omni-fp8,ours-fp8 --limit-gib 13`` is the FP8 case."""
FP8 = "torch_fp8"
"""The online fp8 of the ``-fp8`` settings: on the CPU platform the pure-torch stand-in it registers through
vllm-omni's quantization override hook (vLLM's ``fp8`` has no CPU kernel); on a GPU host use ``fp8``."""
LOAD_START = re.compile(r"\(\w+ pid=(\d+)\).*worker RSS before its model load: (\d+) bytes")
"""Our CPU platform's line (``CpuOmniPlatform.init_diffusion_model_runner_runtime``): a worker's RSS right before
vllm-omni's ``load_model`` (vLLM's own "Model loading took X GiB" is the host's used memory on a CPU)."""
GiB = 1024 ** 3


# ---- the memory limit -------------------------------------------------------------------------------------
class MemoryLimit:
    """A memory cgroup of ``limit`` bytes under this process's own (v1 ``memory`` or v2), created on enter and
    removed on exit; ``oom_kills()`` counts the kernel's OOM kills inside it, ``peak()`` its peak usage."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit, self.name, self.path, self.v2 = limit, name, None, False

    @staticmethod
    def _own(controller: str) -> str | None:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controller in controllers.split(",") or (controller == "" and controllers == ""):
                return path
        return None

    def __enter__(self) -> "MemoryLimit":
        v1_root, own = Path("/sys/fs/cgroup/memory"), self._own("memory")
        if (v1_root / "memory.limit_in_bytes").is_file() and own is not None:
            self.path = v1_root / own.lstrip("/") / self.name
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
            with contextlib.suppress(OSError):  # no swap accounting: the limit alone
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(self.limit))
            return self
        own = self._own("")
        for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
            controllers = root / "cgroup.controllers"
            if own is not None and controllers.is_file() and "memory" in controllers.read_text().split():
                parent = root / own.lstrip("/")
                (parent / "cgroup.subtree_control").write_text("+memory")
                self.path, self.v2 = parent / self.name, True
                self.path.mkdir()
                (self.path / "memory.max").write_text(str(self.limit))
                (self.path / "memory.swap.max").write_text("0")
                return self
        raise OSError("no memory cgroup controller this process may use (cgroup v1 'memory' or v2 'memory')")

    def oom_kills(self) -> int:
        text = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        return int(dict(line.split() for line in text.splitlines()).get("oom_kill", 0))

    def peak(self) -> int | None:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        with contextlib.suppress(OSError, ValueError):
            return int((self.path / name).read_text())
        return None

    def stat(self) -> dict[str, int]:
        """The group's page cache, private memory, mapped file pages and major faults (``memory.stat``, v1 or v2
        names), to tell a group short of memory (major faults: pages read again) from one that is not."""
        names = {"file": "cache", "anon": "rss", "file_mapped": "mapped_file"} if self.v2 else {}
        with contextlib.suppress(OSError, ValueError):
            raw = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines())
            return {names.get(k, k): int(v) for k, v in raw.items()
                    if names.get(k, k) in ("cache", "rss", "mapped_file", "pgmajfault")}
        return {}

    def kill_all(self) -> None:
        """SIGKILL every process in the group."""
        for pid in (int(p) for p in (self.path / "cgroup.procs").read_text().split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def __exit__(self, *exc) -> None:
        if self.path is None:
            return
        for _ in range(100):  # the server is stopped; its last processes may still be exiting
            try:
                self.path.rmdir()
                return
            except OSError:
                self.kill_all()
                time.sleep(0.2)
        print(f"warning: could not remove {self.path}", file=sys.stderr)


class OomWatch(threading.Thread):
    """Kills every process of ``limit``'s group at its first OOM kill, so a server missing a worker ends now
    rather than at its ready timeout."""

    def __init__(self, limit: MemoryLimit) -> None:
        super().__init__(daemon=True)
        self.limit, self.killed, self._done = limit, 0, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.5):
            self.killed = self.limit.oom_kills()
            if self.killed:
                self.limit.kill_all()
                return

    def stop(self) -> int:
        self._done.set()
        self.join(5)
        return max(self.killed, self.limit.oom_kills())


# ---- settings ---------------------------------------------------------------------------------------------
def spec_for(setting: str, size: int, pipeline: Path, loras: list[Path], *, name: str, cgroup: Path,
             init_timeout_s: int, env: dict[str, str] | None = None) -> sv.ServerSpec:
    args = ["--init-timeout", str(init_timeout_s), "--stage-init-timeout", str(init_timeout_s),
            "--lora-path", *map(str, loras), "--lora-backend", "distill"]
    if size > 1:
        args += ["--use-hsdp", "--hsdp-shard-size", str(size)]
    base, fp8 = setting.removesuffix("-fp8"), setting.endswith("-fp8")
    if fp8:
        args += ["--quantization", FP8]
    if base == "omni-broadcast":
        args.append("--enable-broadcast-weight-load")
    elif base == "ours":
        args += ["--load-format", "diffusion-hsdp"]
        if size > 1:
            args += ["--additional-config", json.dumps({"diffusion_hsdp": {"hsdp_weight_load": "rank_local"}})]
    elif base != "omni" or setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; known: {', '.join(SETTINGS)}")
    return sv.ServerSpec(name, pipeline, plugin=base == "ours", args=tuple(args), dtype="bfloat16",
                         env={**(env or {}), "VLLM_DIFFUSION_OMNI_CPU_DEVICES": str(max(2, size))}, cgroup=cgroup)


def one_server(setting: str, size: int, blocks: int, pipeline: Path, loras: list[Path], *, limit: int,
               logs: Path, timeout_s: float, env: dict[str, str] | None = None) -> dict:
    name = f"{setting}-S{size}-{blocks}blocks-{limit / GiB:.1f}GiB"
    row: dict = {"name": name, "setting": setting, "S": size, "blocks": blocks, "limit": limit, "status": "failed",
                 "log": str(logs / f"{name}.log")}
    print(f"[{name}] starting", flush=True)
    try:
        with MemoryLimit(limit, f"vllm-diffusion-capacity-{os.getpid()}") as group:
            watch = OomWatch(group)
            watch.start()
            try:
                spec = spec_for(setting, size, pipeline, loras, name=name, cgroup=group.path,
                                init_timeout_s=int(timeout_s), env=env)
                run = sv.serve(spec, logs, cpu=True, ready_timeout_s=timeout_s, request_timeout_s=timeout_s,
                               sample_s=0.2)
                row |= {"status": "served", "ready_s": round(run.ready_s, 1), "first_s": round(run.first_answer_s, 1)}
            except sv.ServerError as exc:
                run = exc.run
                row["error"] = str(exc).splitlines()[0][:300]
                refusal = re.search(r"PreflightError: (pre-flight: [^\n]*)", run.log_text() if run else "")
                if refusal:  # our pre-flight refused it before any worker started: it does not fit, said so
                    row |= {"status": "refused", "error": refusal[1][:300]}
            finally:
                kills = watch.stop()
                row |= {"oom_kills": kills, "cgroup_peak": group.peak(), "cgroup_stat": group.stat()}
                if kills:
                    row["status"] = "oom"
    except OSError as exc:
        row |= {"status": "unavailable", "error": f"memory limit: {exc}"}
        print(f"[{name}] {row['error']}", flush=True)
        return row
    if run is not None:
        row["workers"] = _workers(run)
    w = row.get("workers", {})
    print(f"[{name}] {row['status']}" + (f" ({row.get('error', '')[:160]})" if row["status"] != "served" else "")
          + (f"; load peak per worker {max(v['load_peak'] or 0 for v in w.values()) / GiB:.2f} GiB" if w else ""),
          flush=True)
    return row


def _workers(run: sv.ServerRun) -> dict[int, dict]:
    """Per worker rank: ``load_start`` (its RSS when vllm-omni's ``load_model`` began, logged by our CPU
    platform), ``baseline`` (ours: our door's ``baseline_rss``; vllm-omni's own
    load: ``load_start``), load-end and life peaks; the private and file-backed parts of its RSS at the end of its
    load (``load_anon`` / ``load_file``) and its largest private RSS over its life (``life_anon``): what a load
    keeps past its end (buffers, mappings) shows in the first two, the warm-up's own need in the last."""
    text = run.log_text()
    starts = {int(pid): int(rss) for pid, rss in LOAD_START.findall(text)}
    first_byte = {int(r["rank"]): int(r["baseline_rss"]) for r in sv.load_reports(text) if "baseline_rss" in r}
    out = {}
    for p in run.workers:
        mark, rank, start = p.at_marks.get("loaded", {}), worker_rank(p.title), starts.get(p.pid)
        out[rank] = {"baseline": first_byte.get(rank, start), "load_start": start, "load_peak": mark.get("peak_rss"),
                     "life_peak": p.peak_rss, "load_anon": mark.get("rss_anon"), "load_file": mark.get("rss_file"),
                     "life_anon": p.max_sampled_anon}
    return dict(sorted(out.items()))


# ---- the plan ---------------------------------------------------------------------------------------------
def planned(pipeline: Path, loras: list[Path], size: int, *, fp8: bool = False) -> tuple[dict[int, int], dict[int, int]]:
    """(host peak, first run's peak -- the server's warm-up) per rank that ``plan`` gives our rank_local load of this
    folder at S = ``size``, from one plan."""
    import torch

    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec
    from vllm_diffusion_plugin.engine.plan import plan_load

    quantization = None
    if fp8:  # the method the fp8 settings' servers run
        from vllm_diffusion_plugin.testing.online_quant import attach_online_quant

        quantization = attach_online_quant
    plan = plan_load(str(pipeline), options=LoadOptions(), lora_specs=[LoraSpec(p) for p in loras],
                     world_size=size, hsdp=HSDPConfig(replicate_size=1, shard_size=size) if size > 1 else None,
                     dtype=torch.bfloat16, device_type="cpu", quantization=quantization)
    ranks = [r for r in plan.ranks if r.strategy == ("rank_local" if size > 1 else "full")]
    return {r.rank: r.host_peak for r in ranks}, {r.rank: r.first_run_peak for r in ranks}


# ---- judging and printing ---------------------------------------------------------------------------------
def judge(rows: list[dict], dit: dict[int, int], plans: dict[tuple[int, int, bool], dict[int, int]],
          first_runs: dict[tuple[int, int, bool], dict[int, int]] | None = None) -> list[dict]:
    """Goals as ratios; ``plans`` / ``first_runs``: (blocks, S, fp8) -> rank -> the plan's host / first-run peak."""
    goals = []
    limited = [r for r in rows if r["run"] == "limit"]
    if limited:  # the leanest of ours serves, every other setting is OOM-killed
        winner = "ours-fp8" if any(r["setting"] == "ours-fp8" for r in limited) else "ours"
        ours = [r for r in limited if r["setting"] == winner]
        theirs = [r for r in limited if r["setting"] != winner]
        goals.append({"goal": f"under {limited[0]['limit'] / GiB:.1f} GiB {winner} serves, "
                              f"{', '.join(sorted({r['setting'] for r in theirs}))} do not",
                      "pass": all(r["status"] == "served" for r in ours) and bool(theirs)
                      and all(r["status"] in ("oom", "refused") for r in theirs),
                      "detail": ", ".join(f"{r['setting']}: {r['status']}" for r in limited)})
    for r in rows:
        if not r["setting"].startswith("ours") or not r.get("workers"):
            continue
        key = (r["blocks"], r["S"], r["setting"].endswith("-fp8"))
        per_s = dit[r["blocks"]] / r["S"]
        for rank, w in r["workers"].items():
            if w["baseline"] is None or w["load_peak"] is None:
                continue
            added = w["load_peak"] - w["baseline"]
            goals.append({"goal": f"{r['name']} rank {rank}: load peak <= baseline + 1.15 x DiT/S",
                          "ratio": added / per_s, "pass": added <= 1.15 * per_s})
            plan = plans.get(key, {}).get(rank)
            if plan:
                goals.append({"goal": f"{r['name']} rank {rank}: plan within 15% of the measured load peak",
                              "ratio": plan / added, "pass": abs(plan - added) <= 0.15 * added})
            first = (first_runs or {}).get(key, {}).get(rank)
            if first and w.get("life_peak") and r["S"] > 1:  # the warm-up's FSDP all-gathers (issue 39)
                lived = w["life_peak"] - w["baseline"]
                goals.append({"goal": f"{r['name']} rank {rank}: plan's first run within 15% of the life peak",
                              "ratio": first / lived, "pass": abs(first - lived) <= 0.15 * lived})
    return goals


def table(rows: list[dict], goals: list[dict]) -> str:
    def g(v):
        return "-" if v is None else f"{v / GiB:.2f}"

    lines = [f"{'server':<42} {'status':<8} {'ready s':>7} {'baseline':>9} {'load peak':>10} {'life peak':>10} "
             f"{'anon load/life':>15} {'file load':>9} {'sum load/life':>14} {'cgroup peak':>11} {'majflt':>7}"
             f"   (GiB, largest worker)"]
    for r in rows:
        w = list(r.get("workers", {}).values())
        top = max(w, key=lambda x: x["load_peak"] or 0) if w else {}
        sums = (g(sum(x["load_peak"] or 0 for x in w)) + "/" + g(sum(x["life_peak"] or 0 for x in w))) if w else "-"
        lines.append(f"{r['name']:<42} {r['status']:<8} {r.get('ready_s', '-')!s:>7} {g(top.get('baseline')):>9} "
                     f"{g(top.get('load_peak')):>10} {g(top.get('life_peak')):>10} "
                     f"{g(top.get('load_anon')) + '/' + g(top.get('life_anon')):>15} {g(top.get('load_file')):>9} "
                     f"{sums:>14} {g(r.get('cgroup_peak')):>11} {r.get('cgroup_stat', {}).get('pgmajfault', '-')!s:>7}")
    for goal in goals:
        ratio = f"{goal['ratio']:.2f}x " if "ratio" in goal else ""
        lines.append(f"  {goal['goal']}: {ratio}{'PASS' if goal['pass'] else 'FAIL'}"
                     + (f" ({goal['detail']})" if "detail" in goal else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/bench-capacity"),
                        help="pipelines (shared with bench_serve_startup's layout), logs and results.json")
    parser.add_argument("--runs", default="limit,scaling", help="limit, scaling or limit,scaling")
    parser.add_argument("--blocks", type=int, default=6, help="blocks per transformer in the limit run")
    parser.add_argument("--shard-size", type=int, default=2, help="S of the limit run")
    parser.add_argument("--limit-gib", type=float, default=19.5, help="memory limit of the whole server (GiB)")
    parser.add_argument("--settings", default=",".join(LIMIT_SETTINGS),
                        help=f"settings of the limit run, of {', '.join(SETTINGS)}")
    parser.add_argument("--scaling-blocks", type=int, default=1)
    parser.add_argument("--scaling-sizes", default="1,2,4")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per server to be ready / answer")
    parser.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for every server (VLLM_LOGGING_LEVEL=DEBUG: our rank_local load logs "
                             "its RSS per step)")
    parser.add_argument("--json", action="store_true")
    charts.add_plot_option(parser)
    args = parser.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    settings = [s for s in args.settings.split(",") if s]
    if bad := [r for r in runs if r not in ("limit", "scaling")] + [s for s in settings if s not in SETTINGS]:
        parser.error(f"unknown run or setting: {bad}")
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    safety = host - 2 * GiB
    plan: list[tuple[str, str, int, int, int]] = []  # (run, setting, S, blocks, limit)
    if "limit" in runs:
        plan += [("limit", s, args.shard_size, args.blocks, int(args.limit_gib * GiB)) for s in settings]
    if "scaling" in runs:
        plan += [("scaling", s, int(n), args.scaling_blocks, safety)
                 for n in args.scaling_sizes.split(",") for s in ("omni", "ours")]
    folders = {b: build(args.out_dir, blocks=b) for b in sorted({p[3] for p in plan})}
    dit = {b: _dit_bytes(folder) for b, (folder, _) in folders.items()}
    ours = {(b, n, s.endswith("-fp8")) for _, s, n, b, _ in plan if s.startswith("ours")}
    both = {(b, n, q): planned(*folders[b], n, fp8=q) for b, n, q in ours}
    plans, first_runs = ({key: pair[i] for key, pair in both.items()} for i in (0, 1))
    logs, rows, t0 = args.out_dir / "logs" / time.strftime("%Y%m%d-%H%M%S"), [], time.monotonic()
    for run, setting, size, blocks, limit in plan:
        pipeline, loras = folders[blocks]
        row = one_server(setting, size, blocks, pipeline, loras, limit=limit, logs=logs, timeout_s=args.timeout,
                         env=dict(item.split("=", 1) for item in args.server_env))
        key = (blocks, size, setting.endswith("-fp8"))
        rows.append(row | {"run": run, "planned_host_peak": plans.get(key), "planned_first_run": first_runs.get(key)})
    goals = judge(rows, dit, plans, first_runs)
    result = {"host_bytes": host, "dit_bytes": dit, "wall_s": round(time.monotonic() - t0, 1), "rows": rows,
              "goals": goals,
              "rss_method": "VmHWM / VmRSS of each worker sampled every 0.2 s; baseline: ours from our door's "
                            "baseline_rss, vllm-omni's own load the RSS our CPU platform logs before load_model"}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.plot:
        charts.plot("capacity", result, args.plot)
    print(json.dumps(result, indent=1, default=str) if args.json else table(rows, goals))
    print(f"results: {args.out_dir / 'results.json'}; logs: {logs}", flush=True)
    return 0 if all(g["pass"] for g in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
