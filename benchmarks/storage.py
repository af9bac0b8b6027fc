"""Storage kinds for the load benchmarks: where the checkpoint is read from, set up and torn down by the benchmark.

  warm       the page cache holds every page (read once before each run)
  cold       the checkpoint's pages evicted before each run (``posix_fadvise(DONTNEED)`` per file, checked by
             ``mincore``), read from the local disk
  throttled  a copy of the checkpoint on its own block device (a loop device over an ext4 image file, mounted in
             a temp dir), read-capped at ``bandwidth_mbps`` by a cgroup the benchmark process (and so every child
             it starts) runs in: cgroup v2 ``io.max`` where the io controller is available, else cgroup v1
             ``blkio.throttle.read_bps_device``; the cap is checked by reading a file through it
  latency    a FUSE passthrough mount (``benchmarks/latency_fs.py``, multithreaded, small ``max_read``) that
             delays every read request by ``latency_ms``, as network storage does

:func:`stage` is a context manager: teardown runs on exceptions and Ctrl-C, and an ``atexit`` hook undoes what a
killed ``with`` block left. A kind this host cannot make raises :class:`Unavailable` with the reason (no
/dev/fuse, no fusepy, no cgroup io controller, not root ...) before anything is changed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vllm_diffusion_plugin.testing.pagecache import evict, files_under, resident_bytes

KINDS = ("warm", "cold", "throttled", "latency")
CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1_BLKIO = Path("/sys/fs/cgroup/blkio")
_UNDO: list[Callable[[], None]] = []


class Unavailable(RuntimeError):
    """This host cannot make a storage kind; the message says why."""


@dataclass(frozen=True)
class Staged:
    """A storage kind made ready: read the checkpoint from ``folder``; call ``before_run()`` before each timed run
    (warms or evicts); ``note`` says how it was made (cap mechanism, measured bandwidth ...)."""

    kind: str
    folder: Path
    before_run: Callable[[], None]
    note: str = ""
    measured: dict = field(default_factory=dict)


def parse_kinds(text: str) -> tuple[str, ...]:
    """``"warm,cold"`` / ``"all"`` -> kinds in the given order, without repeats; an unknown name is a ValueError
    naming it and the known ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--storage: empty; choose from {', '.join(KINDS)} or all")
    out: list[str] = []
    for name in names:
        for kind in (KINDS if name == "all" else (name,)):
            if kind not in KINDS:
                raise ValueError(f"--storage: unknown kind {kind!r}; choose from {', '.join(KINDS)} or all")
            if kind not in out:
                out.append(kind)
    return tuple(out)


def io_max_line(device: str, *, rbps: int) -> str:
    """cgroup v2 ``io.max`` line capping reads of block device ``MAJ:MIN``."""
    return f"{_check_device(device)} rbps={int(rbps)}"


def blkio_read_bps_line(device: str, *, rbps: int) -> str:
    """cgroup v1 ``blkio.throttle.read_bps_device`` line for block device ``MAJ:MIN``."""
    return f"{_check_device(device)} {int(rbps)}"


def _check_device(device: str) -> str:
    major, _, minor = device.partition(":")
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"block device must be MAJ:MIN, got {device!r}")
    return device


def block_device_of(path: Path) -> str:
    """``MAJ:MIN`` of the block device holding ``path``."""
    dev = os.stat(path).st_dev
    return f"{os.major(dev)}:{os.minor(dev)}"


def cgroup_io_mechanism(*, v2_root: Path | None = None, v1_blkio: Path | None = None) -> tuple[str, Path]:
    """``("v2", root)`` when cgroup v2 has the io controller, else ``("v1", blkio root)`` when v1 blkio throttling
    is mounted; :class:`Unavailable` naming what is missing otherwise."""
    v2_root, v1_blkio = v2_root or CGROUP_V2, v1_blkio or CGROUP_V1_BLKIO
    controllers = v2_root / "cgroup.controllers"
    if controllers.is_file() and "io" in controllers.read_text().split():
        return "v2", v2_root
    if (v1_blkio / "blkio.throttle.read_bps_device").is_file():
        return "v1", v1_blkio
    raise Unavailable(f"no cgroup v2 io controller ({controllers} missing or without 'io') and no cgroup v1 blkio "
                      f"throttling ({v1_blkio / 'blkio.throttle.read_bps_device'} missing): cannot cap reads here")


