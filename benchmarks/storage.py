"""Storage kinds for the read benchmarks: the checkpoint as users' hosts serve it, set up and torn down here.

- ``warm``: the files' pages are in the page cache (read once before each measurement);
- ``cold``: a local disk with the files' pages evicted before each measurement (``posix_fadvise(DONTNEED)``,
  checked with ``mincore``: ``vllm_diffusion_plugin.tools.pagecache``);
- ``throttled``: a bandwidth-capped cold disk: the checkpoint copied onto its own ext4 file system on a loop device,
  the measuring process in a blkio cgroup whose ``blkio.throttle.read_bps_device`` caps that device (cgroup v1;
  ``io.max`` on cgroup v2), pages evicted before each measurement;
- ``latency``: a latency-bound store (network file systems, object-store mounts): a FUSE passthrough mount
  (``fusepy``, multithreaded, ``max_read`` 128 KiB) that delays every read request by ``latency_ms``, pages evicted
  before each measurement. The same mount can fail the reads of one file from a chosen byte on (``ReadFault``:
  stall, EIO, slow), the store faults of ``tests/test_faults_store.py``.

``open_storage(kind, folder, workdir=...)`` yields a :class:`Storage` whose ``path`` shows ``folder`` through that
kind and whose ``prepare()`` makes the next read cold (or warm); whatever it made is removed on exit, also after an
error or Ctrl-C. A kind this host cannot make raises :class:`Unavailable` naming what is missing (root, a loop
device, ``/dev/fuse``, ``fusepy``/libfuse2: ``pip install -e ".[bench]"``, ``apt-get install fuse libfuse2``),
which the benchmarks report instead of a measurement.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("warm", "cold", "throttled", "latency")
CGROUP_V1_BLKIO = Path("/sys/fs/cgroup/blkio")
CGROUP_V2 = Path("/sys/fs/cgroup/unified")


class Unavailable(RuntimeError):
    """This host cannot make that storage kind; the message says what is missing."""


def parse_kinds(text: str) -> list[str]:
    """``all`` or a comma-separated list of :data:`KINDS`."""
    kinds = list(KINDS) if text == "all" else [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown storage kind(s) {unknown or text!r}; choose from {', '.join(KINDS)} or all")
    return kinds


@dataclass
class Storage:
    kind: str
    path: Path
    files: list[Path] = field(default_factory=list)
    note: str = ""

    def prepare(self) -> None:
        """Before a measurement: every page of the files in the cache (warm) or none (every other kind)."""
        from vllm_diffusion_plugin.tools import pagecache

        if self.kind == "warm":
            for file in self.files:
                with open(file, "rb") as f:
                    while f.read(64 << 20):
                        pass
        else:
            pagecache.evict(self.files)


@contextlib.contextmanager
def open_storage(kind: str, folder: Path, *, workdir: Path, bandwidth_mbps: float = 200.0,
                 latency_ms: float = 4.0) -> Iterator[Storage]:
    folder = Path(folder)
    if kind in ("warm", "cold"):
        yield _with_files(Storage(kind, folder))
    elif kind == "throttled":
        with loop_copy(folder, workdir / "throttled") as (path, device):
            with _read_cap(device, int(bandwidth_mbps * 1e6)) as how:
                yield _with_files(Storage(kind, path, note=f"{bandwidth_mbps:g} MB/s cap on {device} ({how})"))
    elif kind == "latency":
        with fuse_mount(folder, workdir / "latency", latency_ms=latency_ms) as path:
            yield _with_files(Storage(kind, path, note=f"{latency_ms:g} ms per read request (FUSE)"))
    else:
        raise ValueError(f"unknown storage kind {kind!r}")


def _with_files(storage: Storage) -> Storage:
    storage.files = sorted(p for p in storage.path.rglob("*") if p.is_file())
    return storage


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise Unavailable(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()[:300]}")
    return done.stdout.strip()


@contextlib.contextmanager
def loop_copy(folder: Path, where: Path) -> Iterator[tuple[Path, str]]:
    """``folder`` copied onto its own ext4 file system on a loop device; yields (copy, 'MAJ:MIN')."""
    if os.geteuid() != 0:
        raise Unavailable("a loop device and a blkio cgroup need root")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            raise Unavailable(f"{tool} is not installed")
    where.mkdir(parents=True, exist_ok=True)
    image, mountpoint = where / "disk.img", where / "mnt"
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    with open(image, "wb") as f:
        f.truncate(int(size * 1.3) + (64 << 20))
    device = mounted = None
    try:
        _run("mkfs.ext4", "-q", "-F", str(image))
        device = _run("losetup", "--find", "--show", str(image))
        mountpoint.mkdir(exist_ok=True)
        _run("mount", device, str(mountpoint))
        mounted = mountpoint
        shutil.copytree(folder, mountpoint / folder.name)
        os.sync()
        st = os.stat(device)
        yield mountpoint / folder.name, f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    finally:
        if mounted is not None:
            subprocess.run(["umount", str(mounted)], capture_output=True)
        if device is not None:
            subprocess.run(["losetup", "-d", device], capture_output=True)
        image.unlink(missing_ok=True)


@contextlib.contextmanager
def capped_cgroup(device: str, bytes_per_s: int, *, name: str) -> Iterator[tuple[Path, str]]:
    """A new cgroup ``name`` capping reads from ``device``, holding no process yet: yields (its folder, how it caps);
    a process joins by writing its pid to ``cgroup.procs``. Removed on exit (its processes must have left)."""
    if (CGROUP_V1_BLKIO / "blkio.throttle.read_bps_device").exists():
        group, limit, line, how = (CGROUP_V1_BLKIO / name, "blkio.throttle.read_bps_device",
                                   f"{device} {bytes_per_s}", "cgroup v1 blkio.throttle.read_bps_device")
    elif (CGROUP_V2 / "cgroup.controllers").exists() and "io" in (CGROUP_V2 / "cgroup.controllers").read_text():
        group, limit, line, how = CGROUP_V2 / name, "io.max", f"{device} rbps={bytes_per_s}", "cgroup v2 io.max"
    else:
        raise Unavailable("no blkio (cgroup v1) or io (cgroup v2) controller to cap a device's read bandwidth")
    group.mkdir()
    try:
        (group / limit).write_text(line)
        yield group, how
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@contextlib.contextmanager
def _read_cap(device: str, bytes_per_s: int) -> Iterator[str]:
    """This process (and the threads and children it starts) in a cgroup capping reads from ``device``."""
    with capped_cgroup(device, bytes_per_s, name=f"vllm-diffusion-bench-{os.getpid()}") as (group, how):
        (group / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield how
        finally:
            (group.parent / "cgroup.procs").write_text(str(os.getpid()))


FUSE_SERVER = r"""
import errno, json, os, sys, threading, time
from fuse import FUSE, FuseOSError, Operations, fuse_get_context

