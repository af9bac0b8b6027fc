"""FP8 with LoRA at 2 ranks in real servers (issue 37): ``vllm serve DIR --omni --load-format diffusion-hsdp
--quantization torch_fp8 --use-hsdp --hsdp-shard-size 2`` with both distill LoRAs, ``full`` against ``rank_local``.

``torch_fp8`` is the pure-torch online fp8 of ``testing/online_quant.py`` that our CPU platform registers through
vllm-omni's quantization override hook -- a CPU stand-in for vLLM's ``fp8``, which has no CPU kernel. Each rank of
``rank_local`` reads only its rows, fuses the LoRA into them and quantizes them with the scale the whole tensor gets
(``engine/quant_shards.py``): its shards and scales are bit-identical to ``full``'s, so the two servers must return
the same video, while ``rank_local``'s ranks read the DiT bytes once between them; the same server unquantized
returns another (the fp8 weights are what served). ``torch_fp8_whole``, the same method with its row protocol switched
off, goes layer-whole under ``rank_local`` (issue 50: each layer gathered, post-processed by the method itself): the
same video bytes as ``full``, the same rows read.

Skipped unless ``VLLM_DIFFUSION_SERVE_PROOF=1`` (``.ci/omni-serve.sh``); the CPU platform only.
"""

from __future__ import annotations

import json

import pytest
import serve_proof as sp

pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(not sp.ENABLED, reason="set VLLM_DIFFUSION_SERVE_PROOF=1 to start real vllm-omni servers"),
    pytest.mark.skipif(not sp.CPU, reason="torch_fp8 is the CPU platform's stand-in; a GPU serves vLLM's fp8"),
    pytest.mark.timeout(1200),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> sp.Checkpoints:
    return sp.build_checkpoints(tmp_path_factory.mktemp("serve-fp8"), merged=False)


def _serve(checkpoints: sp.Checkpoints, logs, strategy: str, *, method: str | None = "torch_fp8") -> sp.ServerRun:
    config = {"diffusion_hsdp": {"hsdp_weight_load": strategy, "lora_path": [
        f"transformer={checkpoints.lora_high}", f"transformer_2={checkpoints.lora_low}"]}}
    quantization = ("--quantization", method) if method else ()
    return sp.serve(sp.ServerSpec(f"{method or 'unquantized'}-hsdp2-{strategy}", checkpoints.original,
                                  plugin=True, args=(
        "--load-format", "diffusion-hsdp", *quantization, "--use-hsdp", "--hsdp-shard-size", "2",
        "--additional-config", json.dumps(config))), logs, cpu=True, ready_timeout_s=sp.READY_TIMEOUT_S)


def test_rank_local_fp8_with_lora_serves_what_full_serves(checkpoints, tmp_path):
    full = _serve(checkpoints, tmp_path / "logs", "full")
    local = _serve(checkpoints, tmp_path / "logs", "rank_local")
    plain = _serve(checkpoints, tmp_path / "logs", "rank_local", method=None)
    whole = _serve(checkpoints, tmp_path / "logs", "rank_local", method="torch_fp8_whole")
    reports = sp.load_reports(local.log_text())
    per_rank, total = sp.bytes_per_rank(reports), sp.dit_bytes(checkpoints.original)
    dist, quantized = sp.distance(full.videos[0], local.videos[0]), sp.distance(plain.videos[0], local.videos[0])
    print(f"\n[fp8] ready full {full.ready_s:.1f} s, rank_local {local.ready_s:.1f} s; rank_local bytes per rank "
          f"{per_rank} of {total}; full vs rank_local: {dist}; unquantized vs fp8: {quantized}", flush=True)
    assert "registered through vllm-omni's quantization override hook" in local.log_text(), local.log
    assert {r.get("strategy") for r in reports} == {"rank_local"}, reports
    assert sorted(per_rank) == [0, 1] and sum(per_rank.values()) == total, per_rank  # every row read once
    assert max(per_rank.values()) <= 0.6 * total, per_rank
    assert dist.mean_abs <= 0.5 and dist.max_abs <= 8, dist  # the serving proof's tolerance (8-bit levels)
    assert not quantized.identical_bytes and quantized.max_abs > 0, quantized  # the fp8 weights were served
    # torch_fp8_whole: the same method with its row protocol off, so rank_local gathers each layer whole and runs its
    # post-processing on it (issue 50): full's weights bit for bit, so full's video bytes; the same rows read
    layer_whole = sp.load_reports(whole.log_text())
    whole_dist = sp.distance(full.videos[0], whole.videos[0])
    print(f"\n[fp8 layer-whole] ready {whole.ready_s:.1f} s; bytes per rank {sp.bytes_per_rank(layer_whole)}; "
          f"full vs rank_local layer-whole: {whole_dist}", flush=True)
    assert {r.get("quant_path") for r in layer_whole} == {"layer-whole"}, layer_whole
    assert {r.get("quant_path") for r in reports} == {"rows"}, reports
    assert sp.bytes_per_rank(layer_whole) == per_rank, layer_whole
    assert whole_dist.identical_bytes, whole_dist

