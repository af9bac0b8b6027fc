"""The CLI run as a user runs it, for the fault tests (issue 36): started with ``--save-fused`` under its own TMPDIR
and, as root, its own /dev/shm; waited for with a generous bound; what it left behind listed.

    proc, tmp, out = start(checkpoint, tmp_path, "--nproc", "2", ...)
    err = finish(proc, tmp_path)          # its stderr
    assert left_behind(ranks, tmp, out) == []

``script``: a Python file run instead of ``-m vllm_diffusion_plugin.doors.cli`` (``fault_hooks.py``: hooks steered
by ``FAULT_*`` variables in ``env``; every spawned rank runs its top level too, as its ``__main__``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from fuse_store import wait_for
from proc_utils import alive, descendants, is_rank

ROOT = Path(__file__).resolve().parents[1]
HOOKS = Path(__file__).resolve().parent / "fault_hooks.py"
CLI = [sys.executable, "-m", "vllm_diffusion_plugin.doors.cli"]
LOAD = ("--device", "cpu", "--dtype", "float32")


def start(checkpoint: Path, tmp_path: Path, *args: str, script: Path | None = None, env: Mapping[str, str] = {},
          save_fused: bool = True, launcher: Sequence[str] = ()) -> tuple[subprocess.Popen, Path, Path]:
    """The CLI loading ``checkpoint`` with ``--save-fused`` (unless ``save_fused`` is false), its temporary files
    under its own TMPDIR (the ranks' work folder is ``vllm-diffusion-ranks-*`` there; third-party caches land there
    too) and, as root, its own /dev/shm: ``tmp_path/shm`` bound over it in a private mount namespace (other
    processes on the host create and leave segments in the real one). ``launcher``: what runs the script (with
    ``script``), e.g. ``python -m torch.distributed.run --nnodes 2 ...``."""
    tmp, out, shm = tmp_path / "tmpdir", tmp_path / "out" / "fused", tmp_path / "shm"
    for folder in (tmp, out.parent, shm):
        folder.mkdir()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION")
               and k != "VLLM_CONFIGURE_LOGGING"}
    environ.update(TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")]), **env)
    program = CLI if script is None else [*(launcher or [sys.executable]), str(script)]
    command = [*program, "load", str(checkpoint), *LOAD, *(("--save-fused", str(out)) if save_fused else ()), *args]
    if os.geteuid() == 0 and shutil.which("unshare"):  # exec all the way: the CLI keeps this process id
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   'mount --bind "$0" /dev/shm && exec "$@"', str(shm), *command]
    # files, not pipes: a rank stuck in a stalled read holds the CLI's stdout and stderr until the store answers
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=environ, cwd=tmp_path)
    return proc, tmp, out


def held_load(checkpoint: Path, tmp_path: Path, *args: str, save_fused: bool = True):
    """The CLI on 2 ranks, ``rank_local``, rank 1 held in its read (``fault_hooks.py``); returns once rank 0 waits
    in its first collective: (process, tmp, out, ranks by number, rank 0's collective marker). ``process.processes``:
    the launcher's descendants then (its ranks, the fork server they came from), none of which may be left."""
    env = {"FAULT_DIR": str(tmp_path), "FAULT_HOLD": "1", "FAULT_MARK_COLLECTIVES": "1"}
    proc, tmp, out = start(checkpoint, tmp_path, "--nproc", "2", "--hsdp-weight-load", "rank_local", "--verbose",
                           *args, script=HOOKS, env=env, save_fused=save_fused)
    try:
        held = wait_for(tmp_path / "held-rank1.json")
        waiting = wait_for(tmp_path / "collective-rank0.json")
    except BaseException:
        proc.kill()
        raise
    proc.processes = descendants(proc.pid)
    ranks = [p for p in proc.processes if is_rank(p)]
    assert sorted(ranks) == sorted([held["pid"], waiting["pid"]]), (ranks, held, waiting)
    return proc, tmp, out, {0: waiting["pid"], 1: held["pid"]}, waiting


def finish(proc: subprocess.Popen, tmp_path: Path, timeout_s: float = 120) -> str:
    """The CLI's stderr once it exited (within ``timeout_s``: generous, the ranks must be gone well before)."""
    try:
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return (tmp_path / "stderr").read_text()


def errors(err: str) -> list[str]:
    """The CLI's error lines."""
    return [line for line in err.splitlines() if line.startswith("vllm-diffusion: ")]


def gone_within(pids: list[int], timeout_s: float) -> float:
    """Seconds until every process of ``pids`` was gone (a zombie counts as gone), or ``timeout_s`` + 1."""
    started = time.monotonic()
    while [p for p in pids if alive(p)]:
        if time.monotonic() - started > timeout_s:
            return timeout_s + 1
        time.sleep(0.05)
    return time.monotonic() - started


def left_behind(pids: list[int], tmp: Path, out: Path, *, temp_files: bool = True) -> list[str]:
    """Processes still alive (a rank stuck in the store ends once the store is gone: call after unmounting), the
    CLI's /dev/shm segments, its work folder, anything in the output's folder and (``temp_files``) temporary files
    or folders a rank made with ``tempfile``'s default names (``tmp*``; caches like ``torchinductor_<user>`` are
    kept on purpose)."""
    deadline = time.monotonic() + 30
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    return ([f"process {p}" for p in pids if alive(p)] + [f"/dev/shm/{p.name}" for p in (tmp.parent / "shm").iterdir()]
            + [str(p) for p in tmp.glob("vllm-diffusion-*")] + [str(p) for p in out.parent.iterdir()]
            + ([str(p) for p in tmp.glob("tmp*")] if temp_files else []))


def break_file(shard: Path, mode: str) -> None:
    """``truncate``: its last 100 bytes gone; ``replace``: another file of the same size (the same header, zeros
    after it) renamed over it."""
    if mode == "truncate":
        os.truncate(shard, shard.stat().st_size - 100)
        return
    data = bytearray(shard.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start:] = bytes(len(data) - start)
    tmp = shard.with_name(shard.name + f".new{os.getpid()}")
    tmp.write_bytes(bytes(data))
    tmp.rename(shard)
