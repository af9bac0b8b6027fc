"""``vllm-diffusion plan``: the flags of ``load`` turned into ``engine.plan.plan_load``, printed as a table or JSON.

The world is ``--nproc`` ranks (or ``WORLD_SIZE`` under torchrun); nothing is spawned and no weight byte is read.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from vllm_diffusion_plugin.engine.session import (
    HSDPConfig,
    LoraSpec,
    accelerator_type,
    check_plan,
    plan_load,
    private_rss,
    resolve_target_device,
    size_text,
)


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


def parse_size(text: str) -> int:
    """Bytes from ``64GiB`` / ``80GB`` / ``512MiB`` / ``1e9`` / a plain integer; ValueError naming the text."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abgikmt")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value < 0:
        raise ValueError(f"memory size {text!r}: expected a number with an optional unit "
                         f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 64GiB")
    return int(value * units[unit])


def run_plan(args: argparse.Namespace, *, options) -> str:
    """The plan for ``args`` (the ``plan`` subcommand's flags), as the text the command prints."""
    import torch

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun else world_size
    hsdp = HSDPConfig(replicate_size=args.hsdp_replicate_size, shard_size=args.hsdp_shard_size)
    hsdp.resolved(world_size)
    device = resolve_target_device(args.device)
    host = parse_size(args.host_memory) if args.host_memory else host_memory_total()
    dev = parse_size(args.device_memory) if args.device_memory else device_memory_total(device)
    plan = plan_load(args.checkpoint, options=options, components=args.components,
                     lora_specs=[LoraSpec.parse(t, default_scale=args.lora_scale) for t in args.lora],
                     world_size=world_size, hsdp=hsdp, dtype=getattr(torch, args.dtype), device_type=device.type,
                     host_memory=host, device_memory=dev if device.type != "cpu" else None,
                     local_world_size=local_world_size)
    data = plan.to_dict()
    data["requested"] = options.hsdp_weight_load
    if args.json:
        return json.dumps(data, indent=2)
    if getattr(args, "per_rank", False):
        return format_plan(plan, requested=options.hsdp_weight_load)
    return format_summary(plan, requested=options.hsdp_weight_load)


def _header(plan) -> str:
    layout = f"HSDP {plan.layout[0]}x{plan.layout[1]}" if plan.layout else "1 process"
    return (f"plan for {plan.checkpoint}: {plan.world_size} rank(s), {layout}, {plan.dtype} on {plan.device_type}"
            f" (reads no weight byte; the CLI load, diffusers DiTs)")


def _verdict(plan, *, requested: str) -> list[str]:
    """The lines ``plan`` ends with (both layouts): what fits under which limits, and the pick."""
    lines = [f"{strategy}: unavailable: {why}" for strategy, why in plan.unavailable.items()]
    fits = {s: plan.fits(s) for s in ("full", "broadcast", "rank_local") if s not in plan.unavailable}
    per_node = plan.local_world_size or plan.world_size
    shared = f" shared by {per_node} ranks" if per_node > 1 else ""
    limits = f"host {size_text(plan.host_memory)}{shared}, device {size_text(plan.device_memory)}"
    lines.append(f"fits ({limits}): " + ", ".join(f"{s} {'yes' if ok else 'no'}" for s, ok in fits.items()))
    pick = plan.pick()
    lines.append(f"pick: {pick or 'none fits'} (requested: {requested})")
    swap = plan.summary(requested)
    if swap is not None and swap["swap_peak"]:
        lines.append(f"a LoRA swap to a set like this one (--swap-lora): {size_text(swap['swap_peak'])} per rank "
                     f"beyond the loaded model ({requested})")
    return lines


def format_summary(plan, *, requested: str) -> str:
    """The plan in a few lines whatever the rank count: per strategy its worst rank's figures (each the largest
    over its ranks), what one node's ranks need of its host together and whether it fits; the verdict last."""
    lines = [_header(plan),
             f"{'strategy':<12}{'read':>12}{'held':>12}{'host peak':>12}{'device peak':>13}{'first run':>12}"
             f"{'node host':>12}  fits   (per rank: the largest over ranks; --per-rank: every rank)"]
    for strategy in ("full", "broadcast", "rank_local"):
        row = plan.summary(strategy)
        if row is None:
            continue
        name = strategy if row["runs"] == strategy else f"{strategy}>{row['runs']}"
        fits = {True: "yes", False: "no", None: "-"}[row["fits"]]
        lines.append(f"{name:<12}{size_text(row['bytes_read']):>12}{size_text(row['held']):>12}"
                     f"{size_text(row['host_peak']):>12}{size_text(row['device_peak']):>13}{size_text(row['first_run_peak']):>12}"
                     f"{size_text(row['node_host_need']):>12}  {fits}")
    return "\n".join(lines + _verdict(plan, requested=requested))


def format_plan(plan, *, requested: str) -> str:
    """The plan as a table (``--per-rank``): one row per strategy and rank, then one per component; fit and pick
    last."""
    lines = [_header(plan),
             f"{'strategy':<12}{'rank':>5}{'read':>12}{'held':>12}{'host peak':>12}{'device peak':>13}"
             f"{'first run':>12}  largest transient"]
    for r in plan.ranks:
        runs = r.strategy if r.runs == r.strategy else f"{r.strategy}>{r.runs}"
        top = max(r.components, key=lambda c: c.transient_bytes)
        lines.append(f"{runs:<12}{r.rank:>5}{size_text(r.bytes_read):>12}{size_text(sum(c.held for c in r.components)):>12}"
                     f"{size_text(r.host_peak):>12}{size_text(r.device_peak):>13}{size_text(r.first_run_peak):>12}  "
                     f"{top.transient} {size_text(top.transient_bytes)}")
        for c in r.components:
            lines.append(f"{'  ' + c.name:<17}{size_text(c.bytes_read):>12}{size_text(c.held):>12}{size_text(c.peak):>12}")
    return "\n".join(lines + _verdict(plan, requested=requested))


PREFLIGHT_HOW = "--preflight warn (or VLLM_DIFFUSION_PREFLIGHT=warn)"
"""How a ``load`` user turns the pre-flight's refusal into a warning (named in the refusal)."""


def preflight_host(args: argparse.Namespace, *, options, world_size: int, under_torchrun: bool):
    """``load``'s pre-flight for the host, in the launching process before any rank starts: the plan of this load
    against what this node has left, its ranks' host needs together plus, for ranks still to be spawned, what each
    takes before its load (this process's private RSS now: the same imports). Returns the plan for the ranks'
    device check (None with ``preflight`` off)."""
    if options.preflight == "off":
        return None
    device_type = args.device if args.device != "auto" else accelerator_type() or "cpu"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) if under_torchrun else world_size
    plan = plan_load(args.checkpoint, options=options, components=args.components,
                     lora_specs=[LoraSpec.parse(t, default_scale=args.lora_scale) for t in args.lora],
                     world_size=world_size, dtype=getattr(torch, args.dtype), device_type=device_type,
                     hsdp=HSDPConfig(replicate_size=args.hsdp_replicate_size, shard_size=args.hsdp_shard_size),
                     local_world_size=local, lora_headers_only=True)
    spawned = not under_torchrun and world_size > 1
    check_plan(plan, options.hsdp_weight_load, mode=options.preflight, how=PREFLIGHT_HOW, host=True,
               starting=world_size * private_rss() if spawned else 0, first_run=False)
    return plan
