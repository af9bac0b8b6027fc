"""``benchmarks/bench_serve_startup.py`` without servers: the command line each setting starts (vllm-omni 0.30's
own flags), the rank read from a worker's title, the medians and goal ratios from recorded runs, and a failed
server kept as failed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serve_startup", ROOT / "benchmarks" / "bench_serve_startup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_setting_starts_the_documented_command(bench, tmp_path):
    loras = [tmp_path / "h.safetensors", tmp_path / "l.safetensors"]
    lora = ["--lora-path", str(loras[0]), str(loras[1]), "--lora-backend", "distill"]
    bounds = ["--init-timeout", "1800", "--stage-init-timeout", "1800"]
    args = {}
    for s in bench.SETTINGS:
        got = list(bench.spec_for(s, "cold", 2, tmp_path, loras).args)
        assert got[:4] == bounds, got
        args[s] = got[4:]
    assert args["omni-nolora-1"] == []
    assert args["omni-1"] == lora
    assert args["ours-1"] == lora + ["--load-format", "diffusion-hsdp"]
    assert args["omni-hsdp2"] == lora + ["--use-hsdp", "--hsdp-shard-size", "2"]
    for strategy in bench.STRATEGIES:
        got = args[f"ours-hsdp2-{strategy}"]
        assert got[:-1] == lora + ["--use-hsdp", "--hsdp-shard-size", "2", "--load-format", "diffusion-hsdp",
                                   "--additional-config"]
        assert json.loads(got[-1]) == {"diffusion_hsdp": {"hsdp_weight_load": strategy}}
    spec = bench.spec_for("ours-1", "cold", 2, tmp_path, loras, env={"X": "1"})
    assert (spec.name, spec.plugin, spec.dtype, dict(spec.env)) == ("ours-1-cold-r2", True, "bfloat16", {"X": "1"})
    assert not bench.spec_for("omni-1", "warm", 0, tmp_path, loras).plugin
    with pytest.raises(ValueError, match="unknown setting 'ours-3'"):
        bench.spec_for("ours-3", "warm", 0, tmp_path, loras)


def test_worker_rank_from_title(bench):
    assert bench.worker_rank("vLLM-Omni::DiffusionWorker_FS1") == 1
    assert bench.worker_rank("vLLM-Omni::DiffusionWorker") == 0


def _row(name, ok=True, ready=10.0, first=12.0, peak=4 << 30, loaded=3 << 30, ours=None):
    if not ok:
        return {"name": name, "ok": False, "error": "boom", "log": "x.log"}
    workers = {r: {"peak_rss": peak, "read_bytes": 5, "at_marks": {"loaded": {"peak_rss": loaded}}} for r in (0, 1)}
    return {"name": name, "ok": True, "ready_s": ready, "first_s": first, "workers": workers,
            "omni_load": {"DiffusionWorker_FS0": {"model_s": 3.0}, "DiffusionWorker_FS1": {"model_s": 4.0}},
            "ours_bytes_per_rank": ours or {}}


def test_medians_goals_and_failures(bench):
    rows = [_row("omni-hsdp2-cold-r0", ready=100, first=120, peak=8 << 30, loaded=6 << 30),
            _row("omni-hsdp2-cold-r1", ready=110, first=130, peak=8 << 30, loaded=6 << 30),
            _row("ours-hsdp2-rank_local-cold-r0", ready=50, first=60, peak=7 << 30, loaded=3 << 30,
                 ours={0: 100, 1: 100}),
            _row("ours-hsdp2-rank_local-cold-r1", ok=False)]
    summary = bench.summarize(rows)
    omni, ours = summary["omni-hsdp2-cold"], summary["ours-hsdp2-rank_local-cold"]
    assert (omni["ready_s"], omni["first_s"], omni["load_s"], omni["failed"]) == (105, 125, 4.0, 0)
    assert (ours["runs"], ours["failed"], ours["ours_bytes_rank0"]) == (2, 1, 100)
    goals = {g["goal"]: g for g in bench.goals(summary, ["cold"])}
    fast = goals["cold: rank_local ready + first request >= 1.5x faster than omni-hsdp2"]
    assert fast["ratio"] == pytest.approx(125 / 60) and fast["pass"]
    rss = goals["peak RSS per rank rank_local <= 0.6x omni-hsdp2 (cold)"]
    assert rss["ratio"] == pytest.approx(7 / 8) and not rss["pass"]
    assert goals["load-phase peak RSS per rank rank_local <= 0.6x omni-hsdp2 (cold)"]["ratio"] == pytest.approx(0.5)
    text = bench.table(summary, list(goals.values()))
    assert "ours-hsdp2-rank_local-cold" in text and "1/2" in text and "FAIL" in text
