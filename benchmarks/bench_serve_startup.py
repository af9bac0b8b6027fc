"""``vllm serve DIR --omni`` startup: vllm-omni's own load against ``--load-format diffusion-hsdp``, warm and cold.

The pipeline: Wan2.2 at A14B width (dim 5120, ffn 13824, 40 heads x 128, text_dim 4096, 16 latent channels) with
``--blocks`` N blocks per transformer, bf16, saved by diffusers in shards; text encoder and VAE tiny (only the
DiTs matter); one rank-64 LightX2V-named distill LoRA per transformer (``bench_lora_prepare.write_lora``). Built
once into ``--out-dir`` (reused while its parameters match).

Settings (``--settings`` picks a subset; every one with the same two LoRAs except ``omni-nolora-*``):

- ``omni-nolora-1``: vllm-omni's own load, no LoRA;
- ``omni-1``: vllm-omni's own load, ``--lora-path H L --lora-backend distill``;
- ``ours-1``: the same flags plus ``--load-format diffusion-hsdp``;
- ``omni-hsdp2``: vllm-omni's own HSDP load at 2 ranks (``--use-hsdp --hsdp-shard-size 2``), the same LoRAs;
- ``ours-hsdp2-full`` / ``-broadcast`` / ``-rank_local``: ours at 2 ranks with each ``hsdp_weight_load``.

Each setting runs on each storage kind of ``--storage`` (``benchmarks/storage.py``; ``--cache`` is its old name):
``warm`` (every file read once first), ``cold`` (before the server starts -- none is alive then -- every file of
the checkpoint and the LoRAs gets ``posix_fadvise(POSIX_FADV_DONTNEED)``, ``tools.pagecache``;
``/proc/sys/vm/drop_caches`` is not used: it drops the whole host's cache), ``throttled`` (a copy on a loop
device whose reads this process and its servers are capped at ``--bandwidth-mbps``) and ``latency`` (a FUSE
mount delaying every read request by ``--latency-ms``), both cold. A kind the host cannot make is reported. The
resident share of those files (``mincore``) is recorded just before each start as the evidence. Servers run one
at a time (``tools.servers.serve``), the run order rotating by one per repeat.

Figures per server: ``ready_s`` (launch to ``/health``), ``first_s`` (launch to the first answered video
request: weights that fault in lazily show here), the workers' load phase (vllm-omni's "Model loading took"
line per worker, which wraps our door too, and our ``diffusion-hsdp load report:`` read_s / lora_s / total_s),
bytes read per rank (our report's ``bytes_read``; ``/proc/PID/io`` ``read_bytes`` of each worker, storage reads
only, so ~0 when warm), and the peak RSS of every worker process (``VmHWM`` of each process of the server's
process group sampled every 0.2 s; workers are the processes titled ``DiffusionWorker*``): at the end of its load
phase (``load``: sampled right after its "Model loading took" line, before vllm-omni's 512x512 warm-up run) and
over the server's whole life (``all``: warm-up and the first request included, where activations and FSDP's
all-gathered blocks count too). A server that fails
is recorded with its error and log, and the run goes on. Medians over repeats; the goals of issue 24 as ratios.

Usage (the ``[omni]`` environment)::

    python benchmarks/bench_serve_startup.py --out-dir /tmp/bench-serve [--blocks 1] [--repeats 1]
        [--settings omni-1,ours-1,omni-hsdp2,ours-hsdp2-rank_local] [--storage warm,cold,throttled,latency] [--json]
        [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import charts  # noqa: E402
import storage  # noqa: E402
from bench_lora_prepare import CONFIG, write_lora  # noqa: E402

from vllm_diffusion_plugin.tools import pagecache  # noqa: E402
from vllm_diffusion_plugin.tools import servers as sv  # noqa: E402

HSDP2 = ("--use-hsdp", "--hsdp-shard-size", "2")
STRATEGIES = ("full", "broadcast", "rank_local")
SETTINGS = ("omni-nolora-1", "omni-1", "ours-1", "omni-hsdp2", *(f"ours-hsdp2-{s}" for s in STRATEGIES))
DEFAULT_SETTINGS = ("omni-1", "ours-1", "omni-hsdp2", "ours-hsdp2-rank_local")
GiB = 1024 ** 3


# ---- the checkpoint ---------------------------------------------------------------------------------------
def build(out: Path, *, blocks: int) -> tuple[Path, list[Path]]:
    """The pipeline folder and the two LoRA files, built unless ``out`` holds them for ``blocks``."""
    pipeline, stamp = out / f"wan22-a14b-width-{blocks}blocks", out / f"wan22-a14b-width-{blocks}blocks.done"
    loras = [out / f"lightx2v_rank64_{name}_{blocks}blocks.safetensors" for name in ("high", "low")]
    for seed, path in enumerate(loras):
        write_lora(path, blocks=blocks, seed=seed)
    if not stamp.exists():
        t0 = time.monotonic()
        _write_pipeline(pipeline, blocks=blocks)
        stamp.write_text(json.dumps({"blocks": blocks, "build_s": round(time.monotonic() - t0, 1)}) + "\n")
        print(f"built {pipeline} in {time.monotonic() - t0:.0f} s", flush=True)
    return pipeline, loras


def _write_pipeline(root: Path, *, blocks: int) -> None:
    import shutil

    import diffusers
    import torch

    from vllm_diffusion_plugin.tiny.models import write_wan_runtime_components

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    config = {**CONFIG, "num_layers": blocks}
    index = {"_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__, "boundary_ratio": 0.875}
    index |= write_wan_runtime_components(root, dtype=torch.bfloat16, text_dim=config["text_dim"],
                                          z_dim=config["in_channels"])
    for seed, name in enumerate(("transformer", "transformer_2")):
        with torch.device("meta"):
            model = diffusers.WanTransformer3DModel(**config)
        model = model.to(torch.bfloat16).to_empty(device="cpu").eval()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # seeded: 1/sqrt(fan-in) for matrices, ~1 for norm scales, small biases
            for pname, param in model.named_parameters():
                if param.dim() >= 2:
                    std = param[0].numel() ** -0.5
                    param.copy_(torch.randn(param.shape, generator=gen) * std)
                elif "norm" in pname and pname.endswith("weight"):
                    param.copy_(1 + 0.02 * torch.randn(param.shape, generator=gen))
                else:
                    param.copy_(0.02 * torch.randn(param.shape, generator=gen))
        model.save_pretrained(root / name, max_shard_size="400MB")
        index[name] = ["diffusers", "WanTransformer3DModel"]
        del model
    (root / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# ---- settings ---------------------------------------------------------------------------------------------
def spec_for(setting: str, cache: str, repeat: int, pipeline: Path, loras: list[Path], *,
             env: dict[str, str] | None = None, init_timeout_s: int = 1800) -> sv.ServerSpec:
    """The server of ``setting``. vllm-omni's own startup bounds (``--init-timeout`` 600 s, ``--stage-init-timeout``
    300 s) are raised to ``init_timeout_s`` for every setting alike: its 2-rank HSDP load with LoRA fusion in bf16
    on a 2-core host needs more than 600 s, and a timed-out server measures nothing."""
    bounds = ("--init-timeout", str(init_timeout_s), "--stage-init-timeout", str(init_timeout_s))
    lora = ("--lora-path", *map(str, loras), "--lora-backend", "distill")
    if setting == "omni-nolora-1":
        plugin, args = False, ()
    elif setting == "omni-1":
        plugin, args = False, lora
    elif setting == "ours-1":
        plugin, args = True, (*lora, "--load-format", "diffusion-hsdp")
    elif setting == "omni-hsdp2":
        plugin, args = False, (*lora, *HSDP2)
    elif setting.startswith("ours-hsdp2-") and setting.removeprefix("ours-hsdp2-") in STRATEGIES:
        extra = json.dumps({"diffusion_hsdp": {"hsdp_weight_load": setting.removeprefix("ours-hsdp2-")}})
        plugin, args = True, (*lora, *HSDP2, "--load-format", "diffusion-hsdp", "--additional-config", extra)
    else:
        raise ValueError(f"unknown setting {setting!r}; known: {', '.join(SETTINGS)}")
    return sv.ServerSpec(f"{setting}-{cache}-r{repeat}", pipeline, plugin=plugin, args=(*bounds, *args),
                         dtype="bfloat16",
                         env=dict(env or {}))


def staged(out: Path, pipeline: Path, loras: list[Path]) -> Path:
    """One folder holding the pipeline and the LoRA files (hard links), for a storage kind to show whole."""
    stage = out / f"stage-{pipeline.name}"
    for src in [*pagecache.files_under([pipeline]), *loras]:
        dst = stage / src.relative_to(out)
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
    return stage


def prepare_cache(cache: str, paths: list[Path]) -> float:
    """Read (warm) or evict (every other storage kind) every file of ``paths``; the resident share afterwards."""
    if cache != "warm":
        pagecache.evict(paths)
    else:
        for path in pagecache.files_under(paths):
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass
    resident, total = pagecache.resident_bytes(paths)
    return resident / total if total else 0.0


def worker_rank(title: str) -> int:
    """``...DiffusionWorker_FS1...`` -> 1; a worker without a shard suffix is rank 0."""
    _, sep, rest = title.partition("_FS")
    return int("".join(c for c in rest if c.isdigit()) or 0) if sep else 0


def one_server(spec: sv.ServerSpec, logs: Path, *, cache: str, paths: list[Path], ready_timeout_s: float) -> dict:
    resident = prepare_cache(cache, paths)
    print(f"[{spec.name}] starting ({cache}: {resident:.1%} of the checkpoint and LoRAs resident)", flush=True)
    row: dict = {"name": spec.name, "cache": cache, "resident_before": round(resident, 4),
                 "log": str(logs / f"{spec.name}.log"), "ok": False}
    try:
        run = sv.serve(spec, logs, cpu=_cpu(), ready_timeout_s=ready_timeout_s, request_timeout_s=ready_timeout_s,
                       sample_s=0.2, progress=lambda line: print(line, flush=True))
    except (sv.ServerError, OSError) as exc:
        row["error"] = str(exc).splitlines()[0][:500]
        print(f"[{spec.name}] FAILED: {row['error']} (log {row['log']})", flush=True)
        run = getattr(exc, "run", None)
        if run is not None:  # what it measured before failing (e.g. its load phase), kept apart from the medians
            row["partial"] = _figures(run)
        return row
    return row | {"ok": True} | _figures(run)


def _figures(run: sv.ServerRun) -> dict:
    text = run.log_text()
    reports = sv.load_reports(text)
    workers = {worker_rank(p.title): p.as_dict() for p in run.workers}
    return {"ready_s": round(run.ready_s, 2), "first_s": round(run.first_answer_s, 2),
            "request_s": [round(s, 2) for s in run.request_s], "workers": workers,
            "omni_load": sv.worker_load_times(text),
            "ours": [{k: r.get(k) for k in ("component", "rank", "strategy", "bytes_read", "read_s", "lora_s",
                                            "total_s", "peak_rss")} for r in reports],
            "ours_bytes_per_rank": sv.bytes_per_rank(reports),
            "processes": [p.as_dict() for p in run.processes.values()]}


def _cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


# ---- summary ----------------------------------------------------------------------------------------------
def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per ``setting-cache``: medians of ready, first answer, load phase (slowest worker), peak RSS (largest
    worker), bytes per rank (ours' reports, and workers' storage reads); failures counted."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["name"].rpartition("-r")[0], []).append(row)
    out = {}
    for key, runs in groups.items():
        ok = [r for r in runs if r["ok"]]
        out[key] = {
            "runs": len(runs), "failed": len(runs) - len(ok),
            "ready_s": _median([r["ready_s"] for r in ok]), "first_s": _median([r["first_s"] for r in ok]),
            "load_s": _median([max((w.get("model_s", 0.0) for w in r["omni_load"].values()), default=None)
                               for r in ok]),
            "peak_rss_worker": _median([max((w["peak_rss"] for w in r["workers"].values()), default=None)
                                        for r in ok]),
            "load_peak_rss_worker": _median([max((w["at_marks"].get("loaded", {}).get("peak_rss", 0)
                                                  for w in r["workers"].values()), default=None) for r in ok]),
            "ours_bytes_rank0": _median([r["ours_bytes_per_rank"].get(0) for r in ok]) if any(
                r["ours_bytes_per_rank"] for r in ok) else None,
            "io_read_rank0": _median([r["workers"].get(0, {}).get("read_bytes") for r in ok]),
            "io_read_rank1": _median([r["workers"].get(1, {}).get("read_bytes") for r in ok]),
        }
    return out


def goals(summary: dict[str, dict], caches: list[str]) -> list[dict]:
    """Issue 24's goals, each a ratio of medians from this run (vllm-omni's figure / ours, > 1: ours better)."""
    found = []

    def ratio(a, b):
        return None if not a or not b else a / b

    for cache in caches:
        get = lambda s, k: summary.get(f"{s}-{cache}", {}).get(k)  # noqa: E731
        pairs = [("ours-1", "omni-1")] + [(f"ours-hsdp2-{s}", "omni-hsdp2") for s in STRATEGIES]
        for ours, omni in pairs:
            for key in ("ready_s", "first_s", "load_s"):
                r = ratio(get(omni, key), get(ours, key))
                if r is not None:
                    found.append({"goal": f"{ours} not slower than {omni} ({cache}, {key})", "ratio": r,
                                  "pass": r >= 1.0})
        r = ratio(get("omni-hsdp2", "first_s"), get("ours-hsdp2-rank_local", "first_s"))
        if cache == "cold" and r is not None:
            found.append({"goal": "cold: rank_local ready + first request >= 1.5x faster than omni-hsdp2",
                          "ratio": r, "pass": r >= 1.5})
        for key, what in (("peak_rss_worker", "peak RSS"), ("load_peak_rss_worker", "load-phase peak RSS")):
            r = ratio(get("ours-hsdp2-rank_local", key), get("omni-hsdp2", key))
            if r is not None:
                found.append({"goal": f"{what} per rank rank_local <= 0.6x omni-hsdp2 ({cache})", "ratio": r,
                              "pass": r <= 0.6})
    return found


def table(summary: dict[str, dict], goal_rows: list[dict]) -> str:
    def f(v, scale=1.0, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v / scale)

    lines = [f"{'setting':<28} {'runs':>4} {'ready s':>8} {'first s':>8} {'load s':>7} {'RSS GiB load/all':>16} "
             f"{'ours read/rank0 GB':>18} {'io read r0/r1 GB':>17}"]
    for key, s in summary.items():
        runs = f"{s['runs'] - s['failed']}/{s['runs']}"
        lines.append(f"{key:<28} {runs:>4} {f(s['ready_s']):>8} {f(s['first_s']):>8} {f(s['load_s']):>7} "
                     f"{f(s['load_peak_rss_worker'], GiB, '{:.2f}') + '/' + f(s['peak_rss_worker'], GiB, '{:.2f}'):>16} {f(s['ours_bytes_rank0'], 1e9, '{:.2f}'):>18} "
                     f"{f(s['io_read_rank0'], 1e9, '{:.2f}') + '/' + f(s['io_read_rank1'], 1e9, '{:.2f}'):>17}")
    for g in goal_rows:
        lines.append(f"  {g['goal']}: {g['ratio']:.2f}x {'PASS' if g['pass'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/bench-serve-startup"),
                        help="checkpoint cache, server logs and results.json")
    parser.add_argument("--blocks", type=int, default=1, help="blocks per transformer (A14B has 40)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                        help=f"comma-separated subset of {','.join(SETTINGS)} (or 'all')")
    parser.add_argument("--storage", "--cache", dest="storage", default="warm,cold",
                        help="storage kinds (benchmarks/storage.py): warm, cold, throttled, latency (comma list) or "
                             "all; each is set up once, every setting runs on it, it is torn down")
    parser.add_argument("--bandwidth-mbps", type=float, default=200.0, help="'throttled' read cap (MB/s)")
    parser.add_argument("--latency-ms", type=float, default=4.0, help="'latency' delay per read request")
    parser.add_argument("--ready-timeout", type=float, default=1800.0,
                        help="seconds per server to be ready (and per request); also vllm-omni's --init-timeout and "
                             "--stage-init-timeout")
    parser.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for every server (e.g. VLLM_LOGGING_LEVEL=DEBUG: our rank_local "
                             "load logs its memory per step)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON (also in results.json)")
    charts.add_plot_option(parser)
    args = parser.parse_args(argv)
    settings = list(SETTINGS) if args.settings == "all" else [s for s in args.settings.split(",") if s]
    try:
        caches = storage.parse_kinds(args.storage)
    except ValueError as exc:
        parser.error(f"--storage: {exc}")
    env = dict(item.split("=", 1) for item in args.server_env)
    pipeline, loras = build(args.out_dir, blocks=args.blocks)
    for s in settings:
        spec_for(s, "warm", 0, pipeline, loras)  # unknown names stop here, before any server
    logs, rows, t0 = args.out_dir / "logs" / time.strftime("%Y%m%d-%H%M%S"), [], time.monotonic()
    stage, unavailable, notes = staged(args.out_dir, pipeline, loras), {}, {}
    for cache in caches:
        try:
            with storage.open_storage(cache, stage, workdir=args.out_dir / "storage",
                                      bandwidth_mbps=args.bandwidth_mbps, latency_ms=args.latency_ms) as st:
                notes[cache] = st.note
                seen = (st.path / pipeline.name, [st.path / p.name for p in loras])
                for repeat in range(args.repeats):
                    k = repeat % len(settings)
                    order = settings[k:] + settings[:k]
                    print(f"{cache}, repeat {repeat + 1}/{args.repeats}, order: {', '.join(order)}", flush=True)
                    for i, setting in enumerate(order):
                        spec = spec_for(setting, cache, repeat, *seen, env=env, init_timeout_s=int(args.ready_timeout))
                        row = one_server(spec, logs, cache=cache, paths=[seen[0], *seen[1]],
                                         ready_timeout_s=args.ready_timeout)
                        rows.append(row | {"setting": setting, "repeat": repeat, "order": i})
                        if row["ok"]:
                            peak = max((w["peak_rss"] for w in row["workers"].values()), default=0)
                            print(f"[{spec.name}] ready {row['ready_s']:.1f} s, first video {row['first_s']:.1f} s, "
                                  f"peak worker RSS {peak / GiB:.2f} GiB", flush=True)
        except storage.Unavailable as exc:
            unavailable[cache] = str(exc)
            print(f"storage {cache}: unavailable on this host: {exc}", flush=True)
    summary = summarize(rows)
    goal_rows = goals(summary, caches)
    result = {"pipeline": str(pipeline), "blocks": args.blocks, "dtype": "bfloat16", "repeats": args.repeats,
              "dit_bytes": _dit_bytes(pipeline), "lora_bytes": sum(p.stat().st_size for p in loras),
              "cold_method": "posix_fadvise(POSIX_FADV_DONTNEED) per file, checked with mincore",
              "rss_method": "VmHWM of each process in the server's process group, sampled every 0.2 s",
              "storage": notes, "unavailable": unavailable,
              "wall_s": round(time.monotonic() - t0, 1), "summary": summary, "goals": goal_rows, "runs": rows}
    logs.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        charts.plot("serve_startup", result, args.plot)
    print(json.dumps(result, indent=1) if args.json else table(summary, goal_rows))
    print(f"results: {args.out_dir / 'results.json'}; logs: {logs}", flush=True)
    return 0 if all(r["ok"] for r in rows) else 1


def _dit_bytes(pipeline: Path) -> int:
    return sum(p.stat().st_size for sub in ("transformer", "transformer_2")
               for p in (pipeline / sub).glob("*.safetensors"))


if __name__ == "__main__":
    sys.exit(main())
