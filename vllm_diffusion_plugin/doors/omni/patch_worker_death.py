"""Patch: a diffusion worker that dies while the workers start up is named, with how it died, in the server's error.

Why. vllm-omni's ``MultiprocDiffusionExecutor._launch_workers`` waits for each worker's "ready" in rank order; when
a worker's pipe closes it logs ``Rank {i} scheduler is dead``, the exit code of that rank alone, and re-raises a
bare ``EOFError``: the server ends with ``Orchestrator initialization failed:`` and nothing after it. When one worker
is killed (the kernel's OOM killer, ``kill -9``) while its peers wait on it in a collective (a broadcast of the
weights, an all-gather), a peer fails next with ``Connection closed by peer`` and exits 1 -- and if that peer has
the lower rank, the line names it: seen at 2 ranks with ``broadcast``, rank 1 SIGKILLed, the log said "Rank 0
scheduler is dead ... Exit code: 1". The cause is lost.

How. Every ``DiffusionWorker-N`` process started in this process is remembered (``BaseProcess.start`` wrapped, for
those names only). ``_launch_workers`` is wrapped: when it raises, the workers that have exited (after up to
``SETTLE_S`` for the rest of a failing group to end) are described -- killed by a signal first (the cause: what the
signal usually means), then those that exited with an error code (their own errors are in the log above) -- in one
line, logged and raised as a ``RuntimeError`` from the original error, so the server's last line reads
``Orchestrator initialization failed: diffusion worker rank 1 died of SIGKILL (...)``. Nothing changes when the
workers start.

A worker whose load raised (a store failing a read, a read that stalls past ``read_timeout_s``) exits 1 with its
traceback in the log; the server's line said only ``rank 0 exited with code 1 (its error is above)``, the file and
the offset some hundred lines up. So each worker's load records its error's first line (:func:`record_error`, called
by ``patch_load_path``) in a folder of the starting process (:func:`errors_dir`: the temporary folder, named by that
process's id; made before the workers start, removed once they are up or have failed), and the line carries it:
``diffusion worker ranks 0, 1 failed: CheckpointError: <file>: ... at byte 20480 ...``.

A worker whose read is stuck in a store that stopped answering cannot end (Linux never ends a FUSE read the store
took, SIGKILL or not): its files stay open, the "ready" pipe too, so ``_launch_workers`` waited for that pipe's end
forever, and multiprocessing joins its children at the server's exit. So a worker that records its error also sends
``status: failed`` on its pipe (:func:`record_error`: vllm-omni then raises at once), and once the line is said the
workers still running are stopped and those that cannot end are no longer joined (:func:`let_go`, a warning naming
them): the server exits; they end when the store answers or is unmounted.

Versions. Recognized shape: ``MultiprocDiffusionExecutor._launch_workers(self, broadcast_handle, wake_events)``
starting ``multiprocessing.Process(name=f"DiffusionWorker-{i}")`` (0.30.0, 0.31.0rc1, 0.32.0rc1).
Unrecognized: skipped with a warning (vllm-omni's own message is kept).

Remove when vllm-omni names a dead worker's signal and the first worker to die.
"""

from __future__ import annotations

import functools
import multiprocessing.process
import os
import re
import shutil
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni._patching import is_patched, mark, require_attr, require_params

logger = init_logger(__name__)

NAME = "worker-death"
TARGET = "vllm_omni.diffusion.executor.multiproc_executor"
WORKER_NAME = re.compile(r"DiffusionWorker-(\d+)$")
SETTLE_S = 5.0
"""Seconds for the rest of a failing group to end before the dead are described."""
LET_GO_S = 3.0
"""Seconds a worker still running when the workers failed to start has to end after SIGTERM, before SIGKILL."""

_workers: "weakref.WeakValueDictionary[int, multiprocessing.process.BaseProcess]" = weakref.WeakValueDictionary()
"""Rank -> the last ``DiffusionWorker-<rank>`` process started in this process."""


def apply(module: Any) -> str:
    executor = require_attr(module, "MultiprocDiffusionExecutor", module.__name__)
    original = require_attr(executor, "_launch_workers", f"{module.__name__}.MultiprocDiffusionExecutor")
    if is_patched(original):
        return "already applied"
    require_params(original, ("self", "broadcast_handle", "wake_events"),
                   f"{module.__name__}.MultiprocDiffusionExecutor._launch_workers")
    _remember_workers()
    executor._launch_workers = mark(_wrap(original), unit=NAME, original=original)
    return "applied"


def _remember_workers() -> None:
    start = multiprocessing.process.BaseProcess.start
    if is_patched(start):
        return

    @functools.wraps(start)
    def remembering_start(self):
        start(self)
        if match := WORKER_NAME.match(self.name or ""):
            _workers[int(match[1])] = self

    multiprocessing.process.BaseProcess.start = mark(remembering_start, unit=NAME, original=start)


def _wrap(original):
    @functools.wraps(original)
    def _launch_workers(self, broadcast_handle, wake_events, *args, **kwargs):
        errors = errors_dir(os.getpid())
        try:
            errors.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            logger.debug("No folder for the workers' load errors (%s): the line names exit codes only", exc)
        try:
            return original(self, broadcast_handle, wake_events, *args, **kwargs)
        except Exception as exc:
            line = describe_dead(errors=errors)
            if line is None:
                raise
            logger.error("%s", line)
            let_go()
            raise RuntimeError(line) from exc
        finally:
            shutil.rmtree(errors, ignore_errors=True)

    return _launch_workers


