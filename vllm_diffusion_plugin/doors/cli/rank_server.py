"""The fork server the CLI's local ranks are forked from (``launcher.run_ranks``): started as the command starts
(``prestart_for``, before the command imports torch) or by the caller (``rank_starter``), importing what a rank
needs (``rank_imports``) beside the command's own imports; stopped after the ranks, its files in their work folder.

A fresh single-threaded interpreter (``multiprocessing``'s fork server, started through exec) -- the ranks are never
forks of the launcher, which has run torch and started threads. It starts with SIGINT blocked (a Ctrl-C neither
interrupts its imports nor reaches a rank before the rank ignores it), with ``TMPDIR`` in the work folder and the
launcher's ``sys.path``; it ends once the launcher closes its end of the server's "alive" pipe (a rank drops its
own copy), also when the launcher is killed; ``rank_starter`` SIGKILLs it once the ranks are gone.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

RANK_IMPORTS = "vllm_diffusion_plugin.doors.cli.rank_imports"
"""The module the ranks' fork server imports: what a rank needs."""
CLASSES_VARIABLE = "VD_RANK_IMPORTS"
"""The checkpoint and components whose diffusers classes ``rank_imports`` imports (``classes_of``), as JSON."""
SERVER_ONLY = (CLASSES_VARIABLE,)
"""Variables the fork server is started with for its imports (``rank_imports``), not for the ranks."""


@contextlib.contextmanager
def rank_starter(workdir: Path, *, preload: Sequence[str] = (), server_env: dict[str, str] | None = None) -> Iterator:
    """The ``multiprocessing`` context ``run_ranks`` starts ranks from: a fork server started now (this returns at
    once; the server imports ``preload`` meanwhile, beside the caller's own work), stopped on exit -- after the
    ranks, before ``workdir`` goes: its temporary files (``TMPDIR``) and its socket are in ``workdir``. The spawn
    context where there is no fork server, or where this process already runs one it did not start here (its
    environment and imports are another's)."""
    server = _fork_server()
    if server is None or getattr(server, "_forkserver_pid", None) is not None:
        yield multiprocessing.get_context("spawn")
        return
    context = multiprocessing.get_context("forkserver")
    config = multiprocessing.process.current_process()._config
    own_tempdir = config.get("tempdir") is None
    sockets = workdir if len(os.fsencode(str(workdir))) <= SOCKET_FOLDER_MAX else _short_folder()
    if own_tempdir:  # where multiprocessing puts the server's socket (else a pymp-* folder in the user's TMPDIR,
        config["tempdir"] = str(sockets)  # left there should the launcher be killed)
    preloaded = getattr(server, "_preload_modules", None)
    context.set_forkserver_preload(list(preload))
    folder = workdir / "tmp-server"
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # the server inherits it through exec
    try:
        folder.mkdir(exist_ok=True)
        with environment({"TMPDIR": str(folder), **import_path_of_this_process(), **(server_env or {})}):
            server.ensure_running()
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        yield context
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        try:
            _stop_fork_server(server)
        finally:
            if preloaded is not None:
                server._preload_modules = preloaded
            if own_tempdir:
                config["tempdir"] = None
            if sockets != workdir:
                shutil.rmtree(sockets, ignore_errors=True)


SOCKET_FOLDER_MAX = 80
"""The longest folder (bytes) for the fork server's socket (``listener-XXXXXXXX`` in it): an ``AF_UNIX`` path has
107 bytes at most (``OSError: AF_UNIX path too long`` -- seen with the work folder in pytest's deep ``tmp_path``)."""


