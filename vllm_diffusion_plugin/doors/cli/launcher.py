"""Local ranks for the CLI: started, watched, stopped together; their errors come back as one line.

``run_ranks`` starts ``world_size`` processes and waits. They come from a ``multiprocessing`` fork server
(``rank_server``): a fresh single-threaded interpreter, started by the launcher before its own checks, that imports
what a rank needs (torch, the engine, the checkpoint's diffusers classes) once while the launcher checks, and forks
each rank from there -- a rank starts with them imported instead of paying seconds of imports of its own (on a small
host, a 2-rank load took ~1.6x a 1-rank one). Where there is no fork server (not Linux/Unix), or one this process
did not start is already running, each rank is a fresh interpreter (``multiprocessing`` spawn) as before. A rank
names itself ``vd-rankN`` (Linux ``PR_SET_NAME``: what ``ps -o comm``, ``top`` and ``/proc/PID/comm`` show; its
command line is the fork server's); the fork server is a child of the launcher, the ranks are its children.

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
  launcher (Linux ``PR_SET_PDEATHSIG``) should the launcher itself be killed outright: its parent is the fork
  server, which ends once the launcher is gone (a rank drops its end of the server's "alive" pipe), or the
  launcher itself with spawn. The fork server starts with SIGINT blocked (a Ctrl-C neither interrupts its imports
  nor reaches a rank before the rank ignores it) and is stopped when the ranks are; it ends with a killed launcher.
- Each rank's temporary files go into its own folder in the work folder (``TMPDIR`` and ``tempfile.tempdir``, set
  in the rank), removed with it: a rank killed or stopped leaves none behind. The fork server's go into the work
  folder too (its imports', its socket).
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
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from pathlib import Path

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.cli.rank_server import SERVER_ONLY, environment, rank_starter

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
              verbose: bool = False, context=None) -> float:
    """Run ``target(rank, world_size, workdir, *args)`` in ``world_size`` processes; return when all succeeded
    (the seconds the ranks took to start: with a fork server, the wait for the imports it had left), raise
    ``RankError`` when one failed (after stopping the others). ``context``: the ``multiprocessing`` context of a
    ``rank_starter`` (started early, its imports done while the caller checked); without one, a fork server
    importing ``target``'s module is started here and stopped on return."""
    if context is None:
        with rank_starter(workdir, preload=[target.__module__]) as started:
            return run_ranks(target, world_size=world_size, workdir=workdir, args=args, verbose=verbose,
                             context=started)
    procs: list = []
    # a forked rank has the fork server's environment, from its start: it takes this process's, as a spawned one does
    environ = dict(os.environ) if context.get_start_method() == "forkserver" else None
    # A Ctrl-C while the ranks are started is held, then raised once the launcher can stop them (a SIGINT in that
    # window was lost and the load ran to its end). Held twice over: blocked in this thread -- which spawned ranks
    # inherit through exec and forked ones from the fork server, started with it blocked (they start with SIGINT
    # blocked and ignore it from _rank_entry on) -- and recorded by a handler, for a SIGINT the kernel hands to
    # another thread of this process (torch starts one at import) -- where it was discarded while the handler was
    # SIG_IGN.
    held: list[int] = []
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    started = time.perf_counter()
    try:
        for rank in range(world_size):
            tmpdir = workdir / f"tmp-rank{rank}"
            proc = context.Process(target=_rank_entry, name=f"vllm-diffusion-rank{rank}",
                                   args=(target, rank, world_size, workdir, tuple(args), verbose, os.getpid(),
                                         str(tmpdir), environ))
            tmpdir.mkdir(exist_ok=True)
            with environment({"TMPDIR": str(tmpdir)}):  # a spawned rank takes it as it starts: its temporary files
                proc.start()                            # go with the work folder (a forked one sets its own)
            procs.append(proc)
    except BaseException:
        stop(procs)
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    starting = time.perf_counter() - started
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a Ctrl-C pending here is raised; the ranks stopped below
        if held:
            signal.raise_signal(signal.SIGINT)  # to the handler that was in place (KeyboardInterrupt by default)
        _wait(procs, workdir)
    finally:
        stop(procs)
    return starting


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
    """Linux: SIGKILL this process when its parent dies, however it dies, and exit now if the launcher (``parent``)
    is already gone. The parent is the launcher (spawn) or the fork server, which ends once every end of its
    "alive" pipe is closed: the launcher's, and this rank's, closed here (a rank needs none: it starts no process
    from the server)."""
    if sys.platform.startswith("linux") and not _prctl(1, signal.SIGKILL):  # PR_SET_PDEATHSIG
        return
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None and os.getppid() != parent:  # forked by the fork server
        with contextlib.suppress(OSError):
            os.close(alive_fd)
        server._forkserver_alive_fd = None
    if os.getppid() != parent and not _alive(parent):  # the launcher died before the calls above
        os._exit(1)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _name_rank(rank: int) -> None:
    """Linux: this process shows as ``vd-rankN`` (``PR_SET_NAME``; 15 bytes at most) in ``ps -o comm``, ``top`` and
    ``/proc/PID/comm``: a forked rank's command line is the fork server's."""
    if sys.platform.startswith("linux"):
        _prctl(15, f"vd-rank{rank}".encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _prctl(option: int, *args) -> bool:
    """Linux ``prctl(option, *args)`` on this process; False where libc or the call is not there."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, *args)
    except (OSError, AttributeError):
        return False
    return True


def _environment(environ: dict[str, str] | None, tmpdir: str | None) -> None:
    """A forked rank takes the launcher's environment (``environ``: it has the fork server's, which the server's
    imports may have added to: those stay) and its temporary files go into ``tmpdir`` (``TMPDIR``, and
    ``tempfile``'s folder, which an import in the server may have cached)."""
    if environ is not None:
        for key in ("PYTHONPATH", "TMPDIR", *SERVER_ONLY):  # set for the server alone
            if key not in environ:
                os.environ.pop(key, None)
        os.environ.update(environ)
    if tmpdir is not None:
        os.environ["TMPDIR"] = tmpdir
        tempfile.tempdir = tmpdir


def _rank_entry(target, rank: int, world_size: int, workdir: Path, args: tuple, verbose: bool, parent: int,
                tmpdir: str | None = None, environ: dict[str, str] | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # before unblocking: a Ctrl-C held since the start is dropped
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # inherited blocked (the launcher's start window)
    _name_rank(rank)
    _die_with_parent(parent)
    _environment(environ, tmpdir)
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
