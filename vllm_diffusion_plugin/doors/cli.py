"""``vllm-diffusion``: load a diffusers checkpoint's DiTs on N local ranks and report, or run the demo.

    vllm-diffusion load DIR [--component NAME]... [--lora [COMPONENT=]PATH[@SCALE]]... [--lora-scale F]
                            [--nproc N] [--hsdp-shard-size S] [--hsdp-replicate-size R]
                            [--device auto|cpu|cuda|npu] [--dtype bfloat16|float16|float32]
                            [--hsdp-weight-load full|broadcast|rank_local] [--read-threads N]
                            [--collective-timeout S] [--read-timeout S]
                            [--save-fused OUT_DIR]
                            [--allow-pickle] [--json] [--verbose]
    vllm-diffusion plan DIR [the options of load but --save-fused] [--host-memory SIZE] [--device-memory SIZE]
    vllm-diffusion demo [--nproc N] [--json] [--keep DIR] [--verbose]
    vllm-diffusion demo --serve [--nproc 1|2] [--keep DIR]     (the [omni] extra: a real vllm-omni server)

Started under ``torchrun`` (RANK and WORLD_SIZE set) the command uses that world as is; otherwise
``--nproc N`` spawns N local ranks (gloo on CPU, nccl/hccl on accelerators). With more than one rank the
transformers are sharded with HSDP over a (replicate, shard) mesh.

Whatever the rank count, an error is one line on stderr (exit 1): the launcher collects the first error a
rank raised and stops the others. SIGINT / SIGTERM stop every rank and exit 130 / 143; nothing is written
after the signal (``--save-fused`` output appears only complete, by one rename at the end).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")
CLI_EXTRA_HINT = 'pip install "vllm-diffusion-plugin[cli]"'


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-diffusion", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    formatter = argparse.ArgumentDefaultsHelpFormatter

    load = sub.add_parser("load", help="load a diffusers checkpoint's DiT(s) and report", formatter_class=formatter)
    load.add_argument("checkpoint", help="diffusers pipeline folder, component folder, or hub id (ORG/NAME)")
    _add_load_options(load)

    from vllm_diffusion_plugin.doors.planning import add_plan_parser

    add_plan_parser(sub, shared=_add_shared_options, formatter=formatter)

    demo = sub.add_parser("demo", help="build a tiny Wan2.2-style checkpoint + LoRA locally and load it",
                          formatter_class=formatter)
    demo.add_argument("--nproc", type=int, default=1, help="local ranks to spawn (HSDP when > 1)")
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    demo.add_argument("--keep", type=Path, help="write the demo checkpoint here and keep it")
    demo.add_argument("--verbose", action="store_true",
                      help="show our INFO lines, third-party warnings and the traceback of an error")
    demo.add_argument("--serve", action="store_true",
                      help="serve the tiny Wan2.2 pipeline with `vllm serve --omni --load-format diffusion-hsdp` "
                           "on 127.0.0.1, send one video request, write the mp4 into the working folder, stop "
                           "(needs the [omni] extra)")
    return parser


def _add_load_options(p: argparse.ArgumentParser) -> None:
    _add_shared_options(p)
    p.add_argument("--save-fused", type=Path, metavar="OUT_DIR",
                   help="write the loaded components (fused, gathered) as diffusers folders under OUT_DIR; from "
                        "a pipeline folder, OUT_DIR is a complete pipeline (other components hard-linked or copied)")
    p.add_argument("--preflight", choices=("refuse", "warn", "off"), default=None,
                   help="before any weight is read, hold each rank's planned peak (`plan`) against this node's "
                        "available host memory (MemAvailable, memory cgroup) and its accelerator's free memory: "
                        "refuse a load that cannot fit, warn and load, or off; unset: VLLM_DIFFUSION_PREFLIGHT or "
                        "refuse")


def _add_shared_options(p: argparse.ArgumentParser) -> None:
    """The options ``load`` and ``plan`` share (the same load, run or planned)."""
    p.add_argument("--component", action="append", dest="components", metavar="NAME",
                   help="component to load (repeatable); default: the pipeline's DiTs")
    p.add_argument("--lora", action="append", default=[], metavar="[COMPONENT=]PATH[@SCALE]",
                   help="LoRA file to fuse (repeatable; one per transformer is matched by position)")
    p.add_argument("--lora-scale", type=float, default=1.0, help="multiplier on every LoRA")
    p.add_argument("--nproc", type=int, default=1, help="local ranks to spawn (ignored under torchrun)")
    p.add_argument("--hsdp-shard-size", type=int, default=-1, help="HSDP shard size S (-1: world / R)")
    p.add_argument("--hsdp-replicate-size", type=int, default=1, help="HSDP replicate size R")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto",
                   help="where the loaded modules live; auto: this rank's accelerator if a probe allocation "
                        "on it succeeds, else the CPU")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="parameter dtype of the loaded modules")
    p.add_argument("--hsdp-weight-load", choices=("full", "broadcast", "rank_local"), default=None,
                   help="how ranks get their weights: each reads all (full), rank 0 reads and broadcasts, or each "
                        "reads only its own shard rows (rank_local); unset: VLLM_DIFFUSION_HSDP_WEIGHT_LOAD or full")
    p.add_argument("--read-threads", type=int, default=None, metavar="N",
                   help="threads reading checkpoint bytes ahead of the load (1: one); unset: "
                        "VLLM_DIFFUSION_READ_THREADS or 4")
    p.add_argument("--collective-timeout", type=float, default=None, metavar="S",
                   help="seconds any collective between the ranks may take before the load fails (a rank died or "
                        "stalled); unset: VLLM_DIFFUSION_COLLECTIVE_TIMEOUT_S or 300")
    p.add_argument("--read-timeout", type=float, default=None, metavar="S",
                   help="seconds the load waits for one read of the read threads before failing with the file and "
                        "offset (a store that stopped answering); unset: VLLM_DIFFUSION_READ_TIMEOUT_S or 300")
    p.add_argument("--allow-pickle", action="store_true",
                   help="accept .bin/.pt weights (read with torch.load(weights_only=True)); unset: "
                        "VLLM_DIFFUSION_ALLOW_PICKLE decides")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--verbose", action="store_true", help="show our INFO lines, third-party warnings and the traceback of an error")


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the command; ``code`` is the exit status (130 / 143)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.code = 128 + signum


def _options(args: argparse.Namespace):
    """LoadOptions from the flags; keys without a flag fall back to their VLLM_DIFFUSION_* variables."""
    from vllm_diffusion_plugin.engine.config import LoadOptions

    extra = {"lora_scale": args.lora_scale}
    if args.allow_pickle:  # unset: VLLM_DIFFUSION_ALLOW_PICKLE decides
        extra["allow_pickle"] = True
    if args.hsdp_weight_load is not None:
        extra["hsdp_weight_load"] = args.hsdp_weight_load
    if args.read_threads is not None:
        extra["read_threads"] = args.read_threads
    for key in ("collective_timeout", "read_timeout"):
        if getattr(args, key) is not None:
            extra[f"{key}_s"] = getattr(args, key)
    if getattr(args, "preflight", None) is not None:  # load's flag; plan has none
        extra["preflight"] = args.preflight
    return LoadOptions.from_extra_config(extra)


def _validate(args: argparse.Namespace, world_size: int) -> list:
    """Every check that needs no weights, in the launching process, before any rank starts; the sources."""
    from vllm_diffusion_plugin.doors.output import check_output_dir
    from vllm_diffusion_plugin.engine.checkpoint import PickleRefusedError, is_transformer, resolve_checkpoint
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.pipeline import LoraSpec, assign_loras
    from vllm_diffusion_plugin.engine.prequant import check_sources
    from vllm_diffusion_plugin.engine.strategies import check_strategy

    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    HSDPConfig(replicate_size=args.hsdp_replicate_size, shard_size=args.hsdp_shard_size).resolved(world_size)
    if args.save_fused is not None:
        check_output_dir(args.save_fused, flag="--save-fused")
    options = _options(args)
    try:
        sources = resolve_checkpoint(args.checkpoint, components=args.components, allow_pickle=options.allow_pickle)
    except PickleRefusedError as exc:
        raise exc.with_how("pass --allow-pickle") from None
    check_sources(sources)  # FP8 checkpoints carried; NVFP4, GGUF, torchao, ... refused by name
    assign_loras([LoraSpec.parse(text) for text in args.lora], [s.name for s in sources if is_transformer(s)])
    check_strategy(options.hsdp_weight_load, sources=sources, world_size=world_size, sharded=world_size > 1)
    return sources


def run_load(args: argparse.Namespace) -> dict:
    """Run ``load`` with ``args``: in this process under torchrun / for one rank, else on spawned ranks.

    Returns the merged report (rank 0's view with per-rank figures). With ``--save-fused`` the output is
    written into a hidden staging folder next to OUT_DIR and renamed into place only after every rank
    succeeded; on any failure or interrupt the staging folder is removed.
    """
    from vllm_diffusion_plugin.doors.output import Staging

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc
    started = time.perf_counter()
    sources = _validate(args, world_size)
    validate = time.perf_counter() - started
    from vllm_diffusion_plugin.doors.planning import preflight_host

    plan = preflight_host(args, options=_options(args), world_size=world_size, under_torchrun=under_torchrun)
    preflight = time.perf_counter() - started - validate
    writes = args.save_fused is not None and (not under_torchrun or os.environ["RANK"] == "0")
    staging = Staging.create(args.save_fused, flag="--save-fused") if writes else None
    try:
        out_dir = staging.path if staging else None
        if under_torchrun or world_size == 1:
            merged = _rank_main(args, out_dir=out_dir, plan=plan)
        else:
            merged = _run_spawned(args, world_size, out_dir, plan)
        if staging:
            staging.commit(sources, checkpoint=args.checkpoint)
        merged["seconds"] = {"validate": validate, "preflight": preflight, **merged["seconds"]}
        return merged
    finally:
        if staging:
            staging.discard()  # no-op after commit


def _run_spawned(args: argparse.Namespace, world_size: int, out_dir: Path | None, plan=None) -> dict:
    from vllm_diffusion_plugin.doors.launcher import run_ranks

    with tempfile.TemporaryDirectory(prefix="vllm-diffusion-ranks-") as tmp:
        run_ranks(_spawned_rank, world_size=world_size, workdir=Path(tmp), args=(args, out_dir, plan),
                  verbose=args.verbose)
        return json.loads((Path(tmp) / "report.json").read_text())


def _spawned_rank(rank: int, world_size: int, workdir: Path, args: argparse.Namespace, out_dir: Path | None,
                  plan=None) -> None:
    """One spawned rank (see ``launcher.run_ranks``): load, and on rank 0 write the merged report."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    merged = _rank_main(args, out_dir=out_dir, init_method=f"file://{workdir / 'store'}", plan=plan)
    if rank == 0:
        (workdir / "report.json").write_text(json.dumps(merged))


def _rank_main(args: argparse.Namespace, *, out_dir: Path | None, init_method: str | None = None,
               plan=None) -> dict:
    """This rank's load (``plan``: the launcher's pre-flight plan, held against this rank's accelerator first)."""
    from vllm_diffusion_plugin.doors.noise import quiet_third_party

    quiet_third_party(verbose=args.verbose)
    import torch
    import torch.distributed as dist

    from vllm_diffusion_plugin import compat
    from vllm_diffusion_plugin.doors import rank_group
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.pipeline import LoraSpec, load_components, resolve_target_device, save_components
    from vllm_diffusion_plugin.engine.report import merge_ranks

    compat.configure_vllm_logging()
    quiet_third_party(verbose=args.verbose)  # vLLM's configuration replaced the handlers
    device = resolve_target_device(args.device)
    from vllm_diffusion_plugin.doors.planning import preflight_device

    preflight_device(plan, options=_options(args), device=device, rank=int(os.environ.get("RANK", "0")))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    options = _options(args)
    started_dist = world_size > 1 and not dist.is_initialized()
    if started_dist:
        rank_group.join(device, collective_timeout_s=options.collective_timeout_s,
                        read_timeout_s=options.read_timeout_s, init_method=init_method)
    bound = options.collective_timeout_s
    try:
        hsdp = (HSDPConfig(replicate_size=args.hsdp_replicate_size, shard_size=args.hsdp_shard_size)
                if world_size > 1 else None)
        with rank_group.collectives(f"a collective of the load of {args.checkpoint}", timeout_s=bound):
            loaded = load_components(
                args.checkpoint, options=options, components=args.components, device=device,
                dtype=getattr(torch, args.dtype), hsdp=hsdp, progress=not args.json and sys.stderr.isatty(),
                lora_specs=[LoraSpec.parse(text, default_scale=args.lora_scale) for text in args.lora])
        if args.save_fused is not None:  # every rank takes part in the gathers; rank 0 writes
            with rank_group.collectives("the all-gather of the sharded parameters for --save-fused", timeout_s=bound):
                save_components(loaded, out_dir)
        reports = [loaded.report]
        if world_size > 1:
            gathered = [None] * world_size if dist.get_rank() == 0 else None
            with rank_group.collectives("the gather of the ranks' load reports", timeout_s=bound):
                dist.gather_object(loaded.report, gathered, dst=0)
            reports = gathered or reports
        return merge_ranks(reports)
    finally:
        if started_dist:
            dist.destroy_process_group()


def run_demo(args: argparse.Namespace) -> dict:
    """Build a tiny Wan2.2-style pipeline (two transformers, several shards each) and one LoRA per
    transformer, then ``load`` it with the LoRAs fused."""
    from vllm_diffusion_plugin.tiny.models import PIPELINES, build_tiny_model, write_tiny_lora, write_tiny_pipeline

    with tempfile.TemporaryDirectory(prefix="vllm-diffusion-demo-") as tmp:
        started = time.perf_counter()
        root = args.keep or Path(tmp)
        checkpoint = write_tiny_pipeline(root / "Wan2.2-tiny", "wan")
        loras = [str(write_tiny_lora(root / f"lora_{name}.safetensors", build_tiny_model("wan", seed=i), seed=i))
                 for i, name in enumerate(PIPELINES["wan"][2])]
        written = time.perf_counter() - started
        print(f"demo checkpoint: {checkpoint} (+ {len(loras)} LoRA files)", file=sys.stderr)
        load_args = _parser().parse_args(["load", str(checkpoint), "--dtype", "float32", "--device", "cpu",
                                          "--nproc", str(args.nproc), *(f"--lora={p}" for p in loras),
                                          *(["--json"] if args.json else []),
                                          *(["--verbose"] if args.verbose else [])])
        merged = run_load(load_args)
        merged["seconds"] = {"demo_write": written, **merged["seconds"]}
        return merged


def _missing_cli_extra() -> str | None:
    """One line naming the extra to install when diffusers (which builds every skeleton) is missing."""
    try:
        import diffusers  # noqa: F401
    except ImportError as exc:
        return f"the vllm-diffusion command needs diffusers ({exc}): {CLI_EXTRA_HINT}"
    return None


def _import_named_classes(checkpoint: str, components: list[str] | None) -> None:
    """Import the diffusers classes a local checkpoint names for the components validation will look at (all of
    ``model_index.json``'s, or ``components``; a component folder's ``config.json`` class): validation and the
    skeletons import exactly these anyway -- diffusers' model modules pull in peft, transformers and more, seconds
    on a small host -- so the report shows them as ``imports``, not as ``validate``. Problems are left to
    validation, which names them."""
    import diffusers

    folder = Path(checkpoint)
    try:
        if (folder / "model_index.json").is_file():
            entries = json.loads((folder / "model_index.json").read_text())
            entries = {k: v for k, v in entries.items() if components is None or k in components}
        else:
            entries = {"": ["diffusers", json.loads((folder / "config.json").read_text()).get("_class_name")]}
    except (OSError, ValueError, AttributeError):
        return
    for value in entries.values():
        if isinstance(value, list) and len(value) == 2 and value[0] == "diffusers" and isinstance(value[1], str):
            try:
                getattr(diffusers, value[1])
            except Exception:  # unknown or broken class: validation reports it
                pass


def _process_age() -> float | None:
    """Seconds since this process started (Linux: its start time in ``/proc/self/stat`` against the boot-time
    clock, 10 ms resolution), None where that is not available."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _raise_on_signal(signum, frame):
    raise Interrupted(signum)


def _serve_demo(args: argparse.Namespace) -> int:
    """``demo --serve`` (``doors.serve_demo``): its lines on stdout, an error as one line on stderr."""
    from vllm_diffusion_plugin.doors import serve_demo

    try:
        serve_demo.run(nproc=args.nproc, keep=args.keep, say=lambda line: print(line, flush=True))
        return 0
    except (Interrupted, KeyboardInterrupt, Exception) as exc:  # the server's log tail kept under the message
        return _failed(exc, args, interrupted="the server was stopped, nothing is left running", message=str(exc))


def _failed(exc: BaseException, args: argparse.Namespace, *, interrupted: str, message: str | None = None) -> int:
    """The exit code for ``exc``, said on stderr: 130 / 143 for SIGINT / SIGTERM (``interrupted``: what was
    cleaned up), else 1 with one error line (``message``, default ``launcher.error_line``; a traceback first
    with ``--verbose``)."""
    if isinstance(exc, (Interrupted, KeyboardInterrupt)):
        code = exc.code if isinstance(exc, Interrupted) else 130
        print(f"vllm-diffusion: interrupted ({signal.Signals(code - 128).name}); {interrupted}", file=sys.stderr)
        return code
    if args.verbose:
        import traceback
        traceback.print_exc()
    from vllm_diffusion_plugin.doors.launcher import error_line

    print(f"vllm-diffusion: error: {message if message is not None else error_line(exc)}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """The command (see ``_main``); a caller in the same process (a test) gets our loggers' level back after it."""
    from vllm_diffusion_plugin.doors.noise import OURS

    ours = logging.getLogger(OURS)
    level = ours.level
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the work (the imports take seconds) or after it: the work handles its own
        print("vllm-diffusion: interrupted (SIGINT)", file=sys.stderr)
        return 130
    finally:
        ours.setLevel(level)


def _main(argv: list[str] | None) -> int:
    """The command; the report's ``seconds`` add the launching process's phases to the ranks' (``report.PHASES``):
    ``startup`` (process start to here: the interpreter and the CLI's own imports), ``imports`` (torch, diffusers
    and the diffusers classes the checkpoint names, which a diffusers ``from_pretrained`` needs as well),
    ``demo_write``, ``validate`` and ``wall`` (process start to the report)."""
    started, age = time.perf_counter(), _process_age()
    # Logs go to stderr so that --json output on stdout stays parseable.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    args = _parser().parse_args(argv)
    from vllm_diffusion_plugin.doors.noise import quiet_third_party

    quiet_third_party(verbose=args.verbose)
    imports_started = time.perf_counter()
    missing = _missing_cli_extra()
    if missing is None and args.command == "load":
        _import_named_classes(args.checkpoint, args.components)
    imports = time.perf_counter() - imports_started
    if missing:
        print(f"vllm-diffusion: error: {missing}", file=sys.stderr)
        return 1
    previous = signal.signal(signal.SIGTERM, _raise_on_signal)
    if args.command == "demo" and args.serve:
        try:
            return _serve_demo(args)
        finally:
            signal.signal(signal.SIGTERM, previous)
    if args.command == "plan":
        from vllm_diffusion_plugin.doors.planning import run_plan

        try:
            print(run_plan(args, options=_options(args)))
            return 0
        except Exception as exc:
            return _failed(exc, args, interrupted="")
        finally:
            signal.signal(signal.SIGTERM, previous)
    try:
        merged = run_demo(args) if args.command == "demo" else run_load(args)
    except (Interrupted, KeyboardInterrupt, Exception) as exc:
        # Bad input or a failed rank: the message names the file, key or rank; a traceback only on request.
        return _failed(exc, args, interrupted="every rank stopped, nothing was written")
    finally:
        signal.signal(signal.SIGTERM, previous)
    from vllm_diffusion_plugin.engine.report import format_table

    before_main = {"startup": age} if age is not None else {}
    seconds = merged["seconds"]  # a spawned rank imports the classes again: its own "imports", after ours
    merged["seconds"] = {**before_main, **seconds, "imports": imports + seconds.get("imports", 0.0),
                         "wall": (age or 0.0) + time.perf_counter() - started}
    print(json.dumps(merged, indent=2) if args.json else format_table(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