def errors_dir(starter_pid: int) -> Path:
    """Where the workers started by process ``starter_pid`` record their load errors (:func:`record_error`)."""
    return Path(tempfile.gettempdir()) / f"vllm-diffusion-worker-errors-{starter_pid}"


def record_error(rank: int, exc: BaseException) -> None:
    """In diffusion worker ``rank``, whose load raised ``exc``: its first line, for the process that started the
    worker (its parent) to name in the server's error. Nothing when that process made no folder for it."""
    folder = errors_dir(os.getppid())
    if not folder.is_dir():
        return
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    try:
        (folder / f".rank-{rank}.tmp").write_text(line[:2000])
        os.replace(folder / f".rank-{rank}.tmp", folder / f"rank-{rank}")
    except OSError as failed:
        logger.debug("Could not record rank %d's load error in %s: %s", rank, folder, failed)
    _tell_starter(line)


def _tell_starter(line: str) -> None:
    """Send ``{"status": "failed"}`` on this worker's "ready" pipe (``worker_main``'s ``pipe_writer``, found up this
    thread's stack): the starting process stops waiting for this rank now. Otherwise it waits for the pipe's end,
    which never comes while a read of this worker is stuck in its store: the process cannot end, and its files --
    the pipe too -- stay open."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "worker_main" and "pipe_writer" in frame.f_locals):
        frame = frame.f_back
    if frame is None:
        logger.debug("No vllm-omni worker_main up this stack: the starting process learns of the failure when "
                     "this worker ends")
        return
    try:
        frame.f_locals["pipe_writer"].send({"status": "failed", "error": line})
    except (OSError, ValueError) as failed:  # the starting process gone, the pipe closed
        logger.debug("Could not tell the starting process of the failure: %s", failed)


def let_go(grace_s: float = LET_GO_S) -> list[int]:
    """Once the workers failed to start: stop those still running (SIGTERM, SIGKILL after ``grace_s``), and stop
    joining those that still cannot end -- a read stuck in a store, which Linux ends only when the store answers --
    so that this process (the server) exits: multiprocessing joins its children at exit, forever for those. Their
    ranks, named in a warning."""
    alive = {rank: p for rank, p in sorted(_workers.items()) if p.exitcode is None}
    for signal_them, wait_s in (("terminate", grace_s), ("kill", 1.0)):
        for p in alive.values():
            if p.exitcode is None:
                getattr(p, signal_them)()
        deadline = time.monotonic() + wait_s
        while any(p.exitcode is None for p in alive.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
    stuck = [rank for rank, p in alive.items() if p.exitcode is None]
    children = getattr(multiprocessing.process, "_children", None)  # CPython's set of the processes joined at exit
    for rank in stuck:
        if isinstance(children, set):
            children.discard(alive[rank])
    if stuck:
        logger.warning("diffusion worker %s cannot end (SIGKILL sent): a read stuck in its store holds it until the "
                       "store answers or is unmounted; the server exits without waiting for it",
                       ", ".join(f"rank {rank} (pid {alive[rank].pid})" for rank in stuck))
    return stuck


def _recorded(errors: Path | None) -> dict[int, str]:
    """Rank -> recorded error, in the order they were recorded (the first to fail first)."""
    found = []
    for path in errors.glob("rank-*") if errors is not None and errors.is_dir() else ():
        try:
            found.append((path.stat().st_mtime_ns, int(path.name.removeprefix("rank-")), path.read_text()))
        except (OSError, ValueError):
            continue
    return {rank: text for _, rank, text in sorted(found)}


def describe_dead(settle_s: float = SETTLE_S, *, errors: Path | None = None) -> str | None:
    """One line naming the remembered workers (this process starts one group) that have exited, once all ended or
    ``settle_s`` passed (a peer fails a moment after the worker it waited on): killed by a signal first (the
    cause), then those whose load recorded an error in ``errors`` (:func:`record_error`; the first to fail first,
    ranks with the same error together; a worker that recorded one but cannot end -- a read stuck in a store --
    included), then those that exited with a code; None when none has."""
    procs = dict(sorted(_workers.items()))
    deadline = time.monotonic() + settle_s
    while any(p.exitcode is None for p in procs.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    recorded = _recorded(errors)
    killed = [(rank, -p.exitcode) for rank, p in procs.items() if p.exitcode is not None and p.exitcode < 0]
    failed = [(rank, p.exitcode) for rank, p in procs.items()
              if p.exitcode is not None and p.exitcode > 0 and rank not in recorded]
    if not killed and not failed and not recorded:
        return None
    from vllm_diffusion_plugin.doors.cli.launcher import signal_words

    parts = [f"diffusion worker rank {rank} died of {signal_words(signum)}" for rank, signum in killed]
    by_error: dict[str, list[int]] = {}
    for rank, text in recorded.items():
        if rank not in dict(killed):
            by_error.setdefault(text, []).append(rank)
    for text, ranks in by_error.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, sorted(ranks)))}"
        stuck = [r for r in ranks if r in procs and procs[r].exitcode is None]
        still = f" (rank {', '.join(map(str, stuck))} cannot end yet: a read stuck in its store)" if stuck else ""
        parts.append(f"{'then ' if parts else 'diffusion worker '}{who} failed: {text}{still}")
    then = [f"rank {rank} exited with code {code}" for rank, code in failed]
    if parts and then:
        parts.append("then " + ", ".join(then) + " (its error above is the echo)")
    elif then:
        parts = [f"diffusion worker {', '.join(then)} (its error is above)"]
    return "; ".join(parts) + " -- while the workers started (their load or the first run)"