class Delayed(Operations):
    def __init__(self, root, delay, fault):
        self.root, self.delay, self.fault = root, delay, fault
        self.stalled = threading.Event()  # never set: a stalled read waits until the server is stopped
    def _p(self, path):
        return os.path.join(self.root, path.lstrip("/"))
    def getattr(self, path, fh=None):
        st = os.lstat(self._p(path))
        return {k: getattr(st, k) for k in ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink",
                                            "st_size", "st_uid")}
    def readdir(self, path, fh):
        return [".", ".."] + os.listdir(self._p(path))
    def open(self, path, flags):
        return os.open(self._p(path), os.O_RDONLY)
    def read(self, path, size, offset, fh):
        time.sleep(self.delay)
        fault = self.fault
        if fault and path.lstrip("/") == fault["file"] and offset + size > fault["offset"]:
            self._mark(path, offset, size)
            if fault["mode"] == "stall":
                self.stalled.wait()
            if fault["mode"] == "eio":
                raise FuseOSError(errno.EIO)
            time.sleep(5.0)  # slow: every request past the offset answers after 5 s
        return os.pread(fh, size, offset)
    def _mark(self, path, offset, size):
        pid = fuse_get_context()[2]  # the reading thread
        try:
            with open(f"/proc/{pid}/status") as f:
                pid = next(int(line.split()[1]) for line in f if line.startswith("Tgid:"))
        except (OSError, StopIteration):
            pass
        with open(self.fault["marker"] + ".tmp", "w") as f:
            json.dump({"pid": pid, "path": path, "offset": offset, "size": size}, f)
        os.replace(self.fault["marker"] + ".tmp", self.fault["marker"])
    def release(self, path, fh):
        os.close(fh)
    def statfs(self, path):
        st = os.statvfs(self._p(path))
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                                            "f_files", "f_flag", "f_frsize", "f_namemax")}

