"""A memory cgroup around a test's child processes: this project's way to make one (``bench_capacity.MemoryLimit``:
cgroup v1 ``memory`` or v2, root), skipping the test where none can be made, removing the group afterwards.

    from cgroup_utils import memory_cgroup
    with memory_cgroup(2**30, "preflight-test") as (group, join):
        subprocess.run([...], preexec_fn=join)   # the child starts inside the group
        group.peak(), group.oom_kills()
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def memory_cgroup(limit: int, name: str) -> Iterator[tuple[Any, Callable[[], None]]]:
    """``(group, preexec_fn)`` for a memory cgroup of ``limit`` bytes named after ``name`` and this process."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_capacity as cap

    from vllm_diffusion_plugin.tools.servers import joining

    group = cap.MemoryLimit(limit, f"vllm-diffusion-{name}-{os.getpid()}")
    try:
        group.__enter__()
    except OSError as exc:
        pytest.skip(f"no memory cgroup here: {exc}")
    try:
        yield group, joining(group.path)
    finally:
        group.__exit__(None, None, None)
