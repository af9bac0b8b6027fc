"""The plan as a pre-flight (``engine/preflight.py``): what a node has left read from /proc and the memory cgroup
(v1 and v2, fake trees and a real group), and the CLI door refusing in one line a load that cannot fit a real
cgroup limit before any rank reads a weight byte, naming the strategy that fits and the switch that loads anyway.
The vLLM loader's door: ``tests/test_vllm_loader.py``; vllm-omni's: ``tests/omni/test_preflight_omni.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cgroup_utils import memory_cgroup

from vllm_diffusion_plugin.doors import cli

GiB = 2**30
V1_NO_LIMIT = "9223372036854771712"
CLI = [sys.executable, "-m", "vllm_diffusion_plugin.doors.cli"]
ROOT = Path(__file__).resolve().parents[1]


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_v1_the_tightest_level_of_the_hierarchy_less_its_inactive_file_pages(tmp_path):
    from vllm_diffusion_plugin.engine import memory as preflight

    root = _tree(tmp_path, {
        "proc/meminfo": "MemTotal: 33554432 kB\nMemAvailable: 10485760 kB\n",
        "proc/self/cgroup": "9:name=systemd:/\n4:memory:/jobs/one\n1:cpu:/\n0::/\n",
        "proc/self/mountinfo": "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
                               "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
                               "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_NO_LIMIT,
        "sys/fs/cgroup/memory/memory.usage_in_bytes": str(20 * GiB),
        "sys/fs/cgroup/memory/jobs/memory.limit_in_bytes": str(4 * GiB),
        "sys/fs/cgroup/memory/jobs/memory.usage_in_bytes": str(3 * GiB),
        "sys/fs/cgroup/memory/jobs/memory.stat": f"cache 5\ninactive_file 7\ntotal_inactive_file {GiB}\n",
        "sys/fs/cgroup/memory/jobs/one/memory.limit_in_bytes": V1_NO_LIMIT,
        "sys/fs/cgroup/memory/jobs/one/memory.usage_in_bytes": str(GiB),
    })
    (found,) = preflight.cgroup_headroom(root)
    assert found.available == 2 * GiB and "jobs" in found.source and "v1" in found.source  # 4 - (3 - 1)
    assert preflight.host_available(root) == found  # tighter than MemAvailable's 10 GiB


def test_v2_max_is_no_limit_and_a_parent_limit_counts(tmp_path):
    from vllm_diffusion_plugin.engine import memory as preflight
    from vllm_diffusion_plugin.engine.memory import HostMemory

    root = _tree(tmp_path, {
        "proc/meminfo": "MemAvailable: 10485760 kB\n",
        "proc/self/cgroup": "0::/user.slice/job\n",
        "proc/self/mountinfo": "41 23 0:38 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
        "sys/fs/cgroup/cgroup.controllers": "cpu memory pids\n",
        "sys/fs/cgroup/user.slice/memory.max": str(8 * GiB),
        "sys/fs/cgroup/user.slice/memory.current": str(7 * GiB),
        "sys/fs/cgroup/user.slice/memory.stat": "anon 1\ninactive_file 0\n",
        "sys/fs/cgroup/user.slice/job/memory.max": "max",
        "sys/fs/cgroup/user.slice/job/memory.current": str(GiB),
    })
    (found,) = preflight.cgroup_headroom(root)
    assert found.available == GiB and "user.slice" in found.source and "v2" in found.source
    (root / "sys/fs/cgroup/user.slice/memory.max").write_text("max")
    assert preflight.cgroup_headroom(root) == []
    assert preflight.host_available(root) == HostMemory(10 * GiB, "MemAvailable")


def test_nothing_readable_is_no_figure(tmp_path):
    from vllm_diffusion_plugin.engine import memory as preflight

    assert preflight.host_available(tmp_path) is None


def test_a_real_memory_cgroup_is_the_figure_of_a_process_in_it():
    """This project's way to make a group (``bench_capacity.MemoryLimit``, root): a process inside a 1 GiB group
    reads at most 1 GiB available, and its group's path in the figure's source."""
    with memory_cgroup(GiB, "preflight-test") as (group, join):
        code = ("from vllm_diffusion_plugin.engine.memory import host_available as h; m = h(); "
                "print(m.available, m.source)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                             preexec_fn=join, check=True).stdout.split(maxsplit=1)
        assert 0 < int(out[0]) <= GiB and group.name in out[1], out


@pytest.fixture(scope="module")
def sparse_wan(tmp_path_factory) -> Path:
    """Wan2.2 at A14B width, 2 blocks per transformer (1.93 GB of bf16 each), the data regions holes: the plan
    sees real sizes, the disk holds 7 MB."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_real_size as prs

    manifest = prs.write_pipeline(tmp_path_factory.mktemp("sparse-wan"), transformer=dict(prs.WAN_A14B, num_layers=2),
                                  vae=None, text_encoder=None, lora_rank=8)
    return Path(manifest["pipeline"])