def fuse_available(*, fuse_dev: Path = Path("/dev/fuse")) -> None:
    """:class:`Unavailable` unless a FUSE mount can be made here: ``fuse_dev`` exists, fusepy imports, ``fusermount``
    is on PATH."""
    if not fuse_dev.exists():
        raise Unavailable(f"{fuse_dev} does not exist (no FUSE in this kernel/container): cannot make 'latency'")
    try:
        import fuse  # noqa: F401  (fusepy, the 'bench' extra)
    except (ImportError, OSError) as err:
        raise Unavailable(f"fusepy not importable ({err}): pip install '.[bench]' and apt-get install fuse libfuse2")
    if shutil.which("fusermount") is None and shutil.which("fusermount3") is None:
        raise Unavailable("fusermount not on PATH: apt-get install fuse")


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def _read_all(files: list[Path]) -> None:
    for path in files:
        with open(path, "rb") as fh:
            while fh.read(1 << 24):
                pass


def measure_read_mbps(path: Path) -> float:
    """MB/s of one cold sequential read of ``path`` by this process (evicted first)."""
    evict([path])
    start = time.perf_counter()
    _read_all([path])
    return path.stat().st_size / 1e6 / (time.perf_counter() - start)


@contextlib.contextmanager
def _undo(fn: Callable[[], None]) -> Iterator[None]:
    """Run ``fn`` on leaving (also on exceptions); registered for atexit too, in case the process dies first."""
    _UNDO.append(fn)
    try:
        yield
    finally:
        if fn in _UNDO:
            _UNDO.remove(fn)
            fn()


@atexit.register
def _undo_all() -> None:
    while _UNDO:
        with contextlib.suppress(Exception):
            _UNDO.pop()()


@contextlib.contextmanager
def loop_copy(folder: Path, *, workdir: Path) -> Iterator[tuple[Path, str]]:
    """A copy of ``folder`` on its own ext4 loop device mounted under ``workdir``: yields (copy, ``MAJ:MIN``)."""
    if os.geteuid() != 0:
        raise Unavailable("not root: cannot attach a loop device or mount")
    size = sum(p.stat().st_size for p in files_under([folder]))
    tmp = Path(tempfile.mkdtemp(prefix="storage-", dir=workdir))
    image, mnt = tmp / "disk.img", tmp / "mnt"
    mnt.mkdir()
    with _undo(lambda: shutil.rmtree(tmp, ignore_errors=True)):
        with open(image, "wb") as fh:
            fh.truncate(int(size * 1.15) + (96 << 20))
        _run("mkfs.ext4", "-q", "-F", str(image))
        loop = _run("losetup", "-f", "--show", str(image))
        with _undo(lambda: subprocess.run(["losetup", "-d", loop], check=False)):
            _run("mount", loop, str(mnt))
            with _undo(lambda: subprocess.run(["umount", "-l", str(mnt)], check=False)):
                copy = mnt / folder.name
                shutil.copytree(folder, copy)
                os.sync()
                yield copy, block_device_of(copy)


@contextlib.contextmanager
def read_capped_cgroup(device: str, *, rbps: int, name: str, pids: tuple[int, ...] | None = None) -> Iterator[Path]:
    """A cgroup capping reads of ``device`` at ``rbps`` bytes/s holding ``pids`` (None: this process, so every
    child it starts too; (): none yet, a launcher writes its own pid to ``cgroup.procs``); its pids go back to
    the root cgroup and the cgroup is removed on leaving."""
    mechanism, root = cgroup_io_mechanism()
    group = root / name
    group.mkdir(exist_ok=True)
    with _undo(lambda: _remove_cgroup(group, root)):
        if mechanism == "v2":
            subtree = root / "cgroup.subtree_control"
            if "io" not in subtree.read_text().split():
                subtree.write_text("+io")
            (group / "io.max").write_text(io_max_line(device, rbps=rbps))
        else:
            (group / "blkio.throttle.read_bps_device").write_text(blkio_read_bps_line(device, rbps=rbps))
        for pid in (os.getpid(),) if pids is None else pids:
            (group / "cgroup.procs").write_text(str(pid))
        yield group


def _remove_cgroup(group: Path, root: Path) -> None:
    for pid in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):
            (root / "cgroup.procs").write_text(pid)
    with contextlib.suppress(OSError):
        group.rmdir()


@contextlib.contextmanager
def latency_mount(folder: Path, *, workdir: Path, latency_ms: float, max_read: int = 128 << 10,
                  threads: bool = True, fuse_dev: Path = Path("/dev/fuse")) -> Iterator[Path]:
    """``folder`` seen through a FUSE passthrough that sleeps ``latency_ms`` per read request (``latency_fs.py``)."""
    fuse_available(fuse_dev=fuse_dev)
    mnt = Path(tempfile.mkdtemp(prefix="latency-", dir=workdir))
    with _undo(lambda: shutil.rmtree(mnt, ignore_errors=True)):
        cmd = [sys.executable, str(Path(__file__).with_name("latency_fs.py")), str(folder), str(mnt),
               "--latency-ms", str(latency_ms), "--max-read", str(max_read)] + ([] if threads else ["--single"])
        server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        with _undo(lambda: _unmount_fuse(mnt, server)):
            deadline = time.monotonic() + 20
            while not os.path.ismount(mnt):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise Unavailable(f"FUSE mount at {mnt} did not come up: {server.stderr.read()[-500:]}")
                time.sleep(0.1)
            yield mnt


