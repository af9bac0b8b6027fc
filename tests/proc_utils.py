"""Processes a test started, seen through Linux ``/proc``: a launcher's children, which of them are spawned ranks,
whether one is still alive (a zombie is not)."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def is_rank(pid: int) -> bool:
    """A ``multiprocessing`` spawn child (a launcher's rank; not its resource tracker)."""
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"