def _plan(capsys, *args: str) -> dict:
    assert cli.main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_refuses_a_load_over_its_cgroup_limit_before_any_rank_reads(sparse_wan):
    """``broadcast`` at 2 ranks holds each DiT whole on both ranks (~5.9 GiB that the kernel cannot drop on this
    node), ``rank_local`` each rank's half (~3.6 GiB). In a memory cgroup between the two (with the ~0.55 GiB of
    imports each process holds), the load is refused in one line naming the ranks, both figures, ``rank_local``
    and the switch that loads anyway, before any rank is spawned: the group never holds a weight (its peak stays
    far below one DiT) and nothing is OOM-killed. Today's code spawned the ranks, which read until the kernel killed one."""
    import torch

    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.plan import plan_load

    args = [str(sparse_wan), "--device", "cpu", "--dtype", "bfloat16", "--nproc", "2"]
    plan = plan_load(str(sparse_wan), options=LoadOptions(), world_size=2, hsdp=HSDPConfig(), dtype=torch.bfloat16)
    wanted, fitting = (plan.node_host_need(s, first_run=False)[0] for s in ("broadcast", "rank_local"))
    assert wanted > fitting + 2 * GiB, (wanted, fitting)  # the load's figures (the CLI runs no first run)
    limit = int(fitting + 2.75 * GiB)  # the launcher's and the two ranks' imports (~0.55 GiB private each), 1 GiB
    with memory_cgroup(limit, "preflight-cli") as (group, join):
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION")}
        started = time.monotonic()
        proc = subprocess.run([*CLI, "load", *args, "--hsdp-weight-load", "broadcast"], capture_output=True,
                              text=True, timeout=600, env=env, cwd=ROOT, preexec_fn=join)
        seconds = time.monotonic() - started
        peak, kills = group.peak(), group.oom_kills()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("vllm-diffusion: ")]
    assert proc.returncode == 1 and len(errors) == 1, (proc.returncode, kills, proc.stderr[-3000:])
    line = errors[0]
    for word in ("pre-flight", "hsdp_weight_load='broadcast' does not fit ranks 0-1's host", "host peak",
                 "available", "cgroup", "(pick: rank_local)", "--preflight warn", "VLLM_DIFFUSION_PREFLIGHT=warn"):
        assert word in line, line
    assert "rank_local" in line.split("fits: ")[1], line
    assert kills == 0 and peak < 2.5 * GiB, (peak, kills)  # the launcher alone; no DiT byte held
    assert seconds < 60, seconds


def test_cli_warn_loads_anyway_and_refuse_is_one_line(tiny_wan_dir, capsys, monkeypatch, caplog):
    """One process (the load runs in the CLI's own): a node with 1 KB left refuses ``full`` (an fp32 checkpoint cast
    to bf16: copies, not views of its files) saying that nothing fits; ``--preflight warn`` (or
    VLLM_DIFFUSION_PREFLIGHT=warn) logs the same words and loads; ``off`` plans nothing."""
    from vllm_diffusion_plugin.engine import memory as preflight
    from vllm_diffusion_plugin.engine.memory import HostMemory

    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    monkeypatch.setattr(preflight, "host_available", lambda root=Path("/"): HostMemory(1000, "test"))
    args = ["load", str(tiny_wan_dir), "--device", "cpu", "--dtype", "bfloat16"]
    assert cli.main(args) == 1
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("vllm-diffusion: ")]
    assert "rank 0's host" in line and "fits: none" in line and "1KB available" in line, line
    assert cli.main([*args, "--preflight", "warn", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0]["bytes_read"] > 0
    assert any("pre-flight" in r.getMessage() and "loading anyway" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("VLLM_DIFFUSION_PREFLIGHT", "warn")
    assert cli.main(args) == 0
    monkeypatch.setenv("VLLM_DIFFUSION_PREFLIGHT", "off")
    assert cli.main(args) == 0


def test_device_check_names_the_rank_and_what_fits(tiny_wan_dir):
    """Against an accelerator's free memory: a device peak above it is refused naming the rank and the figures."""
    from vllm_diffusion_plugin.engine import preflight
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.plan import plan_load

    plan = plan_load(str(tiny_wan_dir), options=LoadOptions(), world_size=2, hsdp=HSDPConfig(),
                     device_type="cuda")
    need = max(plan.device_need(r) for r in plan.ranks if r.strategy == "full")
    assert preflight.check_device(plan, "full", rank=1, free=need) is None
    problem = preflight.check_device(plan, "full", rank=1, free=need // 3)
    assert problem.startswith("hsdp_weight_load='full' does not fit rank 1's accelerator: device peak"), problem
    assert "free; fits:" in problem
    with pytest.raises(preflight.PreflightError, match="to load anyway: SWITCH"):
        preflight.enforce([None, problem], mode="refuse", how="SWITCH")
    preflight.enforce([problem], mode="warn", how="SWITCH")
