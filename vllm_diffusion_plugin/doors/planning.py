"""``vllm-diffusion plan``: the flags of ``load`` turned into ``engine.plan.plan_load``, printed as a table or JSON.

The world is ``--nproc`` ranks (or ``WORLD_SIZE`` under torchrun); nothing is spawned and no weight byte is read.
"""

from __future__ import annotations

import argparse
import json
import os

from vllm_diffusion_plugin.engine.report import human_count


def host_memory_total() -> int:
    """This machine's total RAM in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory_total(device) -> int | None:
    """Total memory of ``device`` as its torch backend reports it; None on the CPU or when it cannot say."""
    import torch

    if device.type == "cpu":
        return None
    backend = getattr(torch, device.type, None)
    for probe in ("mem_get_info", "get_device_properties"):
        fn = getattr(backend, probe, None)
        try:
            found = fn(device) if fn is not None else None
        except Exception:  # a backend without the call (the fake accelerator)
            continue
        total = found[1] if isinstance(found, tuple) else getattr(found, "total_memory", None)
        if total:
            return int(total)
    return None


def add_plan_parser(sub, *, shared, formatter) -> None:
    """The ``plan`` subcommand on ``sub``: ``shared(parser)`` adds the options it shares with ``load``."""
    plan = sub.add_parser("plan", help="say from headers and meta skeletons what each rank of a load would read "
                                       "and hold, per strategy (reads no weight byte)", formatter_class=formatter)
    plan.add_argument("checkpoint", help="diffusers pipeline folder or component folder")
    shared(plan)
    plan.add_argument("--host-memory", metavar="SIZE", help="host memory per node (64GiB, 80GB, bytes); "
                                                            "default: this machine's total RAM")
    plan.add_argument("--device-memory", metavar="SIZE", help="memory per accelerator; default: the probed "
                                                              "accelerator's (none on the CPU)")


def run_plan(args: argparse.Namespace, *, options) -> str:
    """The plan for ``args`` (the ``plan`` subcommand's flags), as the text the command prints."""
    import torch

    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.pipeline import LoraSpec, resolve_target_device
    from vllm_diffusion_plugin.engine.plan import parse_size, plan_load

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    world_size = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else args.nproc
    hsdp = HSDPConfig(replicate_size=args.hsdp_replicate_size, shard_size=args.hsdp_shard_size)
    hsdp.resolved(world_size)
    device = resolve_target_device(args.device)
    host = parse_size(args.host_memory) if args.host_memory else host_memory_total()
    dev = parse_size(args.device_memory) if args.device_memory else device_memory_total(device)
    plan = plan_load(args.checkpoint, options=options, components=args.components,
                     lora_specs=[LoraSpec.parse(t, default_scale=args.lora_scale) for t in args.lora],
                     world_size=world_size, hsdp=hsdp, dtype=getattr(torch, args.dtype), device_type=device.type,
                     host_memory=host, device_memory=dev if device.type != "cpu" else None)
    data = plan.to_dict()
    data["requested"] = options.hsdp_weight_load
    return json.dumps(data, indent=2) if args.json else format_plan(plan, requested=options.hsdp_weight_load)


def _size(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{human_count(n)}B"


def format_plan(plan, *, requested: str) -> str:
    """The plan as a table: one row per strategy and rank, then one per component; fit and pick last."""
    layout = f"HSDP {plan.layout[0]}x{plan.layout[1]}" if plan.layout else "1 process"
    lines = [f"plan for {plan.checkpoint}: {plan.world_size} rank(s), {layout}, {plan.dtype} on {plan.device_type}"
             f" (reads no weight byte; the CLI load, diffusers DiTs)",
             f"{'strategy':<12}{'rank':>5}{'read':>12}{'held':>12}{'host peak':>12}{'device peak':>13}"
             f"{'first run':>12}  largest transient"]
    for r in plan.ranks:
        runs = r.strategy if r.runs == r.strategy else f"{r.strategy}>{r.runs}"
        top = max(r.components, key=lambda c: c.transient_bytes)
        lines.append(f"{runs:<12}{r.rank:>5}{_size(r.bytes_read):>12}{_size(sum(c.held for c in r.components)):>12}"
                     f"{_size(r.host_peak):>12}{_size(r.device_peak):>13}{_size(r.first_run_peak):>12}  "
                     f"{top.transient} {_size(top.transient_bytes)}")
        for c in r.components:
            lines.append(f"{'  ' + c.name:<17}{_size(c.bytes_read):>12}{_size(c.held):>12}{_size(c.peak):>12}")
    for strategy, why in plan.unavailable.items():
        lines.append(f"{strategy}: unavailable: {why}")
    fits = {s: plan.fits(s) for s in ("full", "broadcast", "rank_local") if s not in plan.unavailable}
    limits = f"host {_size(plan.host_memory)}, device {_size(plan.device_memory)}"
    lines.append(f"fits ({limits}): " + ", ".join(f"{s} {'yes' if ok else 'no'}" for s, ok in fits.items()))
    pick = plan.pick()
    lines.append(f"pick: {pick or 'none fits'} (requested: {requested})")
    return "\n".join(lines)
