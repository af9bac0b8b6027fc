"""``vllm-diffusion``: load a diffusers checkpoint's DiTs on N local ranks and report, or run the demo.

    vllm-diffusion load DIR [--component NAME]... [--lora [COMPONENT=]PATH[@SCALE]]... [--lora-scale F]
                            [--nproc N] [--hsdp-shard-size S] [--hsdp-replicate-size R]
                            [--device auto|cpu|cuda|npu] [--dtype bfloat16|float16|float32]
                            [--hsdp-weight-load full|broadcast|rank_local] [--save-fused OUT_DIR] [--json]
    vllm-diffusion demo [--nproc N] [--json] [--keep DIR]

Started under ``torchrun`` (RANK and WORLD_SIZE set) the command uses that world as is; otherwise
``--nproc N`` spawns N local ranks (gloo on CPU, nccl/hccl on accelerators). With more than one rank the
transformers are sharded with HSDP over a (replicate, shard) mesh.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-diffusion", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    load = sub.add_parser("load", help="load a diffusers checkpoint's DiT(s) and report")
    load.add_argument("checkpoint", help="diffusers pipeline folder, component folder, or hub id")
    _add_load_options(load)

    demo = sub.add_parser("demo", help="build a tiny Wan2.2-style checkpoint + LoRA locally and load it")
    demo.add_argument("--nproc", type=int, default=1, help="local ranks to spawn (HSDP when > 1)")
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    demo.add_argument("--keep", type=Path, help="write the demo checkpoint here and keep it")
    return parser


def _add_load_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--component", action="append", dest="components", metavar="NAME",
                   help="component to load (repeatable; default: the pipeline's transformers)")
    p.add_argument("--lora", action="append", default=[], metavar="[COMPONENT=]PATH[@SCALE]",
                   help="LoRA file to fuse (repeatable; one per transformer is matched by position)")
    p.add_argument("--lora-scale", type=float, default=1.0, help="multiplier on every LoRA (default 1.0)")
    p.add_argument("--nproc", type=int, default=1, help="local ranks to spawn (ignored under torchrun)")
    p.add_argument("--hsdp-shard-size", type=int, default=-1, help="HSDP shard size S (-1: world / R)")
    p.add_argument("--hsdp-replicate-size", type=int, default=1, help="HSDP replicate size R")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--hsdp-weight-load", choices=("full", "broadcast", "rank_local"), default=None,
                   help="how ranks get their weights: each reads all (full), rank 0 reads and broadcasts, or each "
                        "reads only its own shard rows (rank_local); default: VLLM_DIFFUSION_HSDP_WEIGHT_LOAD or full")
    p.add_argument("--save-fused", type=Path, metavar="OUT_DIR",
                   help="write each loaded component (fused, gathered) as a diffusers folder under OUT_DIR")
    p.add_argument("--allow-pickle", action="store_true", help="accept .bin/.pt weights")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _options(args: argparse.Namespace):
    """LoadOptions from the flags; keys without a flag fall back to their VLLM_DIFFUSION_* variables."""
    from vllm_diffusion_plugin.engine.config import LoadOptions

    extra = {"lora_scale": args.lora_scale}
    if args.allow_pickle:  # unset: VLLM_DIFFUSION_ALLOW_PICKLE decides
        extra["allow_pickle"] = True
    if args.hsdp_weight_load is not None:
        extra["hsdp_weight_load"] = args.hsdp_weight_load
    return LoadOptions.from_extra_config(extra)


def _validate(args: argparse.Namespace, world_size: int) -> None:
    """Every check that needs no weights, in the launching process, before any rank starts."""
    from vllm_diffusion_plugin.engine.checkpoint import is_transformer, resolve_checkpoint
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.pipeline import LoraSpec, assign_loras
    from vllm_diffusion_plugin.engine.strategies import check_strategy

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    HSDPConfig(replicate_size=args.hsdp_replicate_size, shard_size=args.hsdp_shard_size).resolved(world_size)
    if args.save_fused is not None and args.save_fused.exists() and any(args.save_fused.iterdir()):
        raise FileExistsError(f"--save-fused {args.save_fused} exists and is not empty")
    options = _options(args)
    sources = resolve_checkpoint(args.checkpoint, components=args.components, allow_pickle=options.allow_pickle)
    assign_loras([LoraSpec.parse(text) for text in args.lora],
                 [s.name for s in sources if is_transformer(s.name)])
    check_strategy(options.hsdp_weight_load, sources=sources, world_size=world_size,
                   sharded=world_size > 1)


def run_load(args: argparse.Namespace) -> dict:
    """Run ``load`` with ``args``: in this process under torchrun / for one rank, else on spawned ranks.

    Returns the merged report (rank 0's view with per-rank figures).
    """
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc
    _validate(args, world_size)
    if under_torchrun or world_size == 1:
        return _rank_main(args)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "report.json"
        port = _free_port()
        mp.spawn(_spawned_rank, args=(args, world_size, port, result), nprocs=world_size, join=True)
        return json.loads(result.read_text())


def _spawned_rank(rank: int, args: argparse.Namespace, world_size: int, port: int, result: Path) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    merged = _rank_main(args)
    if rank == 0:
        result.write_text(json.dumps(merged))


def _rank_main(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from vllm_diffusion_plugin import compat
    from vllm_diffusion_plugin.engine import platform
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.pipeline import LoraSpec, load_components, resolve_target_device, save_components
    from vllm_diffusion_plugin.engine.report import merge_ranks

    compat.configure_vllm_logging()
    device = resolve_target_device(args.device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    started_dist = False
    if world_size > 1 and not dist.is_initialized():
        if device.type != "cpu":
            getattr(torch, device.type).set_device(device)
        dist.init_process_group(platform.dist_backend(device))
        started_dist = True
    try:
        options = _options(args)
        hsdp = (HSDPConfig(replicate_size=args.hsdp_replicate_size, shard_size=args.hsdp_shard_size)
                if world_size > 1 else None)
        loaded = load_components(
            args.checkpoint, options=options, components=args.components, device=device,
            dtype=getattr(torch, args.dtype), hsdp=hsdp,
            lora_specs=[LoraSpec.parse(text, default_scale=args.lora_scale) for text in args.lora])
        if args.save_fused is not None:
            save_components(loaded, args.save_fused)
        reports = [loaded.report]
        if world_size > 1:
            gathered = [None] * world_size if dist.get_rank() == 0 else None
            dist.gather_object(loaded.report, gathered, dst=0)
            reports = gathered or reports
        return merge_ranks(reports)
    finally:
        if started_dist:
            dist.destroy_process_group()


def run_demo(args: argparse.Namespace) -> dict:
    """Build a tiny Wan2.2-style pipeline (two transformers, several shards each) and one LoRA per
    transformer, then ``load`` it with the LoRAs fused."""
    from vllm_diffusion_plugin.testing.tiny_models import PIPELINES, build_tiny_model, write_tiny_lora, write_tiny_pipeline

    with tempfile.TemporaryDirectory(prefix="vllm-diffusion-demo-") as tmp:
        root = args.keep or Path(tmp)
        checkpoint = write_tiny_pipeline(root / "Wan2.2-tiny", "wan")
        loras = [str(write_tiny_lora(root / f"lora_{name}.safetensors", build_tiny_model("wan", seed=i), seed=i))
                 for i, name in enumerate(PIPELINES["wan"][2])]
        print(f"demo checkpoint: {checkpoint} (+ {len(loras)} LoRA files)", file=sys.stderr)
        load_args = _parser().parse_args(["load", str(checkpoint), "--dtype", "float32", "--device", "cpu",
                                          "--nproc", str(args.nproc), *(f"--lora={p}" for p in loras)])
        return run_load(load_args)


def main(argv: list[str] | None = None) -> int:
    # Logs go to stderr so that --json output on stdout stays parseable.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    args = _parser().parse_args(argv)
    from vllm_diffusion_plugin.engine.report import format_table

    try:
        merged = run_demo(args) if args.command == "demo" else run_load(args)
    except (ValueError, TypeError, OSError, RuntimeError) as exc:
        # Bad input or a failed rank: the message names the file, key or rank; no traceback.
        print(f"vllm-diffusion: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(merged, indent=2) if args.json else format_table(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
