"""A checkpoint served by a FUSE store that fails the reads of one file from a chosen byte on (the passthrough
mount of ``benchmarks/storage.py``, ``ReadFault``): a stall (the read never answers) or an I/O error (EIO). Skips
the test, saying why, where no FUSE mount can be made (no /dev/fuse, no fusermount, no fusepy / libfuse2: the
``test`` extra and ``apt-get install fuse libfuse2``).

    with faulty_store(checkpoint, tmp_path, shard, mode="stall") as (mounted, fault):
        ... load ``mounted`` ...; wait_for(fault.marker) says which process met the fault
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def faulty_store(checkpoint: Path, where: Path, shard: Path, *, mode: str) -> Iterator[tuple[Path, object]]:
    """``checkpoint`` through a FUSE mount under ``where`` whose reads of ``shard`` (a file in ``checkpoint``)
    fail with ``mode`` from its last page on (its last tensor's bytes; never its header)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import storage

    relative = shard.relative_to(checkpoint.parent)
    fault = storage.ReadFault(file=str(relative), offset=shard.stat().st_size - 1, mode=mode,
                              marker=where / f"fault-{mode}.json")
    try:
        with storage.fuse_mount(checkpoint, where / "store", fault=fault) as mounted:
            yield mounted, fault
    except storage.Unavailable as exc:
        pytest.skip(f"no FUSE store here: {exc}")


def wait_for(marker: Path, *, timeout_s: float = 300.0) -> dict:
    """The fault's record once a read met it (``pid``: the reading process); fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert time.monotonic() < deadline, f"no read reached the fault within {timeout_s:.0f} s"
        time.sleep(0.1)
    return json.loads(marker.read_text())
