"""Checkpoint files that change while a load reads them: named, never loaded as wrong weights.

The headers are read once (``checkpoint.resolve_checkpoint``) and the bytes later, by offsets those headers gave.
A shard truncated or replaced in between (a sync job, a second download into the same folder, a network store
serving another version) would otherwise fail with whatever the read meets, naming nothing, or -- a file replaced
by one of the same size -- load its bytes as the weights the old header described, silently. :func:`stamp` records
each file's identity (device, inode, size, modification time) right after its header is read;
:func:`check_unchanged` compares after a component's load and when it failed, and raises
:class:`CheckpointChangedError` naming the first file that changed and how. A file changed after its bytes were read is refused too: its loaded bytes may be the old ones, but which
version was read cannot be told.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from vllm_diffusion_plugin.engine.errors import CheckpointChangedError


@dataclass(frozen=True)
class FileStamp:
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def stamp(files: Iterable[Path]) -> dict[Path, FileStamp]:
    """Each file's identity now (call right after its header was read)."""
    return {Path(f): FileStamp.of(Path(f)) for f in files}


def _how(path: Path, before: FileStamp) -> str | None:
    try:
        now = FileStamp.of(path)
    except OSError as exc:
        return f"it is gone ({exc.strerror or exc})"
    if (now.device, now.inode) != (before.device, before.inode):
        return f"it was replaced by another file ({before.size} -> {now.size} bytes)"
    if now.size != before.size:
        return f"it was truncated or extended ({before.size} -> {now.size} bytes)"
    if now.mtime_ns != before.mtime_ns:
        return "it was rewritten in place (same size, new modification time)"
    return None


def check_unchanged(stamps: Mapping[Path, FileStamp], *, component: str) -> None:
    """Raise :class:`CheckpointChangedError` naming the first of ``stamps``' files that changed since stamped."""
    for path, before in stamps.items():
        how = _how(path, before)
        if how is not None:
            raise CheckpointChangedError(f"{path} changed while the load of {component} read it: {how}; its "
                                         f"header no longer describes its bytes, nothing of {component} is kept. "
                                         f"Load again once the checkpoint is complete")


@contextlib.contextmanager
def unchanged(stamps: Mapping[Path, FileStamp], *, component: str) -> Iterator[None]:
    """Around one component's read: a file of it that changed since stamped is named (:func:`check_unchanged`),
    whether the read failed on it or read it silently."""
    try:
        yield
    except Exception:
        check_unchanged(stamps, component=component)  # raises when a file changed (the read's error its context)
        raise
    check_unchanged(stamps, component=component)
