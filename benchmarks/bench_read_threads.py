"""Parallel reads per storage kind: our reader with 1 and N threads against diffusers ``from_pretrained``.

For each storage kind (``storage.py``: warm page cache, cold local disk, bandwidth-capped cold disk, latency-bound
FUSE store) the same Wan-width bf16 checkpoint (``bench_load.ensure_checkpoint``) is read, cold unless warm, by

  (a) ours        the CLI's ``full`` load (skeleton, ``load_into_module(map_private=True, threads=N)``) with every
                  parameter page touched afterwards, for every N of ``--threads``;
  (b) diffusers   ``WanTransformer3DModel.from_pretrained(folder, torch_dtype=bfloat16)`` with every parameter
                  page touched afterwards (diffusers maps the file; the touch is what reading costs it).

Goals (ratios within one storage kind, medians of ``--repeats``): the latency-bound store read with 4 threads
>= 3x the 1-thread throughput; ours with the default 4 threads >= 1.0x diffusers on every kind. A kind this host
cannot make is reported as such.

    python benchmarks/bench_read_threads.py --size-gb 1 --storage all --repeats 3 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_load  # noqa: E402
import storage as storage_kinds  # noqa: E402

DEFAULT_THREADS = (1, 4)


def read_ours(path: Path, threads: int) -> None:
    """As the CLI's ``full`` load: the skeleton, the weights mapped into it (``load_into_module(map_private=True)``),
    then every page touched, as for diffusers."""
    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint
    from vllm_diffusion_plugin.engine.skeleton import build_component
    from vllm_diffusion_plugin.engine.weights import load_into_module

    (source,) = resolve_checkpoint(path)
    module = build_component(source, dtype=torch.bfloat16, device="cpu")
    load_into_module(module, source=source, map_private=True, threads=threads)
    bench_load.touch_every_page(module)


def read_diffusers(path: Path) -> None:
    import diffusers

    module = diffusers.WanTransformer3DModel.from_pretrained(path, torch_dtype=torch.bfloat16)
    bench_load.touch_every_page(module)


def measure(kind: str, folder: Path, args: argparse.Namespace, workdir: Path) -> dict:
    nbytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    try:
        with storage_kinds.open_storage(kind, folder, workdir=workdir, bandwidth_mbps=args.bandwidth_mbps,
                                        latency_ms=args.latency_ms) as st:
            read_ours(st.path, 1)  # imports warmed up outside the timings
            runs: dict[str, list[float]] = {}
            for _ in range(args.repeats):
                for name, run in [*((f"ours {n} thread(s)", lambda n=n: read_ours(st.path, n))
                                    for n in args.threads), ("diffusers", lambda: read_diffusers(st.path))]:
                    st.prepare()
                    start = time.perf_counter()
                    run()
                    runs.setdefault(name, []).append(time.perf_counter() - start)
            note = st.note
    except storage_kinds.Unavailable as exc:
        return {"storage": kind, "unavailable": str(exc)}
    medians = {name: statistics.median(s) for name, s in runs.items()}
    one = medians[f"ours {args.threads[0]} thread(s)"]
    return {"storage": kind, "note": note, "bytes": nbytes, "seconds": runs, "median_s": medians,
            "gb_per_s": {name: nbytes / 1e9 / s for name, s in medians.items()},
            "speedup_vs_first": {name: one / s for name, s in medians.items() if name.startswith("ours")},
            "vs_diffusers": {name: medians["diffusers"] / s for name, s in medians.items() if name.startswith("ours")}}


def goals(results: list[dict], threads: tuple[int, ...]) -> list[str]:
    lines = []
    default = f"ours {4 if 4 in threads else threads[-1]} thread(s)"
    for r in results:
        if "unavailable" in r:
            lines.append(f"{r['storage']}: not measured ({r['unavailable']})")
            continue
        if r["storage"] == "latency" and default in r["speedup_vs_first"]:
            x = r["speedup_vs_first"][default]
            lines.append(f"latency: {default} {x:.2f}x the 1-thread throughput (goal >= 3x): "
                         f"{'met' if x >= 3 else 'MISSED'}")
        x = r["vs_diffusers"].get(default)
        if x is not None:
            lines.append(f"{r['storage']}: {default} {x:.2f}x diffusers' speed (goal >= 1.0x): "
                         f"{'met' if x >= 1.0 else 'MISSED'}")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--out-dir", type=Path, default=Path(tempfile.gettempdir()) / "vllm-diffusion-bench")
    parser.add_argument("--storage", default="all", help=f"all or a comma list of {', '.join(storage_kinds.KINDS)}")
    parser.add_argument("--threads", default=",".join(map(str, DEFAULT_THREADS)),
                        help="comma list of read thread counts; the first is the baseline")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bandwidth-mbps", type=float, default=200.0, help="the throttled kind's cap")
    parser.add_argument("--latency-ms", type=float, default=4.0, help="the latency kind's delay per read request")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    args.threads = tuple(int(t) for t in args.threads.split(","))
    kinds = storage_kinds.parse_kinds(args.storage)
    folder = bench_load.ensure_checkpoint(args.out_dir, args.size_gb)
    with tempfile.TemporaryDirectory(prefix="storage-", dir=args.out_dir) as workdir:
        results = [measure(kind, folder, args, Path(workdir)) for kind in kinds]
    report = {"checkpoint": str(folder), "results": results, "goals": goals(results, args.threads)}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for r in results:
            if "unavailable" in r:
                print(f"{r['storage']:<10} not measured: {r['unavailable']}")
                continue
            for name, s in r["median_s"].items():
                print(f"{r['storage']:<10} {name:<20} {s:7.2f} s  {r['gb_per_s'][name]:6.2f} GB/s  {r['note']}")
        print("\n".join(report["goals"]))
    return report


if __name__ == "__main__":
    main()
