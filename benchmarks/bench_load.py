"""Weight-loading throughput, as ratios measured in one run: our path vs the raw floor vs diffusers.

The checkpoint is a real ``WanTransformer3DModel`` at Wan2.2-A14B width (5120 hidden, 40x128 heads, 13824
FFN), with as many blocks as ``--size-gb`` needs, bf16, saved in several safetensors shards with an index.
It is generated once (seeded random weights, no random *init*: built with ``build_component``) and cached
in ``--out-dir``. Each measurement runs ``--repeats`` times after the page cache is warmed:

  (a) floor       raw ``safe_open().get_tensor`` -> ``param.copy_`` into a preallocated module (onto an accelerator:
                  the naive pageable copy, the speed loads ran at before the staging ring)
  (b1) ours        ``load_into_module(module, source=...)`` (validation + iterate_weights) into the same module;
                  onto an accelerator through ``staging.DeviceStaging`` (pinned ring, copy stream, ``--read-threads``)
  (b2) ours e2e    ``build_component`` (meta skeleton, uninitialized storage) + ``load_into_module`` (on the CPU
                  with ``map_private``, as the pipeline: weights view a copy-on-write mapping of the file; onto
                  an accelerator built there and filled through the ring, as the pipeline's ``full`` does)
  (c) diffusers   ``WanTransformer3DModel.from_pretrained(folder, torch_dtype=bfloat16)``, then ``.to(device)``
                  for an accelerator; on CPU also (c') with every parameter page touched once afterwards: with
                  accelerate installed, diffusers maps the safetensors pages into the parameters without copying,
                  so (c) alone has not read the bytes yet -- (c') is what a consumer of the weights pays.

Goals: on the CPU (b1) throughput >= 0.8x the floor; on an accelerator (b1) >= 4x the naive pageable copy (a) and
(c) takes >= 3x as long as (b2) (on the CPU both map the file and copy nothing, so that goal is not set there).
``--fresh`` (CPU) adds build + read
in fresh processes (``FRESH``): ours, as the pipeline loads (copy-on-write mapped weights), no slower than
diffusers ``from_pretrained``, untouched and with every page touched afterwards.

    python benchmarks/bench_load.py [--size-gb 2] [--out-dir /tmp/vllm-diffusion-bench] [--repeats 3]
                                    [--device cpu|cuda|npu|...] [--read-threads 4] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from types import MappingProxyType

import torch

WIDE_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                   out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
TINY_CONFIG = dict(WIDE_CONFIG, num_attention_heads=2, attention_head_dim=64, text_dim=128, ffn_dim=256)
"""``--tiny``: the same model family 40x narrower, to check the plumbing (``gpu_proof.py --cpu-check``)."""
DTYPE = torch.bfloat16


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _config(num_layers: int, base: dict) -> dict:
    import diffusers

    return {"_class_name": "WanTransformer3DModel", "_diffusers_version": diffusers.__version__,
            **base, "num_layers": num_layers}


def _meta_bytes(num_layers: int, base: dict) -> int:
    from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource
    from vllm_diffusion_plugin.engine.skeleton import build_component

    src = ComponentSource(name="probe", folder=Path("."), files=(), format="safetensors", index=None,
                          config=MappingProxyType(_config(num_layers, base)))
    return sum(p.numel() * 2 for p in build_component(src, dtype=DTYPE, device="meta").parameters())


def ensure_checkpoint(out_dir: Path, size_gb: float, base: dict = WIDE_CONFIG) -> Path:
    """The cached component folder for ``size_gb`` (generated on first use)."""
    from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource
    from vllm_diffusion_plugin.engine.skeleton import build_component
    from vllm_diffusion_plugin.engine.save import save_component

    first, per_layer = _meta_bytes(1, base), _meta_bytes(2, base) - _meta_bytes(1, base)
    num_layers = max(1, math.ceil((size_gb * 1e9 - (first - per_layer)) / per_layer))
    width = base["num_attention_heads"] * base["attention_head_dim"]
    folder = out_dir / f"wan-{width}-{num_layers}L-bf16" / "transformer"
    if (folder / "config.json").is_file():
        return folder
    _log(f"generating a {num_layers}-block {width}-wide WanTransformer3DModel checkpoint "
         f"(~{(first + (num_layers - 1) * per_layer) / 1e9:.2f} GB) in {folder} ...")
    config = _config(num_layers, base)
    src = ComponentSource(name="transformer", folder=folder, files=(), format="safetensors", index=None,
                          config=MappingProxyType(config))
    module = build_component(src, dtype=DTYPE, device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, 0.02, generator=gen)
    shard = max(p.numel() * p.element_size() for p in module.parameters())
    save_component(module, config, folder, max_shard_size=max(shard, int(0.6e9)))
    del module
    gc.collect()
    return folder


def warm_page_cache(files) -> None:
    for file in files:
        with open(file, "rb") as f:
            while f.read(64 << 20):
                pass


def floor_load(module: torch.nn.Module, source) -> None:
    from safetensors import safe_open

    params = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for file in source.files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    params[key].data.copy_(f.get_tensor(key))


def touch_every_page(module: torch.nn.Module) -> float:
    """Read one element per 4 KiB page of every parameter (forces lazily mapped weights in), on one intra-op
    thread: the page faults are what is measured, for every variant alike, not the wake-ups of a thread pool
    whose other thread may be descheduled on a busy 2-core host (that made the touched figures vary 10x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        total = 0.0
        for param in module.parameters():
            flat = param.detach().view(-1)
            total += float(flat[:: max(1, 4096 // param.element_size())].float().sum())
        return total
    finally:
        torch.set_num_threads(threads)


def timed(fn, repeats: int, device: torch.device) -> list[float]:
    from vllm_diffusion_plugin.engine.platform import empty_cache, synchronize

    times = []
    for _ in range(repeats):
        gc.collect()
        empty_cache(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


FRESH = ("ours_mapped", "ours_mapped_touched", "ours_copied", "diffusers", "diffusers_touched", "safetensors_load_file")
"""``--fresh`` (CPU): each variant resolves, builds + reads the checkpoint in a fresh process (imports done before the
clock starts; warm page cache). ``ours_mapped`` is what the pipeline does (``map_private``: weights view a copy-on-write
mapping), ``ours_copied`` copies into fresh storage; ``*_touched`` reads one element per page afterwards (one
thread)."""


def fresh_child(variant: str, folder: Path) -> float:
    import diffusers
    from safetensors.torch import load_file

    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_component
    from vllm_diffusion_plugin.engine.skeleton import build_component
    from vllm_diffusion_plugin.engine.weights import load_into_module

    diffusers.WanTransformer3DModel  # diffusers imports its model classes lazily: not timed
    start = time.perf_counter()
    source = resolve_component(folder)  # timed: diffusers' from_pretrained reads its config and index too
    if variant.startswith("ours"):
        module = build_component(source, dtype=DTYPE, device="cpu")
        load_into_module(module, source=source, progress=False, map_private=variant.startswith("ours_mapped"))
    elif variant.startswith("diffusers"):
        module = diffusers.WanTransformer3DModel.from_pretrained(folder, torch_dtype=DTYPE)
    else:
        for file in source.files:
            load_file(file)
        return time.perf_counter() - start
    if variant.endswith("touched"):
        touch_every_page(module)
    return time.perf_counter() - start


def fresh_runs(folder: Path, repeats: int) -> dict[str, list[float]]:
    import subprocess

    times: dict[str, list[float]] = {v: [] for v in FRESH}
    for r in range(repeats):
        # round-robin, rotated each round: load from other processes hits every variant alike, and no variant
        # always follows the same one (one that just freed 2.6 GB slowed the next one's page faults up to 6x)
        for variant in FRESH[r % len(FRESH):] + FRESH[:r % len(FRESH)]:
            done = subprocess.run([sys.executable, __file__, "--child", variant, "--out-dir", str(folder)],
                                  capture_output=True, text=True, check=True)
            times[variant].append(float(done.stdout.strip().splitlines()[-1]))
    return times


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/vllm-diffusion-bench"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the module lives: cpu (default), cuda, npu ...")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--read-threads", type=int, default=4, help="read threads of ours (the load's default: 4)")
    parser.add_argument("--tiny", action="store_true", help="a 128-wide model of --size-gb (default 0.01 GB)")
    parser.add_argument("--fresh", action="store_true", help="CPU: also build + read in fresh processes (FRESH)")
    parser.add_argument("--child", choices=FRESH, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if args.child:  # one fresh-process measurement; --out-dir is the component folder here
        print(fresh_child(args.child, args.out_dir))
        return {}
    device = torch.device(args.device)

    import diffusers

    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_component
    from vllm_diffusion_plugin.engine.io.staging import DeviceStaging
    from vllm_diffusion_plugin.engine.skeleton import build_component
    from vllm_diffusion_plugin.engine.weights import load_into_module

    if args.tiny:
        folder = ensure_checkpoint(args.out_dir, args.size_gb if args.size_gb != 2.0 else 0.01, TINY_CONFIG)
    else:
        folder = ensure_checkpoint(args.out_dir, args.size_gb)
    source = resolve_component(folder)
    total = source.total_bytes
    _log(f"checkpoint: {folder} ({len(source.files)} shards, {len(source.tensors)} tensors, {total / 1e9:.2f} GB)")
    warm_page_cache(source.files)

    staging = DeviceStaging.open(device, threads=args.read_threads)  # None on the CPU
    ours = dict(progress=False, threads=args.read_threads, staging=staging)

    def preallocated_runs() -> dict[str, list[float]]:
        module = build_component(source, dtype=DTYPE, device=device)
        floor_load(module, source)  # touches every page of the preallocated module once
        return {"floor": timed(lambda: floor_load(module, source), args.repeats, device),
                "ours_preallocated": timed(lambda: load_into_module(module, source=source, **ours),
                                           args.repeats, device)}

    results = preallocated_runs()
    gc.collect()

    def ours_e2e():  # as the pipeline loads: on the CPU, weights view a copy-on-write mapping of the file
        fresh = build_component(source, dtype=DTYPE, device=device)
        load_into_module(fresh, source=source, map_private=device.type == "cpu", **ours)

    def diffusers_load(touch: bool):
        model = diffusers.WanTransformer3DModel.from_pretrained(folder, torch_dtype=DTYPE)
        if device.type != "cpu":
            model.to(device)
        elif touch:
            touch_every_page(model)

    results["ours_build_and_load"] = timed(ours_e2e, args.repeats, device)
    results["diffusers_from_pretrained"] = timed(lambda: diffusers_load(False), args.repeats, device)
    if device.type == "cpu":
        results["diffusers_from_pretrained_touched"] = timed(lambda: diffusers_load(True), args.repeats, device)

    if args.fresh and device.type == "cpu":
        results.update({f"fresh {name}": t for name, t in fresh_runs(folder, args.repeats).items()})
    summary = {name: {"best_s": min(t), "median_s": statistics.median(t), "runs_s": t,
                      "gb_per_s_best": total / 1e9 / min(t)} for name, t in results.items()}
    med = {name: s["median_s"] for name, s in summary.items()}
    ratios = {
        "ours_preallocated_vs_floor_throughput": med["floor"] / med["ours_preallocated"],
        "diffusers_vs_ours_build_and_load_time": med["diffusers_from_pretrained"] / med["ours_build_and_load"],
        "diffusers_vs_ours_preallocated_time": med["diffusers_from_pretrained"] / med["ours_preallocated"],
    }
    if "diffusers_from_pretrained_touched" in med:
        ratios["diffusers_touched_vs_ours_build_and_load_time"] = (med["diffusers_from_pretrained_touched"]
                                                                  / med["ours_build_and_load"])
    if "fresh ours_mapped" in med:
        ratios["fresh: diffusers vs ours (mapped) build+read time"] = med["fresh diffusers"] / med["fresh ours_mapped"]
        ratios["fresh: diffusers vs ours (mapped), both touched"] = (med["fresh diffusers_touched"]
                                                                     / med["fresh ours_mapped_touched"])
        ratios["fresh: ours copied vs ours mapped time"] = med["fresh ours_copied"] / med["fresh ours_mapped"]
    if device.type == "cpu":  # both map the file and copy nothing there: the --fresh goal is the CPU's
        goals = {"ours >= 0.8x floor": ratios["ours_preallocated_vs_floor_throughput"] >= 0.8}
    else:
        goals = {"ours >= 4x the naive pageable copy": ratios["ours_preallocated_vs_floor_throughput"] >= 4.0,
                 "diffusers >= 3x slower than ours (build+load)":
                     ratios["diffusers_vs_ours_build_and_load_time"] >= 3.0}
    if "fresh ours_mapped" in med:
        goals["fresh: ours (mapped) no slower than diffusers (untouched and touched)"] = (
            ratios["fresh: diffusers vs ours (mapped) build+read time"] >= 1.0
            and ratios["fresh: diffusers vs ours (mapped), both touched"] >= 1.0)
    report = {"checkpoint": str(folder), "device": str(device), "bytes": total, "shards": len(source.files),
              "read_threads": args.read_threads, "staging": None if staging is None else
              {"slots": len(staging._buffers), "slot_bytes": staging.slot_bytes},
              "tensors": len(source.tensors), "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
              "timings": summary, "ratios (medians)": ratios, "goals": goals,
              "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{total / 1e9:.2f} GB, {len(source.files)} shards, on {device}, {args.repeats} runs each "
              f"(median / best):")
        for name, s in summary.items():
            print(f"  {name:34s} {s['median_s']:7.3f} s / {s['best_s']:7.3f} s  ({s['gb_per_s_best']:6.2f} GB/s best)")
        for name, value in ratios.items():
            print(f"  {name:48s} {value:6.2f}x")
        for name, ok in goals.items():
            print(f"  goal {name:48s} {'PASS' if ok else 'FAIL'}")
        print(f"  peak RSS {report['peak_rss_gb']:.2f} GB")
    return report


if __name__ == "__main__":
    main()
