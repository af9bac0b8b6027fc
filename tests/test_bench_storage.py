"""The read benchmarks' storage kinds (``benchmarks/storage.py``): names parsed strictly, a kind the host cannot
make reported as unavailable (never a crash), and warm / cold really differ in what the page cache holds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import storage  # noqa: E402

from vllm_diffusion_plugin.tools import pagecache  # noqa: E402


def test_kinds_parse_strictly():
    assert storage.parse_kinds("all") == list(storage.KINDS)
    assert storage.parse_kinds("cold, latency") == ["cold", "latency"]
    for bad in ("", "fast", "cold,nvme"):
        with pytest.raises(ValueError, match="storage kind"):
            storage.parse_kinds(bad)


@pytest.mark.parametrize("kind", ["warm", "cold"])
def test_warm_and_cold_prepare_the_page_cache(tmp_path, kind):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "a.safetensors").write_bytes(b"\1" * (4 << 20))
    with storage.open_storage(kind, folder, workdir=tmp_path) as st:
        assert st.path == folder and st.files == [folder / "a.safetensors"]
        st.prepare()
        resident, total = pagecache.resident_bytes(st.files)
    assert total == 4 << 20
    assert (resident == total) if kind == "warm" else (resident < total // 2), (kind, resident, total)


def test_a_latency_store_without_fuse_is_reported_unavailable(tmp_path, monkeypatch):
    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda self: False if str(self) == "/dev/fuse" else real_exists(self))
    with pytest.raises(storage.Unavailable, match="/dev/fuse"):
        with storage.open_storage("latency", tmp_path, workdir=tmp_path):
            pass