def _unmount_fuse(mnt: Path, server: subprocess.Popen) -> None:
    tool = shutil.which("fusermount") or shutil.which("fusermount3") or "umount"
    subprocess.run([tool, "-u", str(mnt)] if "fuser" in tool else [tool, str(mnt)], check=False,
                   capture_output=True)
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@contextlib.contextmanager
def stage(kind: str, folder: Path, *, workdir: Path, bandwidth_mbps: float = 200.0,
          latency_ms: float = 4.0) -> Iterator[Staged]:
    """Make storage ``kind`` for checkpoint ``folder`` (see the module doc); everything is undone on leaving."""
    folder = Path(folder)
    files = files_under([folder])
    if kind == "warm":
        yield Staged(kind, folder, lambda: _read_all(files), "page cache warm before each run")
    elif kind == "cold":
        def cold() -> None:
            evict(files)
            resident, total = resident_bytes(files)
            if resident > 0.05 * total:
                raise RuntimeError(f"{resident / 1e6:.0f} MB of {folder} still cached after eviction "
                                   "(a live process maps it?)")
        yield Staged(kind, folder, cold, "pages evicted before each run (fadvise DONTNEED, mincore-checked)")
    elif kind == "throttled":
        mechanism = cgroup_io_mechanism()[0]
        with loop_copy(folder, workdir=workdir) as (copy, device):
            copied = files_under([copy])
            with read_capped_cgroup(device, rbps=int(bandwidth_mbps * 1e6), name=f"vdp-bench-{os.getpid()}"):
                mbps = measure_read_mbps(max(copied, key=lambda p: p.stat().st_size))
                yield Staged(kind, copy, lambda: evict(copied),
                             f"loop device {device}, cgroup {mechanism} read cap {bandwidth_mbps:.0f} MB/s "
                             f"(measured {mbps:.0f} MB/s), evicted before each run",
                             {"cap_mbps": bandwidth_mbps, "measured_mbps": mbps, "device": device})
    elif kind == "latency":
        with latency_mount(folder, workdir=workdir, latency_ms=latency_ms) as mnt:
            seen = files_under([mnt])

            def cold_both() -> None:
                evict(files)
                evict(seen)
            cold_both()
            mbps = measure_read_mbps(max(seen, key=lambda p: p.stat().st_size))
            yield Staged(kind, mnt, cold_both, f"FUSE passthrough +{latency_ms:g} ms per read request, 128 KiB "
                         f"max_read, multithreaded (1 reader measured {mbps:.0f} MB/s), evicted before each run",
                         {"latency_ms": latency_ms, "one_reader_mbps": mbps})
    else:
        raise ValueError(f"unknown storage kind {kind!r}; choose from {', '.join(KINDS)}")


def runs_per_kind(kinds: tuple[str, ...], folder: Path, *, run: Callable[[Staged, str], float],
                  variants: tuple[str, ...], repeats: int, workdir: Path, bandwidth_mbps: float = 200.0,
                  latency_ms: float = 4.0, log: Callable[[str], None] = print) -> dict[str, dict]:
    """For each storage kind: stage it, time ``run(staged, variant)`` for every variant ``repeats`` times
    (round-robin, rotated each round, ``before_run()`` before each), tear it down. A kind this host cannot make
    is reported as ``{"unavailable": reason}`` and the others still run."""
    out: dict[str, dict] = {}
    for kind in kinds:
        try:
            with stage(kind, folder, workdir=workdir, bandwidth_mbps=bandwidth_mbps, latency_ms=latency_ms) as st:
                log(f"storage {kind}: {st.note}")
                times: dict[str, list[float]] = {v: [] for v in variants}
                for r in range(repeats):
                    for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
                        st.before_run()
                        times[variant].append(run(st, variant))
                        log(f"  {kind} {variant}: {times[variant][-1]:.2f} s")
                out[kind] = {"note": st.note, "measured": st.measured, "runs_s": times,
                             "median_s": {v: sorted(t)[len(t) // 2] for v, t in times.items()}}
        except Unavailable as err:
            log(f"storage {kind}: could not make it here: {err}")
            out[kind] = {"unavailable": str(err)}
    return out