fault = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
more = {"max_readahead": 0} if fault else {}  # a fault: page-sized requests, so a header read never reaches it
FUSE(Delayed(sys.argv[1], float(sys.argv[3]) / 1000, fault), sys.argv[2], foreground=True, nothreads=False, ro=True,
     max_read=131072, **more)
"""


@dataclass(frozen=True)
class ReadFault:
    """What the FUSE store does to the reads of one file: ``file`` (relative to the mounted folder's parent, as
    the mount shows it), from byte ``offset`` on: ``stall`` (the read never answers, until the server is stopped;
    Linux then keeps the reading thread in an uninterruptible wait, SIGKILL or not), ``eio`` (the read fails with
    EIO) or ``slow`` (each request answers after 5 s). Every such read writes ``marker`` (JSON: ``pid`` of the
    reading process, ``path``, ``offset``, ``size`` of the request)."""

    file: str
    offset: int
    mode: str
    marker: Path

    def __post_init__(self) -> None:
        if self.mode not in ("stall", "eio", "slow"):
            raise ValueError(f"read fault mode must be stall, eio or slow, got {self.mode!r}")


@contextlib.contextmanager
def fuse_mount(folder: Path, where: Path, *, latency_ms: float = 0.0, fault: ReadFault | None = None) -> Iterator[Path]:
    """``folder`` shown through a FUSE passthrough mount under ``where`` (each read delayed by ``latency_ms``,
    ``fault`` applied); yields the folder's path there. Unmounted and the server stopped on exit."""
    if not Path("/dev/fuse").exists():
        raise Unavailable("/dev/fuse is missing (no FUSE in this kernel or container)")
    if shutil.which("fusermount") is None and shutil.which("fusermount3") is None:
        raise Unavailable("fusermount is not installed (apt-get install fuse libfuse2)")
    try:
        import fuse  # noqa: F401
    except (ImportError, OSError) as exc:
        raise Unavailable(f"fusepy cannot load libfuse ({exc}): pip install -e \".[bench]\"; apt-get install "
                          f"fuse libfuse2") from exc
    mountpoint = where / "mnt"
    mountpoint.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-c", FUSE_SERVER, str(folder.parent), str(mountpoint), str(latency_ms)]
    if fault is not None:
        argv.append(json.dumps({"file": fault.file, "offset": fault.offset, "mode": fault.mode,
                                "marker": str(fault.marker)}))
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(100):
            if os.path.ismount(mountpoint):
                break
            if server.poll() is not None:
                raise Unavailable(f"the FUSE server exited: {server.stderr.read().decode()[-300:]}")
            time.sleep(0.05)
        else:
            raise Unavailable("the FUSE mount did not appear within 5 s")
        yield mountpoint / folder.name
    finally:
        if subprocess.run(["fusermount", "-u", str(mountpoint)], capture_output=True, check=False).returncode:
            # a reader still in it (stuck in a stalled read): detach now, gone once the server stops below
            subprocess.run(["fusermount", "-u", "-z", str(mountpoint)], capture_output=True, check=False)
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
