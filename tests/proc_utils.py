"""Processes a test started, seen through Linux ``/proc``: a launcher's descendants, which of them are its local
ranks, whether one is still alive (a zombie is not)."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """``pid``'s children (those of every thread of it)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """``pid``'s children, their children, and so on: a launcher's fork server, its ranks (the server's
    children), its resource tracker."""
    found, todo = [], children(pid)
    while todo:
        child = todo.pop(0)
        if child not in found:
            found.append(child)
            todo += children(child)
    return found


def is_rank(pid: int) -> bool:
    """A launcher's rank (not its fork server or resource tracker): named ``vd-rankN`` (forked from the fork
    server), or a ``multiprocessing`` spawn child (a launcher where there is no fork server)."""
    try:
        if Path(f"/proc/{pid}/comm").read_text().startswith("vd-rank"):
            return True
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def ranks(launcher: int) -> list[int]:
    """The launcher's local ranks now."""
    return [p for p in descendants(launcher) if is_rank(p)]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
