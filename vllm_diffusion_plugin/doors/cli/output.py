"""``--save-fused`` output written atomically: a hidden staging folder next to OUT_DIR, renamed at the end.

``Staging.create`` makes ``.<OUT_DIR name>.partial-<id>`` beside OUT_DIR before any weight is read (so an
unwritable place fails first, in one line); the loaded components are written into it; ``commit`` completes
it and renames it to OUT_DIR. From a pipeline folder the result is a complete pipeline: ``model_index.json``
and every component not loaded (VAE, text encoders, tokenizer, scheduler ...) are hard-linked into it when on
the same filesystem, else copied, unchanged. ``discard`` (after a failure or an interrupt) removes the staging
folder: OUT_DIR either appears complete or not at all.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


def check_output_dir(out_dir: Path, *, flag: str) -> None:
    """OUT_DIR must not exist, or be an empty folder (it is replaced by one rename)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{flag} {out_dir} exists and is not an empty folder")


@dataclass
class Staging:
    """The folder the output is written into until it is complete."""

    path: Path
    target: Path
    committed: bool = False

    @classmethod
    def create(cls, target: Path, *, flag: str) -> Staging:
        target = Path(target).absolute()
        check_output_dir(target, flag=flag)
        path = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir()
        except OSError as exc:
            raise OSError(f"{flag} {target}: cannot write there ({exc.strerror or exc})") from exc
        return cls(path, target)

    def commit(self, sources: Sequence, *, checkpoint: str | os.PathLike) -> Path:
        """Complete a pipeline folder with what was not loaded, then rename the staging folder into place."""
        root = pipeline_root(sources, checkpoint)
        if root is not None:
            loaded = {s.name for s in sources}
            for entry in sorted(root.iterdir()):
                if entry.name not in loaded and not entry.name.startswith("."):
                    _link_or_copy(entry, self.path / entry.name)
        if self.target.exists():
            self.target.rmdir()  # checked empty before the load; a file or content there now is an error
        self.path.rename(self.target)
        self.committed = True
        return self.target

    def discard(self) -> None:
        if not self.committed:
            shutil.rmtree(self.path, ignore_errors=True)


def pipeline_root(sources: Sequence, checkpoint: str | os.PathLike) -> Path | None:
    """The pipeline folder the sources were resolved from, or None for a single component folder."""
    if not sources:
        return None
    folder = sources[0].folder
    if not (folder.parent / "model_index.json").is_file():
        return None
    if Path(checkpoint).exists() and Path(checkpoint).resolve() == folder.resolve():
        return None  # the component folder itself was given
    return folder.parent


def _link_or_copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        dst.mkdir()
        for entry in sorted(src.iterdir()):
            _link_or_copy(entry, dst / entry.name)
        return
    try:
        os.link(src, dst)  # follows symlinks (Hugging Face cache snapshots): links the blob itself
    except OSError:
        shutil.copy2(src, dst)