def _short_folder() -> Path:
    """A fresh folder for the fork server's socket where the work folder's path is too long for one: in /tmp, or
    in ``tempfile``'s default folder."""
    for parent in ("/tmp", None):
        try:
            folder = Path(tempfile.mkdtemp(prefix="vd-", dir=parent))
        except OSError:
            continue
        if len(os.fsencode(str(folder))) <= SOCKET_FOLDER_MAX:
            return folder
        folder.rmdir()
    raise OSError("no folder with a path short enough for the fork server's socket (AF_UNIX: 107 bytes)")


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment for the block (a process started in it inherits them); what was
    there before is put back on exit."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def import_path_of_this_process() -> dict[str, str]:
    """``PYTHONPATH`` for a process that must find modules where this one does (this process's ``sys.path``): the
    fork server imports the rank's modules before a rank sets its own ``sys.path``, and Python 3.11's server ignores
    the one it is handed -- else a script run from a source folder could load the ranks' code from an installed
    copy. ``_rank_entry`` restores this process's ``PYTHONPATH``."""
    return {"PYTHONPATH": os.pathsep.join(os.path.abspath(p) if p == "" else p for p in sys.path)}


_PRESTARTED: list = []
"""The work folder, context and exit stack of a ``prestart``, until ``take_prestarted`` or ``discard_prestarted``."""


def prestart(*, preload: Sequence[str], server_env: dict[str, str] | None = None) -> None:
    """Start the ranks' fork server now, in a fresh work folder (``vllm-diffusion-ranks-*``), for ``run_load`` to
    take (``take_prestarted``): called as the command starts, before it imports torch, so that the server's imports
    run beside the command's own instead of after them. ``discard_prestarted`` stops it and removes the folder
    where the command ends before it took them (and at exit, should nothing else)."""
    discard_prestarted()
    stack = contextlib.ExitStack()
    try:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vllm-diffusion-ranks-")))
        context = stack.enter_context(rank_starter(workdir, preload=preload, server_env=server_env))
    except BaseException:
        stack.close()
        raise
    _PRESTARTED.append((workdir, context, stack))
    import atexit

    atexit.unregister(discard_prestarted)
    atexit.register(discard_prestarted)


def prestart_for(args) -> None:
    """``prestart`` for a command that will load on local ranks (``load`` or ``demo`` with ``--nproc`` > 1, not
    under torchrun): the server imports ``rank_imports``, and for ``load`` the diffusers classes its checkpoint
    names."""
    if args.command not in ("load", "demo") or getattr(args, "serve", False) or getattr(args, "nproc", 1) <= 1:
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    prestart(preload=[RANK_IMPORTS],
             server_env=classes_of(args.checkpoint, args.components) if args.command == "load" else None)


def classes_of(checkpoint: str, components: list[str] | None) -> dict[str, str]:
    """The fork server's variables that make it import, besides ``RANK_IMPORTS``, the diffusers classes
    ``checkpoint`` names for ``components`` (``rank_imports``)."""
    return {CLASSES_VARIABLE: json.dumps({"checkpoint": checkpoint, "components": components})}


def take_prestarted() -> tuple[Path, object, contextlib.ExitStack] | None:
    """The ``prestart``'s work folder, context and exit stack (the caller closes it: server stopped, folder gone)."""
    return _PRESTARTED.pop() if _PRESTARTED else None


def discard_prestarted() -> None:
    """Stop a ``prestart``'s fork server and remove its work folder, if nothing took them."""
    while _PRESTARTED:
        _PRESTARTED.pop()[2].close()


def _fork_server():
    """``multiprocessing``'s fork server of this process, None where there is none."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    server = getattr(importlib.import_module("multiprocessing.forkserver"), "_forkserver", None)
    return server if hasattr(server, "_stop") else None


def _stop_fork_server(server) -> None:
    """SIGKILL the fork server, then let ``multiprocessing`` reap it and remove its socket. Called once the ranks
    are gone or stopped: the server holds nothing else (its temporary files are in the work folder), may still be
    importing (it reads its "alive" pipe only after its imports: a plain stop would wait for them), and a rank left
    stuck in a store's read holds that pipe open."""
    pid = server._forkserver_pid
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    try:
        server._stop()
    except ChildProcessError:  # reaped by someone else's waitpid(-1): only multiprocessing's record is left
        server._forkserver_pid = None
