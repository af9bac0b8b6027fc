"""``benchmarks/plan_real_size.py``'s sparse writer, at a small size: the folder it writes is a checkpoint the
project resolves (headers only, data regions holes), and ``plan`` over it reads what the headers say -- the whole
of every DiT under ``full``, each row once over the ranks under ``rank_local`` (``shard_rows``' split)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import plan_real_size as real  # noqa: E402

SMALL = dict(real.WAN_A14B, num_layers=2, num_attention_heads=2, attention_head_dim=64, text_dim=128, ffn_dim=256,
             freq_dim=32, rope_max_seq_len=32)
SMALL_UMT5 = dict(real.UMT5_XXL, vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)


@pytest.fixture(autouse=True)
def keep_vllm_logging(monkeypatch):
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict:
    return real.write_pipeline(tmp_path_factory.mktemp("real-size") / "out", transformer=SMALL, vae=None,
                               text_encoder=SMALL_UMT5, lora_rank=4, shard_bytes=400_000)


def test_the_sparse_folder_resolves_with_every_tensor_of_the_skeleton(small):
    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint

    sources = resolve_checkpoint(small["pipeline"])
    assert [s.name for s in sources] == ["transformer", "transformer_2"]
    expected = real.state_tensors(real.meta_module("probe", real.component_config("WanTransformer3DModel", SMALL)))
    for source in sources:
        assert len(source.files) > 2 and source.index is not None
        assert [(k, i.shape, i.dtype) for k, i in source.tensors.items()] == expected
        assert {i.dtype for i in source.tensors.values()} == {torch.bfloat16, torch.float32}  # fp32 modules kept
        assert source.total_bytes == small["components"][source.name]
        for file in source.files:  # header then a data region of exactly the bytes the header lists
            data = sum(i.nbytes for k, i in source.tensors.items() if i.file == file)
            assert file.stat().st_size - data == 8 + int.from_bytes(file.read_bytes()[:8], "little")
    assert "text_encoder" in small["skipped"] and "build_component" in small["skipped"]["text_encoder"]
    assert "text_encoder" not in small["components"]


def test_plan_over_the_sparse_folder_reads_what_the_headers_say(small):
    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint

    whole = sum(s.total_bytes for s in resolve_checkpoint(small["pipeline"]))
    (one, two) = real.run_plans(small, [1, 2])
    assert {s["runs"] for s in one["strategies"].values()} == {"full"}
    assert one["strategies"]["full"]["bytes_read_max"] == whole
    full, broadcast, local = (two["strategies"][s] for s in ("full", "broadcast", "rank_local"))
    assert full["bytes_read_min"] == full["bytes_read_max"] == whole
    assert (broadcast["bytes_read_max"], broadcast["bytes_read_min"]) == (whole, 0)
    assert local["bytes_read_total"] == whole  # every row once over the two ranks
    assert 0.4 * whole < local["bytes_read_min"] <= local["bytes_read_max"] < 0.6 * whole
    assert local["host_peak_max"] < full["host_peak_max"]
    table = real.format_table([one, two], small)
    assert "ours: rank_local" in table and "(runs full)" in table and "Left out: text_encoder" in table
