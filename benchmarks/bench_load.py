"""Weight-loading throughput, as ratios measured in one run: our path vs the raw floor vs diffusers.

The checkpoint is a real ``WanTransformer3DModel`` at Wan2.2-A14B width (5120 hidden, 40x128 heads, 13824
FFN), with as many blocks as ``--size-gb`` needs, bf16, saved in several safetensors shards with an index.
It is generated once (seeded random weights, no random *init*: built with ``build_component``) and cached
in ``--out-dir``. Each measurement runs ``--repeats`` times after the page cache is warmed:

  (a) floor       raw ``safe_open().get_tensor`` -> ``param.copy_`` into a preallocated module
  (b1) ours        ``load_into_module(module, source=...)`` (validation + iterate_weights) into the same module
  (b2) ours e2e    ``build_component`` (meta skeleton, uninitialized storage) + ``load_into_module``
  (c) diffusers   ``WanTransformer3DModel.from_pretrained(folder, torch_dtype=bfloat16)``, then ``.to(device)``
                  for an accelerator; on CPU also (c') with every parameter page touched once afterwards: with
                  accelerate installed, diffusers maps the safetensors pages into the parameters without copying,
                  so (c) alone has not read the bytes yet -- (c') is what a consumer of the weights pays.

Goals: (b1) throughput >= 0.8x the floor; (c) takes >= 2x as long as (b2).

    python benchmarks/bench_load.py [--size-gb 2] [--out-dir /tmp/vllm-diffusion-bench] [--repeats 3]
                                    [--device cpu|cuda|npu|...] [--json]
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
DTYPE = torch.bfloat16


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _config(num_layers: int) -> dict:
    import diffusers

    return {"_class_name": "WanTransformer3DModel", "_diffusers_version": diffusers.__version__,
            **WIDE_CONFIG, "num_layers": num_layers}


def _meta_bytes(num_layers: int) -> int:
    from vllm_diffusion_plugin.engine.checkpoint import ComponentSource
    from vllm_diffusion_plugin.engine.skeleton import build_component

    src = ComponentSource(name="probe", folder=Path("."), files=(), format="safetensors", index=None,
                          config=MappingProxyType(_config(num_layers)))
    return sum(p.numel() * 2 for p in build_component(src, dtype=DTYPE, device="meta").parameters())


def ensure_checkpoint(out_dir: Path, size_gb: float) -> Path:
    """The cached component folder for ``size_gb`` (generated on first use)."""
    from vllm_diffusion_plugin.engine.checkpoint import ComponentSource
    from vllm_diffusion_plugin.engine.skeleton import build_component, save_component

    base, per_layer = _meta_bytes(1), _meta_bytes(2) - _meta_bytes(1)
    num_layers = max(1, math.ceil((size_gb * 1e9 - (base - per_layer)) / per_layer))
    folder = out_dir / f"wan-5120-{num_layers}L-bf16" / "transformer"
    if (folder / "config.json").is_file():
        return folder
    _log(f"generating a {num_layers}-block 5120-wide WanTransformer3DModel checkpoint "
         f"(~{(base + (num_layers - 1) * per_layer) / 1e9:.2f} GB) in {folder} ...")
    config = _config(num_layers)
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
    """Read one element per 4 KiB page of every parameter (forces lazily mapped weights in)."""
    total = 0.0
    for param in module.parameters():
        flat = param.detach().view(-1)
        total += float(flat[:: max(1, 4096 // param.element_size())].float().sum())
    return total


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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/vllm-diffusion-bench"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the module lives: cpu (default), cuda, npu ...")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    device = torch.device(args.device)

    import diffusers

    from vllm_diffusion_plugin.engine.checkpoint import resolve_component
    from vllm_diffusion_plugin.engine.skeleton import build_component
    from vllm_diffusion_plugin.engine.weights import load_into_module

    folder = ensure_checkpoint(args.out_dir, args.size_gb)
    source = resolve_component(folder)
    total = source.total_bytes
    _log(f"checkpoint: {folder} ({len(source.files)} shards, {len(source.tensors)} tensors, {total / 1e9:.2f} GB)")
    warm_page_cache(source.files)

    def preallocated_runs() -> dict[str, list[float]]:
        module = build_component(source, dtype=DTYPE, device=device)
        floor_load(module, source)  # touches every page of the preallocated module once
        return {"floor": timed(lambda: floor_load(module, source), args.repeats, device),
                "ours_preallocated": timed(lambda: load_into_module(module, source=source, progress=False),
                                           args.repeats, device)}

    results = preallocated_runs()
    gc.collect()

    def ours_e2e():
        fresh = build_component(source, dtype=DTYPE, device=device)
        load_into_module(fresh, source=source, progress=False)

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
    goals = {"ours >= 0.8x floor": ratios["ours_preallocated_vs_floor_throughput"] >= 0.8,
             "diffusers >= 2x slower than ours (build+load)": ratios["diffusers_vs_ours_build_and_load_time"] >= 2.0}
    report = {"checkpoint": str(folder), "device": str(device), "bytes": total, "shards": len(source.files),
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
