"""The capacity benchmark's own parts (``benchmarks/bench_capacity.py``): the memory limit really limits a server
started in it and counts its OOM kill, and each setting asks vllm-omni for the load it names."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_capacity as cap  # noqa: E402
from cgroup_utils import memory_cgroup  # noqa: E402

from vllm_diffusion_plugin.tools import servers as sv  # noqa: E402

MiB = 2**20


@contextlib.contextmanager
def _limited(limit: int) -> Iterator[cap.MemoryLimit]:
    """A memory cgroup of ``limit`` bytes, removed afterwards; the test is skipped where none can be made."""
    with memory_cgroup(limit, "capacity-test") as (group, _):
        yield group


def _start_in(group: cap.MemoryLimit, code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, preexec_fn=sv.joining(group.path))


def test_a_process_past_the_limit_is_oom_killed_counted_and_the_group_removed():
    with _limited(128 * MiB) as group:
        watch = cap.OomWatch(group)
        watch.start()
        proc = _start_in(group, "import time; b = bytearray(512 << 20); time.sleep(60)")
        assert proc.wait(timeout=60) == -9
        assert watch.stop() >= 1
    assert not group.path.exists()


def test_a_process_within_the_limit_runs_and_the_peak_is_the_groups():
    with _limited(512 * MiB) as group:
        proc = _start_in(group, "b = bytearray(64 << 20)")
        assert proc.wait(timeout=60) == 0
        assert group.oom_kills() == 0
        assert 64 * MiB <= group.peak() < 512 * MiB


def test_oom_watch_ends_the_whole_group_at_the_first_kill():
    """A server whose worker was killed would wait for its ready timeout; the watch kills the rest at once."""
    with _limited(160 * MiB) as group:
        watch = cap.OomWatch(group)
        watch.start()
        survivor = _start_in(group, "import time; time.sleep(120)")
        started = time.monotonic()
        _start_in(group, "b = bytearray(512 << 20)")
        assert survivor.wait(timeout=30) == -9 and time.monotonic() - started < 30
        watch.stop()


@pytest.mark.parametrize("setting, size, want, absent", [
    ("omni", 2, ["--use-hsdp", "--hsdp-shard-size", "2", "--lora-backend"], ["--load-format"]),
    ("omni", 1, ["--lora-path"], ["--use-hsdp", "--load-format"]),
    ("omni-broadcast", 4, ["--enable-broadcast-weight-load", "--hsdp-shard-size", "4"], ["--load-format"]),
    ("ours", 2, ["--load-format", "diffusion-hsdp", "--use-hsdp"], ["--enable-broadcast-weight-load"]),
    ("ours", 1, ["--load-format", "diffusion-hsdp"], ["--use-hsdp", "--additional-config"]),
    ("omni-fp8", 2, ["--quantization", "torch_fp8", "--use-hsdp"], ["--load-format"]),
    ("ours-fp8", 2, ["--quantization", "torch_fp8", "--load-format", "diffusion-hsdp"], ["--enable-broadcast-weight-load"]),
])
def test_each_setting_asks_for_its_load(tmp_path, setting, size, want, absent):
    spec = cap.spec_for(setting, size, tmp_path, [tmp_path / "h.safetensors", tmp_path / "l.safetensors"],
                        name="x", cgroup=tmp_path, init_timeout_s=60)
    command = sv.server_command(spec, 8000)
    for arg in want:
        assert arg in command, (arg, command)
    for arg in absent:
        assert arg not in command, (arg, command)
    assert spec.plugin is setting.startswith("ours") and spec.cgroup == tmp_path
    assert int(spec.env["VLLM_DIFFUSION_OMNI_CPU_DEVICES"]) >= size
    if setting.startswith("ours") and size > 1:
        extra = json.loads(command[command.index("--additional-config") + 1])
        assert extra == {"diffusion_hsdp": {"hsdp_weight_load": "rank_local"}}
    for bad in ("nope", "nope-fp8"):
        with pytest.raises(ValueError, match="unknown setting"):
            cap.spec_for(bad, size, tmp_path, [], name="x", cgroup=tmp_path, init_timeout_s=60)


@pytest.mark.parametrize("statuses, passes", [
    ({"ours": "refused", "omni-fp8": "oom", "ours-fp8": "served"}, True),
    ({"ours": "oom", "omni-fp8": "served", "ours-fp8": "served"}, False),  # vllm-omni's own fp8 load fitted
    ({"omni": "oom", "ours": "served"}, True),
    ({"omni": "failed", "ours": "served"}, False),  # a crash is not "does not fit"
])
def test_the_limit_goal_takes_the_leanest_of_ours(statuses, passes):
    rows = [{"run": "limit", "setting": s, "status": st, "limit": 14 * cap.GiB, "S": 2, "blocks": 6}
            for s, st in statuses.items()]
    (goal,) = cap.judge(rows, {6: 1}, {})
    assert goal["pass"] is passes, goal
