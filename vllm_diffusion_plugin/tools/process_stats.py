"""Memory and I/O of every process of a server's process group, sampled while it runs (used by
``tools.servers.serve(sample_s=...)``): peak RSS per process from the kernel's high-water mark (``VmHWM``) and
the largest sampled ``VmRSS``, storage and syscall read bytes from ``/proc/PID/io``, and each process's role
from its title. Linux only (``/proc``)."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

ROLES = (("DiffusionWorker", "worker"), ("StageEngineCore", "engine"), ("APIServer", "api"))
"""Process title substring -> role (vLLM's ``set_process_title``: ``VLLM::APIServer``,
``VLLM::StageEngineCoreProc_...``, vllm-omni's ``vLLM-Omni::DiffusionWorker_FS0``)."""


@dataclass
class ProcessStats:
    """One process of a server's group, as last sampled. ``peak_rss`` is the kernel's high-water mark
    (``VmHWM`` in ``/proc/PID/status``), ``max_sampled_rss`` the largest ``VmRSS`` seen by the sampler;
    ``read_bytes`` / ``rchar`` from ``/proc/PID/io`` (storage reads, which page-cache hits do not count, and
    bytes through read syscalls, which mmap faults do not count); ``rss_anon`` / ``rss_file`` the private and
    file-backed parts of the last sampled ``VmRSS`` (``RssAnon`` / ``RssFile``), ``max_sampled_anon`` the largest
    ``RssAnon`` seen (what the kernel cannot drop under a memory limit without swap)."""

    pid: int
    title: str
    role: str
    peak_rss: int = 0
    max_sampled_rss: int = 0
    read_bytes: int = 0
    rchar: int = 0
    rss_anon: int = 0
    rss_file: int = 0
    max_sampled_anon: int = 0
    at_marks: dict[str, dict[str, int]] = field(default_factory=dict)
    """Label -> this process's ``peak_rss`` / ``rss`` (VmRSS then; ``rss_anon`` / ``rss_file`` its parts) /
    ``read_bytes`` sampled right after its log line
    with that mark
    (:class:`GroupSampler` ``marks``; e.g. the end of its load phase, before the warm-up run)."""

    def as_dict(self) -> dict:
        return {"pid": self.pid, "title": self.title, "role": self.role, "peak_rss": self.peak_rss,
                "max_sampled_rss": self.max_sampled_rss, "read_bytes": self.read_bytes, "rchar": self.rchar,
                "rss_anon": self.rss_anon, "rss_file": self.rss_file, "max_sampled_anon": self.max_sampled_anon,
                "at_marks": self.at_marks}


def role_of(title: str) -> str:
    return next((role for key, role in ROLES if key in title), "other")


def group_pids(pgid: int, proc: Path = Path("/proc")) -> list[int]:
    """PIDs whose process group is ``pgid`` (field 5 of ``/proc/PID/stat``)."""
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 2 and int(fields[2]) == pgid:
            pids.append(int(entry.name))
    return pids


def read_process(pid: int, proc: Path = Path("/proc")) -> ProcessStats | None:
    """``pid``'s title (its command line, as ``setproctitle`` rewrites it), memory and I/O figures; None when it
    is gone."""
    base = proc / str(pid)
    try:
        title = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        status = dict(line.split(":", 1) for line in (base / "status").read_text().splitlines() if ":" in line)
        io = dict(line.split(":", 1) for line in (base / "io").read_text().splitlines() if ":" in line)
    except OSError:
        return None
    kib = lambda key: int(status.get(key, "0 kB").split()[0]) * 1024  # noqa: E731
    title = title or status.get("Name", "").strip()
    return ProcessStats(pid=pid, title=title, role=role_of(title), peak_rss=kib("VmHWM"),
                        max_sampled_rss=kib("VmRSS"), read_bytes=int(io.get("read_bytes", 0)),
                        rchar=int(io.get("rchar", 0)), rss_anon=kib("RssAnon"), rss_file=kib("RssFile"),
                        max_sampled_anon=kib("RssAnon"))


_LOG_PID = re.compile(r"\(\w+ pid=(\d+)\)")
"""vLLM's log prefix of a process's lines: ``(DiffusionWorker_FS0 pid=123)``."""


class GroupSampler(threading.Thread):
    """Samples every process of a process group every ``interval_s`` until :meth:`finish`; keeps each PID's
    latest title and I/O counters and its largest ``VmHWM`` / ``VmRSS`` (a process that exits keeps its last).

    ``log`` and ``marks`` (label -> text): when a new line of ``log`` holds a mark's text, the process named in the
    line's prefix has its figures of that moment kept under the label (``ProcessStats.at_marks``)."""

    def __init__(self, pgid: int, *, interval_s: float = 0.2, proc: Path = Path("/proc"), log: Path | None = None,
                 marks: dict[str, str] | None = None) -> None:
        super().__init__(name=f"sampler-{pgid}", daemon=True)
        self.pgid, self.interval_s, self.proc = pgid, interval_s, proc
        self.log, self.marks, self._log_offset = log, dict(marks or {}), 0
        self.seen: dict[int, ProcessStats] = {}
        self._rss: dict[int, int] = {}
        self._done = threading.Event()
        self._lock = threading.Lock()

    def _marked(self) -> list[tuple[int, str]]:
        """(pid, label) of the log's new complete lines that hold a mark."""
        if self.log is None or not self.marks:
            return []
        try:
            with open(self.log, "rb") as f:
                f.seek(self._log_offset)
                chunk = f.read()
        except OSError:
            return []
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self._log_offset += len(complete)
        found = []
        for line in complete.decode(errors="replace").splitlines():
            for label, text in self.marks.items():
                pid = _LOG_PID.search(line)
                if text in line and pid:
                    found.append((int(pid[1]), label))
        return found

    def sample_once(self) -> None:
        marked = self._marked()  # read before the sample: the figures are from after the line was written
        for pid in group_pids(self.pgid, self.proc):
            now = read_process(pid, self.proc)
            if now is None:
                continue
            rss = now.max_sampled_rss  # this sample's VmRSS, before the maxima are carried over
            with self._lock:
                old = self.seen.get(pid)
                if old is not None:
                    now.peak_rss = max(now.peak_rss, old.peak_rss)
                    now.max_sampled_rss = max(now.max_sampled_rss, old.max_sampled_rss)
                    now.max_sampled_anon = max(now.max_sampled_anon, old.max_sampled_anon)
                    now.read_bytes, now.rchar = max(now.read_bytes, old.read_bytes), max(now.rchar, old.rchar)
                    now.at_marks = old.at_marks
                self.seen[pid] = now
                self._rss[pid] = rss
        with self._lock:
            for pid, label in marked:
                if pid in self.seen and label not in self.seen[pid].at_marks:
                    stats = self.seen[pid]
                    stats.at_marks[label] = {"peak_rss": stats.peak_rss, "rss": self._rss.get(pid, 0),
                                             "rss_anon": stats.rss_anon, "rss_file": stats.rss_file,
                                             "read_bytes": stats.read_bytes}

    def run(self) -> None:
        while not self._done.is_set():
            self.sample_once()
            self._done.wait(self.interval_s)

    def finish(self) -> dict[int, ProcessStats]:
        self._done.set()
        self.join(timeout=10)
        self.sample_once()
        with self._lock:
            return dict(self.seen)
