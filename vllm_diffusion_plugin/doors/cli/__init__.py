"""``vllm-diffusion``: load a diffusers checkpoint's DiTs on N local ranks and report, or run the demo.

    vllm-diffusion load DIR [--component NAME]... [--lora [COMPONENT=]PATH[@SCALE]]... [--lora-scale F]
                            [--nproc N] [--hsdp-shard-size S] [--hsdp-replicate-size R]
                            [--device auto|cpu|cuda|npu] [--dtype bfloat16|float16|float32]
                            [--hsdp-weight-load full|broadcast|rank_local] [--read-threads N]
                            [--collective-timeout S] [--read-timeout S]
                            [--swap-lora SET]... [--save-fused OUT_DIR]
                            [--allow-pickle] [--json] [--verbose]
    vllm-diffusion plan DIR [the options of load but --swap-lora, --save-fused] [--host-memory SIZE] [--device-memory SIZE]
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

from vllm_diffusion_plugin.doors.cli.noise import OURS, quiet_third_party
from vllm_diffusion_plugin.doors.cli.rank_server import discard_prestarted, prestart_for
from vllm_diffusion_plugin.engine.config import LoadOptions

DTYPES = ("bfloat16", "float16", "float32")
CLI_EXTRA_HINT = 'pip install "vllm-diffusion-plugin[cli]"'


def _add_plan_parser(sub, *, shared, formatter) -> None:
    """The ``plan`` subcommand on ``sub``: ``shared(parser)`` adds the options it shares with ``load``."""
    plan = sub.add_parser("plan", help="say from headers and meta skeletons what each rank of a load would read "
                                       "and hold, per strategy (reads no weight byte)", formatter_class=formatter)
    plan.add_argument("checkpoint", help="diffusers pipeline folder or component folder")
    shared(plan)
    plan.add_argument("--host-memory", metavar="SIZE", help="host memory per node (64GiB, 80GB, bytes); "
                                                            "default: this machine's total RAM")
    plan.add_argument("--device-memory", metavar="SIZE", help="memory per accelerator; default: the probed "
                                                              "accelerator's (none on the CPU)")
    plan.add_argument("--per-rank", action="store_true",
                      help="one row per strategy and rank, then one per component (default: one line per strategy, "
                           "the largest figures over its ranks)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-diffusion", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    formatter = argparse.ArgumentDefaultsHelpFormatter

    load = sub.add_parser("load", help="load a diffusers checkpoint's DiT(s) and report", formatter_class=formatter)
    load.add_argument("checkpoint", help="diffusers pipeline folder, component folder, or hub id (ORG/NAME)")
    _add_load_options(load)

    _add_plan_parser(sub, shared=_add_shared_options, formatter=formatter)

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
    p.add_argument("--swap-lora", action="append", default=[], metavar="SET",
                   help="after the load, replace the fused LoRA set by SET (repeatable: one swap each, in order; "
                        "before --save-fused): [COMPONENT=]PATH[@SCALE] entries separated by commas, or 'none'; "
                        "the touched rows are re-read from the checkpoint, so the result equals a load with SET")
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


def _options(args: argparse.Namespace) -> LoadOptions:
    """LoadOptions from the flags; keys without a flag fall back to their VLLM_DIFFUSION_* variables."""
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


def run_demo(args: argparse.Namespace) -> dict:
    """Build a tiny Wan2.2-style pipeline and one LoRA per transformer (``load.write_demo``), then ``load`` it with
    the LoRAs fused."""
    from vllm_diffusion_plugin.doors.cli import load

    with tempfile.TemporaryDirectory(prefix="vllm-diffusion-demo-") as tmp:
        started = time.perf_counter()
        checkpoint, loras = load.write_demo(args.keep or Path(tmp))
        written = time.perf_counter() - started
        print(f"demo checkpoint: {checkpoint} (+ {len(loras)} LoRA files)", file=sys.stderr)
        load_args = _parser().parse_args(["load", str(checkpoint), "--dtype", "float32", "--device", "cpu",
                                          "--nproc", str(args.nproc), *(f"--lora={p}" for p in loras),
                                          *(["--json"] if args.json else []),
                                          *(["--verbose"] if args.verbose else [])])
        merged = load.run_load(load_args, _options(load_args))
        merged["seconds"] = {"demo_write": written, **merged["seconds"]}
        return merged


def _import_diffusers(args: argparse.Namespace) -> str | None:
    """diffusers for the command (``load`` and ``plan``: ``import_for_load``); one line naming the extra to install
    when diffusers (which builds every skeleton) is missing."""
    try:
        if args.command in ("load", "plan"):
            import_for_load(args.checkpoint, args.components)
        else:  # the demos write pipelines with text encoders: diffusers whole
            import diffusers  # noqa: F401
    except ImportError as exc:
        return f"the vllm-diffusion command needs diffusers ({exc}): {CLI_EXTRA_HINT}"
    return None


def import_for_load(checkpoint: str, components: list[str] | None) -> None:
    """Import diffusers without what a load never uses (``import_diffusers``) and the DiT classes a local checkpoint
    names for the components a load looks at (all of ``model_index.json``'s, or ``components``; a component folder's
    ``config.json`` class), each module alone (``model_class``): the skeletons import exactly these anyway --
    seconds on a small host --, so the report shows them as ``imports``, not as ``validate`` (the CLI), and a
    rank's fork server has them before any rank starts (``rank_imports``). Problems with the checkpoint are left to
    validation, which names them; ``ImportError`` without diffusers."""
    from vllm_diffusion_plugin.engine import session

    session.import_diffusers()
    folder = Path(checkpoint)
    try:
        if (folder / "model_index.json").is_file():
            entries = json.loads((folder / "model_index.json").read_text())
            entries = [v for k, v in entries.items() if components is None or k in components]
        else:
            entries = [["diffusers", json.loads((folder / "config.json").read_text()).get("_class_name")]]
    except (OSError, ValueError, AttributeError):
        return
    for value in entries:
        if isinstance(value, list) and len(value) == 2 and isinstance(value[1], str) and session.is_dit_class(*value):
            try:
                session.model_class(value[1])
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
    from vllm_diffusion_plugin.doors.cli import serve_demo

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
    from vllm_diffusion_plugin.doors.cli.launcher import error_line

    print(f"vllm-diffusion: error: {message if message is not None else error_line(exc)}", file=sys.stderr)
    return 1


def _interrupted_while_importing(signum: int, frame: object) -> None:
    """SIGINT while the command imports torch and diffusers: nothing has started, so it ends here, at once. Raised
    inside an import instead, the KeyboardInterrupt can be swallowed by the library being imported and leave it half
    initialized (CI: numpy's ``linalg`` then recursed until a RecursionError, exit 1 with a traceback)."""
    print("vllm-diffusion: interrupted (SIGINT)", file=sys.stderr, flush=True)
    os._exit(130)


def run() -> None:
    """The ``vllm-diffusion`` command: ``main``, then an exit without the interpreter's teardown of torch and
    diffusers (~0.8 s of a 2-core host's time, after the work is done), every stream and log handler flushed
    first. ``main`` itself returns, for callers in the same process."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """The command (see ``_main``); a caller in the same process (a test) gets our loggers' level back after it."""
    ours = logging.getLogger(OURS)
    level = ours.level
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the work (the imports take seconds) or after it: the work handles its own
        print("vllm-diffusion: interrupted (SIGINT)", file=sys.stderr)
        return 130
    finally:
        ours.setLevel(level)
        discard_prestarted()  # a fork server the command started and did not use


def _main(argv: list[str] | None) -> int:
    """The command; the report's ``seconds`` add the launching process's phases to the ranks' (``report.PHASES``):
    ``startup`` (process start to here: the interpreter and the CLI's own imports), ``imports`` (torch, diffusers
    and the diffusers classes the checkpoint names, which a diffusers ``from_pretrained`` needs as well),
    ``demo_write``, ``validate`` and ``wall`` (process start to the report)."""
    started, age = time.perf_counter(), _process_age()
    # Logs go to stderr so that --json output on stdout stays parseable.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    args = _parser().parse_args(argv)
    quiet_third_party(verbose=args.verbose)
    prestart_for(args)  # a load on local ranks: their fork server imports beside this process's imports below
    imports_started = time.perf_counter()
    previous = signal.signal(signal.SIGINT, _interrupted_while_importing)
    try:
        missing = _import_diffusers(args)
    finally:
        signal.signal(signal.SIGINT, previous)
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
        from vllm_diffusion_plugin.doors.cli.planning import run_plan

        try:
            print(run_plan(args, options=_options(args)))
            return 0
        except Exception as exc:
            return _failed(exc, args, interrupted="")
        finally:
            signal.signal(signal.SIGTERM, previous)
    try:
        if args.command == "demo":
            merged = run_demo(args)
        else:
            from vllm_diffusion_plugin.doors.cli.load import run_load

            merged = run_load(args, _options(args))
    except (Interrupted, KeyboardInterrupt, Exception) as exc:
        # Bad input or a failed rank: the message names the file, key or rank; a traceback only on request.
        return _failed(exc, args, interrupted="every rank stopped, nothing was written")
    finally:
        signal.signal(signal.SIGTERM, previous)
    from vllm_diffusion_plugin.engine.session import format_table

    before_main = {"startup": age} if age is not None else {}
    seconds = merged["seconds"]  # a spawned rank imports the classes again: its own "imports", after ours
    merged["seconds"] = {**before_main, **seconds, "imports": imports + seconds.get("imports", 0.0),
                         "wall": (age or 0.0) + time.perf_counter() - started}
    print(json.dumps(merged, indent=2) if args.json else format_table(merged))
    return 0
