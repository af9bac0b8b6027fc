"""``benchmarks/charts.py``: every benchmark's chart is drawn from a small report of the shape that benchmark writes,
as a PNG of the one size every chart has (read from the PNG header), and every chart of ``docs/`` is drawn from the
JSON committed beside it."""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="charts need matplotlib: pip install -e '.[bench]'")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import charts  # noqa: E402

GiB = 2**30


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG signature and IHDR chunk; AssertionError when ``path`` is no PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG: {head[:16]!r}"
    return struct.unpack(">II", head[16:24])


def _worker(baseline: float, load: float | None, life: float) -> dict:
    return {"baseline": int(baseline * GiB), "load_start": int(baseline * GiB),
            "load_peak": None if load is None else int(load * GiB), "life_peak": int(life * GiB)}


def _ranks(*loads: float) -> list[dict]:
    return [{"rank": r, "load_s": s, "phases_s": {"read": s / 2, "shard": s / 2, "total": s}, "bytes_read": 6e8,
             "peak_rss_bytes": 2e9 + r, "param_bytes_local": 6e8} for r, s in enumerate(loads)]


REPORTS = {  # what each benchmark's --json writes, small
    "capacity": {"host_bytes": 24 * GiB, "dit_bytes": {1: 2_336_463_744, 6: 9_360_000_000}, "goals": [], "rows": [
        {"run": "limit", "setting": "omni", "S": 2, "blocks": 6, "limit": int(19.5 * GiB), "status": "oom",
         "oom_kills": 1, "cgroup_peak": int(19.4 * GiB), "workers": {0: _worker(1.2, None, 9.0)},
         "planned_host_peak": None},
        {"run": "limit", "setting": "ours", "S": 2, "blocks": 6, "limit": int(19.5 * GiB), "status": "served",
         "ready_s": 130.0, "oom_kills": 0, "cgroup_peak": int(17.9 * GiB),
         "workers": {0: _worker(1.24, 5.8, 8.3), 1: _worker(1.24, 5.79, 8.4)}, "planned_host_peak": {0: 4.6 * GiB}},
        *({"run": "scaling", "setting": setting, "S": s, "blocks": 1, "limit": 22 * GiB, "status": "served",
           "oom_kills": 0, "cgroup_peak": 9 * GiB, "workers": {r: _worker(1.2, peak / s ** 0.5, 4.5) for r in range(s)},
           "planned_host_peak": {r: 2.4 * GiB / s for r in range(s)} if setting == "ours" else None}
          for s in (1, 2, 4) for setting, peak in (("omni", 3.7), ("ours", 3.6)))]},
    "serve_startup": {"blocks": 1, "repeats": 3, "storage": {"warm": "", "cold": ""}, "unavailable": {"latency": "x"},
                      "summary": {f"{setting}-{kind}": {"runs": 3, "failed": 0, "ready_s": 22.0 + i, "first_s": 25.0,
                                                        "load_s": 5.0 + i, "peak_rss_worker": 4e9}
                                  for kind in ("warm", "cold") for i, setting in enumerate(("omni-1", "ours-1"))}},
    "distributed_load": {"checkpoint": "/x", "bytes": 1.22e9, "nproc": 2, "repeats": 1, "storage": {
        "warm": {"note": "", "strategies": {s: {"strategy": s, "wall_s": 9.0, "ranks": _ranks(t, t + 0.1)}
                                            for s, t in (("full", 2.1), ("broadcast", 8.0), ("rank_local", 1.1))}},
        "latency": {"unavailable": "no /dev/fuse here"}}},
    "nodes": {"checkpoint": "/x", "bytes": 1.22e9, "cap_mbps_per_node": 200.0, "layouts": {
        layout: {"runs": {s: {"strategy": s, "layout": layout, "load_s_max_rank": t,
                              "phases_s_max_rank": {"read": t, "total": t}, "bytes_read_per_node": [b, b / 2],
                              "load_s_runs": [t - 0.2, t, t + 0.3]}
                          for s, t, b in (("full", 8.2, 1.22e9), ("broadcast", 11.6, 1.22e9),
                                          ("rank_local", 3.9, 0.61e9))}}
        for layout in ("2x1", "2x2-S4")}},
    "plan_real_size": {"manifest": {"components": {"transformer": 28e9}}, "pipeline_disk_bytes": 495616, "plans": [
        {"S": s, "plan_s": 1.4, "strategies": {
            strategy: {"runs": "full" if s == 1 else strategy, "bytes_read_max": 57.5e9 / (s if local else 1),
                       "bytes_read_min": 0, "bytes_read_total": 57.5e9, "held_max": 57.5e9 / s,
                       "host_peak_max": 58.5e9 / (s if local else 2), "first_run_peak_max": 1e9}
            for strategy, local in (("rank_local", True), ("full", False), ("broadcast", False))}}
        for s in (1, 4, 8)]},
    "gpu_proof": {"mode": "gpu", "environment": {"gpu": "NVIDIA H200", "gpu_memory_gb": 140.4, "cpu_count": 16,
                                                 "torch": "2.11.0+cu130"}, "steps": {
        "bench_load": {"status": "ran", "result": {"bytes": 3.33e9, "repeats": 3, "timings": {
            name: {"median_s": t, "best_s": t} for name, t in (("floor", 0.519), ("ours_preallocated", 0.512),
                                                               ("ours_build_and_load", 0.546),
                                                               ("diffusers_from_pretrained", 0.622))}}},
        "lora_device": {"status": "ran", "result": {"layers": 400, "weight_bytes": 28.1e9, "hbm_floor_s": 0.0132,
                                                    "device_s": 0.0469, "host_through_device_s": 6.2,
                                                    "host_on_cpu_s": 1.3}},
        "omni_serve": {"status": "skipped", "reason": "no vllm_omni"}}},
}


