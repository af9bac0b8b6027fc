"""The pre-flight behind vllm-omni's door: the API server of ``vllm serve --omni --load-format diffusion-hsdp``
refuses, before any worker starts, a load the node's host cannot hold (vllm-omni's own projection of the stage's
arguments, ``extract_diffusion_stage_config_kwargs``, in a process inside a real memory cgroup), naming the
strategy that fits and the switch that loads anyway; a fitting one goes through; a worker holds its accelerator's
free memory against its device peak before vllm-omni builds anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omni_support import import_omni

import_omni()  # skips this module where vllm-omni is not installed

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
LIMIT = int(18.4 * GiB)
"""full (2 ranks, each both DiTs whole) does not fit, rank_local does, on 0.30 and 0.32 alike: the two workers need
17.65 GiB with full, 13.72 with rank_local (each worker's warm-up -- its shards, the root and three blocks gathered --
is rank_local's peak; with fewer blocks it is every strategy's, and they tie), and the API server holds 0.7 GiB (0.30)
to 1.3 GiB (0.32) before the check plus as much again per worker for the workers' imports."""
FLAG = "diffusion-hsdp"
API_SERVER = """
import json, sys
from vllm_diffusion_plugin.doors.omni import apply_patches
apply_patches()
from vllm_omni.config.omni_config import extract_diffusion_stage_config_kwargs
try:
    extract_diffusion_stage_config_kwargs(json.loads(sys.argv[1]), stage_id=0)
    print("ACCEPTED")
except Exception as exc:
    print(type(exc).__name__ + ": " + str(exc))
"""


@pytest.fixture(scope="module")
def sparse_wan(tmp_path_factory) -> Path:
    """Wan2.2 at A14B width, 6 blocks per transformer (4.74 GB of bf16 each), the data regions holes."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plan_real_size as prs

    manifest = prs.write_pipeline(tmp_path_factory.mktemp("sparse-wan"), transformer=dict(prs.WAN_A14B, num_layers=6),
                                  vae=None, text_encoder=None, lora_rank=8)
    return Path(manifest["pipeline"])


def _api_server_in(limit: int, args: dict) -> str:
    """vllm-omni's API-server projection of a stage with ``args``, in a fresh process inside a memory cgroup of
    ``limit`` bytes (``bench_capacity.MemoryLimit``); its last line."""
    from cgroup_utils import memory_cgroup

    with memory_cgroup(limit, "preflight-omni") as (group, join):
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION")}
        env.update(VLLM_DIFFUSION_PLUGIN="1", VLLM_DIFFUSION_OMNI_CPU="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-c", API_SERVER, json.dumps(args)], capture_output=True, text=True,
                              timeout=600, env=env, cwd=ROOT, preexec_fn=join)
        assert group.oom_kills() == 0
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_the_api_server_refuses_for_the_host_before_any_worker_starts(sparse_wan):
    """2 diffusion ranks (vllm-omni's --use-hsdp --hsdp-shard-size 2), ``full``: each worker holds both DiTs whole
    in vllm-omni's pipeline -- in an 18.4 GiB cgroup that cannot fit, ``rank_local`` (each its half, then its
    warm-up) does. Refused in one line in the API server; the same stage with ``rank_local`` is accepted."""
    from vllm_diffusion_plugin.engine.memory import meminfo_available

    if (meminfo_available() or 0) < LIMIT:
        pytest.skip(f"this host has less than {LIMIT / GiB:.1f} GiB available: MemAvailable, not the cgroup, would "
                    f"decide")
    stage = {"model": str(sparse_wan), "dtype": "bfloat16", "load_format": FLAG,
             "parallel_config": {"use_hsdp": True, "hsdp_shard_size": 2, "hsdp_replicate_size": 1}}
    line = _api_server_in(LIMIT, stage)
    assert line.startswith("PreflightError: pre-flight: hsdp_weight_load='full' does not fit ranks 0-1's host"), line
    for word in ("host peak", "available", "cgroup", "rank_local", '"preflight": "warn" in --additional-config '
                 "diffusion_hsdp", "VLLM_DIFFUSION_PREFLIGHT=warn"):
        assert word in line, line
    flat = {k: v for k, v in stage.items() if k != "parallel_config"} | stage["parallel_config"]  # as the CLI gives
    assert _api_server_in(LIMIT, flat).startswith("PreflightError: pre-flight: hsdp_weight_load='full' does not "
                                                  "fit ranks 0-1's host")
    line = _api_server_in(LIMIT, {**stage, "additional_config": {"diffusion_hsdp": {"hsdp_weight_load":
                                                                                        "rank_local"}}})
    assert line == "ACCEPTED", line
    line = _api_server_in(LIMIT, {**stage, "additional_config": {"diffusion_hsdp": {"preflight": "warn"}}})
    assert line == "ACCEPTED", line


def test_a_worker_refuses_for_its_accelerator_before_vllm_omni_builds(omni, wan22, monkeypatch):
    """The worker side, in process: an accelerator with 1 KB free (its backend's figure replaced) refuses the load
    in ``load_model`` before vllm-omni builds the pipeline."""
    import torch
    from omni_support import omni_loader

    from vllm_diffusion_plugin.doors.omni import preflight as omni_preflight
    from vllm_diffusion_plugin.engine import platform, preflight

    monkeypatch.setattr(omni_preflight, "_device_type", lambda: "cuda")
    monkeypatch.setattr(platform, "local_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(platform, "free_memory", lambda device: 1000)
    loader = omni_loader(model=str(wan22.root))
    built = []
    monkeypatch.setattr(type(loader), "_load_model_with_hsdp", lambda *a, **k: built.append(1))
    with pytest.raises(preflight.PreflightError, match=r"does not fit rank 0's accelerator: device peak .* > 1KB "
                                                       r"free; fits: none"):
        loader.load_model("cpu")
    assert not built
