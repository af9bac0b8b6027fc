"""``vllm-diffusion load`` and ``demo``: the checks before any rank starts, the ranks, a load session on each.

What the CLI alone knows it hands the session: its flags (as ``LoadOptions``), the device each rank resolved, its
ranks (spawned here, or a ``torchrun`` world) and their process group. With ``--save-fused`` the output is written
into a hidden staging folder next to OUT_DIR and renamed into place only after every rank succeeded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from vllm_diffusion_plugin import compat
from vllm_diffusion_plugin.doors.cli import rank_group
from vllm_diffusion_plugin.doors.cli.launcher import run_ranks
from vllm_diffusion_plugin.doors.cli.noise import quiet_third_party
from vllm_diffusion_plugin.doors.cli.output import Staging, check_output_dir
from vllm_diffusion_plugin.doors.cli.planning import PREFLIGHT_HOW, preflight_host
from vllm_diffusion_plugin.doors.cli.rank_server import RANK_IMPORTS, classes_of, rank_starter, take_prestarted
from vllm_diffusion_plugin.engine.session import (
    HSDPConfig,
    LoadOptions,
    LoadSession,
    LoraSpec,
    PickleRefusedError,
    World,
    check_strategy,
    import_diffusers,
    merge_ranks,
    resolve_target_device,
    save_components,
)
from vllm_diffusion_plugin.tiny.models import PIPELINES, build_tiny_model, write_tiny_lora, write_tiny_pipeline


def validate(args: argparse.Namespace, options: LoadOptions, world_size: int) -> list:
    """Every check that needs no weights, in the launching process, before any rank starts; the sources."""
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    HSDPConfig(replicate_size=args.hsdp_replicate_size, shard_size=args.hsdp_shard_size).resolved(world_size)
    if args.save_fused is not None:
        check_output_dir(args.save_fused, flag="--save-fused")
    for specs in swap_sets(args):
        for spec in specs:
            if not spec.path.is_file():
                raise FileNotFoundError(f"--swap-lora: LoRA file {spec.path} does not exist")
    session = LoadSession(options, device=torch.device("cpu"), dtype=getattr(torch, args.dtype),
                          lora_specs=[LoraSpec.parse(text) for text in args.lora])
    try:  # FP8 checkpoints carried, NVFP4, GGUF, torchao, ... refused by name; the LoRA files assigned
        sources = session.resolve(args.checkpoint, components=args.components)
    except PickleRefusedError as exc:
        raise exc.with_how("pass --allow-pickle") from None
    check_strategy(options.hsdp_weight_load, sources=sources, world_size=world_size, sharded=world_size > 1)
    return sources


def run_load(args: argparse.Namespace, options: LoadOptions) -> dict:
    """Run ``load`` with ``args``: in this process under torchrun / for one rank, else on local ranks. Returns the
    merged report (rank 0's view with per-rank figures). Local ranks come from a fork server started first, which
    imports what a rank needs while this process checks the input (``rank_server``)."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc
    local_ranks = not under_torchrun and world_size > 1
    with contextlib.ExitStack() as stack:
        started = time.perf_counter()
        workdir = context = None
        prestarted = take_prestarted()  # as the command started (``rank_server.prestart_for``)
        if prestarted is not None:
            stack.enter_context(prestarted[2])  # closed with this block: the server stopped, the folder removed
        if local_ranks and prestarted is not None:
            workdir, context, _ = prestarted
        elif local_ranks:  # the ranks' work folder; the fork server's files go there too, so it is made first
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vllm-diffusion-ranks-")))
            context = stack.enter_context(rank_starter(workdir, preload=[RANK_IMPORTS],
                                                       server_env=classes_of(args.checkpoint, args.components)))
        sources = validate(args, options, world_size)
        validated = time.perf_counter() - started
        plan = preflight_host(args, options=options, world_size=world_size, under_torchrun=under_torchrun)
        preflight = time.perf_counter() - started - validated
        writes = args.save_fused is not None and (not under_torchrun or os.environ["RANK"] == "0")
        staging = Staging.create(args.save_fused, flag="--save-fused") if writes else None
        try:
            out_dir = staging.path if staging else None
            if workdir is None:
                merged = rank_main(args, options, out_dir=out_dir, plan=plan)
            else:
                starting = run_ranks(spawned_rank, world_size=world_size, workdir=workdir, verbose=args.verbose,
                                     args=(args, options, out_dir, plan), context=context)
                merged = json.loads((workdir / "report.json").read_text())
                # the ranks' imports: the fork server's still under way when the ranks were started, then a rank's own
                merged["seconds"]["imports"] = starting + merged["seconds"].get("imports", 0.0)
            if staging:
                staging.commit(sources, checkpoint=args.checkpoint)
            merged["seconds"] = {"validate": validated, "preflight": preflight, **merged["seconds"]}
            return merged
        finally:
            if staging:
                staging.discard()  # no-op after commit


def spawned_rank(rank: int, world_size: int, workdir: Path, args: argparse.Namespace, options: LoadOptions,
                 out_dir: Path | None, plan=None) -> None:
    """One spawned rank (see ``launcher.run_ranks``): load, and on rank 0 write the merged report."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    merged = rank_main(args, options, out_dir=out_dir, init_method=f"file://{workdir / 'store'}", plan=plan)
    if rank == 0:
        (workdir / "report.json").write_text(json.dumps(merged))


def rank_main(args: argparse.Namespace, options: LoadOptions, *, out_dir: Path | None, init_method: str | None = None,
              plan=None) -> dict:
    """This rank's load session (``plan``: the launcher's pre-flight plan, held against this rank's accelerator
    before the rank joins its group)."""
    import_diffusers()  # a spawned rank's first: without what a load never uses
    quiet_third_party(verbose=args.verbose)
    compat.configure_vllm_logging()
    quiet_third_party(verbose=args.verbose)  # vLLM's configuration replaced the handlers
    device = resolve_target_device(args.device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    session = LoadSession(options, device=device, dtype=getattr(torch, args.dtype),
                          hsdp=(HSDPConfig(replicate_size=args.hsdp_replicate_size, shard_size=args.hsdp_shard_size)
                                if world_size > 1 else None),
                          lora_specs=[LoraSpec.parse(text, default_scale=args.lora_scale) for text in args.lora],
                          progress=not args.json and sys.stderr.isatty(),
                          world=_world(world_size))
    session.preflight(plan, how=PREFLIGHT_HOW)
    started_dist = world_size > 1 and not dist.is_initialized()
    if started_dist:
        rank_group.join(device, collective_timeout_s=options.collective_timeout_s,
                        read_timeout_s=options.read_timeout_s, init_method=init_method)
    bound = options.collective_timeout_s
    try:
        with rank_group.collectives(f"a collective of the load of {args.checkpoint}", timeout_s=bound):
            loaded = session.load_all(args.checkpoint, components=args.components)
        swaps = []
        for specs in swap_sets(args):
            with rank_group.collectives("a collective of a LoRA swap", timeout_s=bound):
                if world_size > 1:
                    dist.barrier()  # timed from when every rank is there, as a server's ranks get the request
                swaps.append(session.swap_loras(specs).as_dict())
        if args.save_fused is not None:  # every rank takes part in the gathers; rank 0 writes
            with rank_group.collectives("the all-gather of the sharded parameters for --save-fused", timeout_s=bound):
                save_components(loaded, out_dir)
        reports = [loaded.report]
        if world_size > 1:
            gathered = [None] * world_size if dist.get_rank() == 0 else None
            with rank_group.collectives("the gather of the ranks' load reports", timeout_s=bound):
                dist.gather_object(loaded.report, gathered, dst=0)
            reports = gathered or reports
        return {**merge_ranks(reports), "swaps": swaps} if swaps else merge_ranks(reports)
    finally:
        if started_dist:
            dist.destroy_process_group()


def swap_sets(args: argparse.Namespace) -> list[list[LoraSpec]]:
    """The LoRA sets of ``--swap-lora``, in order: comma-separated ``[COMPONENT=]PATH[@SCALE]`` entries (``none``: no
    LoRA), scales multiplied by ``--lora-scale`` as ``--lora`` s are."""
    return [[] if text.strip().lower() in ("", "none") else
            [LoraSpec.parse(entry.strip(), default_scale=args.lora_scale) for entry in text.split(",") if entry.strip()]
            for text in getattr(args, "swap_lora", [])]


def _world(world_size: int) -> World:
    """This rank's place before it joins its group (``RANK``, ``WORLD_SIZE``: the launcher's or torchrun's)."""
    return World(int(os.environ.get("RANK", "0")), world_size)


def write_demo(root: Path) -> tuple[Path, list[str]]:
    """The demo's tiny Wan2.2-style pipeline (two transformers, several shards each) and one LoRA per transformer."""
    checkpoint = write_tiny_pipeline(root / "Wan2.2-tiny", "wan")
    loras = [str(write_tiny_lora(root / f"lora_{name}.safetensors", build_tiny_model("wan", seed=i), seed=i))
             for i, name in enumerate(PIPELINES["wan"][2])]
    return checkpoint, loras
