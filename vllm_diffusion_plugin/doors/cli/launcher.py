"""Local ranks for the CLI: spawned, watched, stopped together; their errors come back as one line.

``run_ranks`` starts ``world_size`` processes (``multiprocessing`` spawn: a fresh interpreter each) and waits.

- A rank that raises writes its error as one line (``error_line``) to the work folder and exits 1; the
  launcher then stops the other ranks and raises ``RankError`` with the earliest error written, the same text
  the 1-rank path prints -- not ``ProcessRaisedException`` tracebacks.
- A rank that dies of a signal (SIGKILL: the OOM killer or ``kill -9``; SIGBUS; SIGSEGV) writes nothing, and its
  peers' collectives then fail with an echo ("Connection reset by peer") that may reach the work folder before
  the launcher sees the death. Such a death is the cause: once a rank failed, the launcher gives the others
  ``ECHO_GRACE_S`` to end, then names the rank and the signal first and the earliest error written after it
  (``rank 1 died of SIGKILL (out of memory or killed from outside); then rank 0: ...``).
- The ranks ignore SIGINT (a Ctrl-C at a terminal reaches the whole process group): the launcher alone
  handles it, and any exception in the launcher (``KeyboardInterrupt``, the CLI's SIGTERM exception) stops
  every rank -- SIGTERM, then SIGKILL after a grace period -- before it propagates. A rank also dies with its
  launcher (Linux ``PR_SET_PDEATHSIG``) should the launcher itself be killed outright.
- Each rank's temporary files go into its own folder in the work folder (``TMPDIR``), removed with it: a rank
  killed or stopped leaves none behind.
- A rank whose thread waits in the kernel for a read a store never answers cannot be ended by any signal (Linux
  waits out a FUSE request its server took): a rank counts as failed once it wrote its error, and ``stop`` leaves a
  rank still there after its SIGKILL, with a warning naming it, so the launcher itself returns.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import wait
from pathlib import Path

from vllm_diffusion_plugin._logging import init_logger

logger = init_logger(__name__)

USER_ERRORS = (ValueError, TypeError, OSError, RuntimeError)
"""Errors about the input or the environment: their message is the whole story (no traceback)."""
STOP_GRACE_S = 5.0
ECHO_GRACE_S = 2.0
"""Seconds the launcher waits, after a rank failed, for the others to end before it says which failed first."""
SIGNAL_CAUSES = {
    signal.SIGKILL: "out of memory or killed from outside",
    signal.SIGBUS: "an I/O error under a mapped file, or a file truncated under its mapping",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGABRT: "aborted by native code",
    signal.SIGTERM: "terminated from outside",
}
"""What a rank's death by each signal usually means, said after the signal's name."""


class RankError(RuntimeError):
    """A spawned rank failed; the message is the first error a rank raised, as the 1-rank path prints it."""


def error_line(exc: BaseException) -> str:
    """An error as one line: the message of errors about the input, ``Type: message`` for anything else."""
    text = str(exc) if isinstance(exc, USER_ERRORS) else f"{type(exc).__name__}: {exc}"
    lines = [line for line in text.splitlines() if line.strip()]
    return " | ".join(line.strip() for line in lines) if lines else type(exc).__name__


def run_ranks(target: Callable[..., None], *, world_size: int, workdir: Path, args: Sequence = (),
              verbose: bool = False) -> None:
    """Run ``target(rank, world_size, workdir, *args)`` in ``world_size`` spawned processes; return when all
    succeeded, raise ``RankError`` when one failed (after stopping the others)."""
    ctx = multiprocessing.get_context("spawn")
    procs: list = []
    # A Ctrl-C while the ranks are spawned is held, then raised once the launcher can stop them (a SIGINT in that
    # window was lost and the load ran to its end). Held twice over: blocked in this thread, which the ranks inherit
    # through exec (they start with SIGINT blocked and ignore it from _rank_entry on), and recorded by a handler,
    # for a SIGINT the kernel hands to another thread of this process (torch starts one at import) -- where it was
    # discarded while the handler was SIG_IGN.
    held: list[int] = []
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        for rank in range(world_size):
            proc = ctx.Process(target=_rank_entry, name=f"vllm-diffusion-rank{rank}",
                               args=(target, rank, world_size, workdir, tuple(args), verbose, os.getpid()))
            with _temporary_files_in(workdir / f"tmp-rank{rank}"):
                proc.start()
            procs.append(proc)
    except BaseException:
        stop(procs)
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a Ctrl-C pending here is raised; the ranks stopped below
        if held:
            signal.raise_signal(signal.SIGINT)  # to the handler that was in place (KeyboardInterrupt by default)
        _wait(procs, workdir)
    finally:
        stop(procs)


@contextlib.contextmanager
def _temporary_files_in(folder: Path) -> Iterator[None]:
    """A rank spawned in this block makes its temporary files in ``folder`` (``TMPDIR``; inside the work folder,
    which goes with the launcher): a rank killed or stopped leaves none in the user's (seen: third-party packages
    imported by vLLM make a ``tmp*`` folder at import and remove it only at a clean exit)."""
    folder.mkdir(exist_ok=True)
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)  # a spawned child takes this process's environment as it starts
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous


def _wait(procs: list, workdir: Path) -> None:
    while True:
        alive = [p for p in procs if p.exitcode is None]
        # a rank that wrote its error has failed, even before it is gone: its exit may wait for a read thread
        # stuck in the kernel on a store that stopped answering
        if any(p.exitcode not in (None, 0) for p in procs) or any(workdir.glob("error-rank*.json")):
            deadline = time.monotonic() + ECHO_GRACE_S  # the others' echoes, or their own deaths
            while (alive := [p for p in procs if p.exitcode is None]) and time.monotonic() < deadline:
                wait([p.sentinel for p in alive], timeout=max(0.0, deadline - time.monotonic()))
            raise RankError(_cause(procs, workdir))
        if not alive:
            return
        wait([p.sentinel for p in alive], timeout=1.0)


def _cause(procs: list, workdir: Path) -> str:
    """One line: the ranks that died of a signal (they wrote nothing; their peers' errors echo them), then the
    earliest error a rank wrote; else each failed rank's exit code."""
    killed = [f"rank {rank} died of {signal_words(-p.exitcode)}" for rank, p in enumerate(procs)
              if p.exitcode is not None and p.exitcode < 0 and not (workdir / f"error-rank{rank}.json").exists()]
    written = _first_error(workdir)
    if killed:
        return "; ".join(killed) + (f"; then rank {written['rank']}: {written['message']}" if written else "")
    if written:
        return written["message"]
    return ", ".join(f"rank {rank} exited with code {p.exitcode}" for rank, p in enumerate(procs)
                     if p.exitcode not in (None, 0))


def signal_words(signum: int) -> str:
    """``SIGKILL (out of memory or killed from outside)``: a signal's name and what a process's death by it usually
    means (the CLI's ranks; vllm-omni's diffusion workers, ``doors/omni/patch_worker_death``)."""
    try:
        sig = signal.Signals(signum)
    except ValueError:
        return f"signal {signum}"
    return f"{sig.name} ({SIGNAL_CAUSES[sig]})" if sig in SIGNAL_CAUSES else sig.name


def _first_error(workdir: Path) -> dict | None:
    errors = []
    for path in workdir.glob("error-rank*.json"):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # written while the rank was stopped
    if not errors:
        return None
    return min(errors, key=lambda e: (e["time"], e["rank"]))  # the cause precedes its echoes


def stop(procs: list) -> None:
    """Stop every live process: SIGTERM, then SIGKILL for those still alive after ``STOP_GRACE_S``. A process
    still there ``STOP_GRACE_S`` after its SIGKILL is left (and said so): one of its threads waits in the kernel
    for a read that a network or FUSE store never answers, which no signal ends (Linux waits out a FUSE request
    the server already took); it ends when the store answers or is unmounted."""
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    killed = [proc for proc in procs if proc.exitcode is None]
    for proc in killed:
        proc.kill()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in killed:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            logger.warning("%s (pid %d) did not exit %g s after SIGKILL: a thread of it waits in the kernel for a "
                           "read its store never answered; it ends when the store answers or is unmounted (e.g. "
                           "umount -f / fusermount -u -z)", proc.name, proc.pid, STOP_GRACE_S)
            multiprocessing.process._children.discard(proc)  # else the interpreter's exit joins it forever


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the launcher dies, however it dies."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
    if os.getppid() != parent:  # the launcher died before the call above
        os._exit(1)


def _rank_entry(target, rank: int, world_size: int, workdir: Path, args: tuple, verbose: bool, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # before unblocking: a Ctrl-C held since the start is dropped
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # inherited blocked (the launcher's spawn window)
    _die_with_parent(parent)
    try:
        target(rank, world_size, workdir, *args)
    except BaseException as exc:
        if verbose:
            import traceback
            traceback.print_exc()
        record = {"time": time.time(), "rank": rank, "message": error_line(exc)}
        tmp = workdir / f".error-rank{rank}.json"
        tmp.write_text(json.dumps(record))
        tmp.rename(workdir / f"error-rank{rank}.json")
        sys.stderr.flush()
        os._exit(1)  # no atexit / process-group teardown that could block on dead peers