def test_every_chart_kind_has_a_report_here():
    assert set(REPORTS) == set(charts.KINDS)


@pytest.mark.parametrize("kind", sorted(REPORTS))
def test_each_chart_is_a_png_of_the_chart_size(kind, tmp_path):
    path = tmp_path / "sub" / f"{kind}.png"
    assert charts.plot(kind, REPORTS[kind], path)
    assert png_size(path) == charts.SIZE_PX


def test_the_size_check_sees_another_size_and_another_format(tmp_path):
    plt = charts._pyplot()
    fig = plt.figure(figsize=(4, 3), dpi=charts.DPI)
    fig.savefig(tmp_path / "small.png")
    fig.savefig(tmp_path / "small.svg")
    plt.close(fig)
    assert png_size(tmp_path / "small.png") == (400, 300) != charts.SIZE_PX
    with pytest.raises(AssertionError, match="is not a PNG"):
        png_size(tmp_path / "small.svg")


def test_the_figures_drawn_are_the_reports():
    _, (per_s, limit) = charts.capacity(REPORTS["capacity"])
    assert per_s.groups == ["S = 1", "S = 2", "S = 4"]
    omni, ours, plan = per_s.series.values()
    assert omni[1] == pytest.approx(3.7 / 2 ** 0.5, abs=1e-6) and ours[2] == pytest.approx(1.8, abs=1e-6)
    assert plan[1] == pytest.approx(1.2 + 1.2, abs=1e-6)  # baseline + the largest rank's planned peak
    assert limit.lines == [("memory limit (19.5 GiB)", 19.5)] and limit.notes == {
        (0, "the server (cgroup peak)"): "OOM-killed (1 kill)"}
    _, (load, _) = charts.nodes(REPORTS["nodes"])
    assert load.spans["rank_local"] == [pytest.approx((3.7, 4.2))] * 2


def test_a_cpu_check_proof_draws_nothing(tmp_path, capsys):
    report = {**REPORTS["gpu_proof"], "mode": "cpu-check"}
    assert not charts.plot("gpu_proof", report, tmp_path / "proof.png")
    assert not (tmp_path / "proof.png").exists() and "no chart" in capsys.readouterr().err


def test_without_matplotlib_plot_is_refused_while_parsing(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    parser = argparse.ArgumentParser()
    charts.add_plot_option(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--plot", "x.png"])
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[bench\]'"):
        charts.plot("nodes", REPORTS["nodes"], "x.png")
    assert parser.parse_args([]).plot is None  # no --plot: no matplotlib needed


DOCS_JSON = sorted(charts.DOCS_CHARTS.glob("*.json"))


def test_every_docs_chart_has_its_json_and_every_json_its_chart():
    pngs = sorted(charts.DOCS_CHARTS.glob("*.png"))
    assert DOCS_JSON and [p.stem for p in pngs] == [p.stem for p in DOCS_JSON]
    for path in DOCS_JSON:
        report = json.loads(path.read_text())
        assert report["chart"] in charts.KINDS and report["source"] and report["date"] and report["host"], path


@pytest.mark.parametrize("path", DOCS_JSON, ids=[p.stem for p in DOCS_JSON])
def test_the_regenerate_command_draws_each_docs_chart(path, tmp_path):
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    assert charts.main([str(copy)]) == 0
    assert png_size(copy.with_suffix(".png")) == png_size(path.with_suffix(".png")) == charts.SIZE_PX
