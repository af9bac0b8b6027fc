"""``benchmarks/storage.py``: the storage-kind parser, the cgroup cap lines, which cap mechanism a host offers,
the 'could not make it here' path (a missing /dev/fuse), and the warm/cold kinds on real files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from vllm_diffusion_plugin.testing.pagecache import resident_bytes

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_storage", ROOT / "benchmarks" / "storage.py")
storage = sys.modules.setdefault("bench_storage", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(storage)


def test_parse_kinds_lists_all_and_dedupes():
    assert storage.parse_kinds("all") == ("warm", "cold", "throttled", "latency")
    assert storage.parse_kinds("latency, warm,latency") == ("latency", "warm")
    assert storage.parse_kinds("cold,all") == ("cold", "warm", "throttled", "latency")


@pytest.mark.parametrize("text", ["hot", "warm,nvme", ""])
def test_parse_kinds_refuses_unknown_naming_it(text):
    with pytest.raises(ValueError, match="choose from warm, cold, throttled, latency"):
        storage.parse_kinds(text)


def test_cap_lines():
    assert storage.io_max_line("7:3", rbps=200e6) == "7:3 rbps=200000000"
    assert storage.blkio_read_bps_line("259:0", rbps=150_000_000) == "259:0 150000000"
    with pytest.raises(ValueError, match="MAJ:MIN, got '/dev/loop0'"):
        storage.io_max_line("/dev/loop0", rbps=1)


def test_cgroup_mechanism_prefers_v2_io_then_v1_then_says_why(tmp_path):
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir(), v1.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu memory pids\n")
    with pytest.raises(storage.Unavailable, match="no cgroup v2 io controller"):
        storage.cgroup_io_mechanism(v2_root=v2, v1_blkio=v1)
    (v1 / "blkio.throttle.read_bps_device").write_text("")
    assert storage.cgroup_io_mechanism(v2_root=v2, v1_blkio=v1) == ("v1", v1)
    (v2 / "cgroup.controllers").write_text("cpu io memory\n")
    assert storage.cgroup_io_mechanism(v2_root=v2, v1_blkio=v1) == ("v2", v2)


def test_latency_without_fuse_device_is_unavailable_and_leaves_nothing(tmp_path):
    (tmp_path / "ckpt").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(storage.Unavailable, match="does-not-exist does not exist"):
        with storage.latency_mount(tmp_path / "ckpt", workdir=work, latency_ms=1,
                                   fuse_dev=tmp_path / "does-not-exist"):
            pass
    assert list(work.iterdir()) == []


def test_runs_per_kind_reports_unavailable_kinds_and_runs_the_rest(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "w.bin").write_bytes(b"x" * (1 << 20))
    monkeypatch.setattr(storage, "CGROUP_V2", tmp_path / "none-v2")
    monkeypatch.setattr(storage, "CGROUP_V1_BLKIO", tmp_path / "none-v1")
    seen = []
    out = storage.runs_per_kind(("throttled", "cold"), ckpt, run=lambda st, v: seen.append((st.kind, v)) or 1.0,
                                variants=("a", "b"), repeats=2, workdir=tmp_path, log=lambda m: None)
    assert "no cgroup v2 io controller" in out["throttled"]["unavailable"]
    assert out["cold"]["median_s"] == {"a": 1.0, "b": 1.0}
    assert seen == [("cold", "a"), ("cold", "b"), ("cold", "b"), ("cold", "a")]


def test_warm_and_cold_kinds_on_real_files(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "w.bin").write_bytes(b"\1" * (4 << 20))
    with storage.stage("cold", ckpt, workdir=tmp_path) as st:
        st.before_run()
        assert resident_bytes([ckpt])[0] <= 0.05 * (4 << 20)
    with storage.stage("warm", ckpt, workdir=tmp_path) as st:
        st.before_run()
        assert resident_bytes([ckpt])[0] == 4 << 20
