"""Pre-quantized ModelOpt FP8 checkpoints under vllm-omni with ``rank_local`` (issue 37, part 2), at 2 real gloo ranks;
``broadcast`` loads them as ``full``.

vllm-omni's own ``QwenImagePipeline`` (q/k/v stacked into ``to_qkv``: one weight_scale per part), its transformer a
ModelOpt FP8 checkpoint (per tensor, per channel), two LoRA files on FP8 layers (stacked parts among them), loaded
through ``DiffusersPipelineLoader.load_model`` with HSDP on our CPU platform. The FP8 layers are those of the CPU
stand-in for vLLM's ModelOpt method (``testing/cpu_modelopt.py``: vLLM's parameters and post-processing arithmetic in
plain torch -- labelled so; vLLM's own has no CPU kernel), so each load runs to the end, post-processing included.

``rank_local``: every rank's local FP8 rows, scales and other parameters must be bit-identical to ``full``'s on the
same rank (vllm-omni loads the whole checkpoint, our stream fusing the LoRA into each FP8 tensor exactly, its
post-processing requantizes each stacked layer to one scale, then it shards), each rank reading only its rows.
``broadcast``: vllm-omni broadcasts no quantized checkpoint (it falls back to per-rank loads), so our door loads it
with ``full`` and says so once (:func:`test_broadcast_loads_a_modelopt_fp8_checkpoint_as_full`).

Before this, both were refused by name at the worker ("loads under vllm-omni with hsdp_weight_load='full' only").
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from omni_support import hsdp_world, import_omni, load_pipeline, tensor_bytes

import_omni()  # skips this module where vllm-omni is not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_utils import run_distributed  # noqa: E402
from test_omni_prequant_fp8 import FORMATS, _quantize  # noqa: E402

import test_prequant_fp8 as fp8_files  # noqa: E402

STRATEGIES = ("full", "rank_local")


def prequant_rank(rank: int, world_size: int, roots: dict[str, str], loras: list[str]) -> dict:
    from torch.distributed.tensor import DTensor
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_diffusion_plugin.doors.omni import apply_patches
    from vllm_diffusion_plugin.testing.cpu_modelopt import register

    import_omni()
    apply_patches()
    register()
    config = VllmConfig()
    out = {}
    for fmt, root in roots.items():
        loads = {}
        for strategy in STRATEGIES:
            options = {"lora_path": [f"transformer={lora}" for lora in loras], "hsdp_weight_load": strategy}
            with set_current_vllm_config(config):
                hsdp_world(world_size, rank)
                model, loader = load_pipeline(root, "QwenImagePipeline", config, options, use_hsdp=True,
                                              hsdp_shard_size=world_size)
            state = loader._diffusion_hsdp_state
            report = state["report"].components[0]
            loads[strategy] = {
                "strategy": state["strategy"], "bytes": report.bytes_read, "fused": report.lora_keys_fused,
                "methods": sorted({type(m.quant_method).__name__ for m in model.transformer.modules()
                                   if getattr(m, "weight", None) is not None
                                   and m.weight.dtype == torch.float8_e4m3fn}),
                "params": {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                           for n, p in model.transformer.named_parameters()}}
            del model, loader
        full = loads["full"]["params"]
        out[fmt] = {s: {k: v for k, v in load.items() if k != "params"} for s, load in loads.items()}
        mine = loads["rank_local"]["params"]
        out[fmt]["names"] = sorted(full) == sorted(mine)
        out[fmt]["mismatches"] = [
            n for n in full if n in mine and (full[n].dtype != mine[n].dtype or full[n].shape != mine[n].shape
                                              or not torch.equal(fp8_files._bits(full[n]), fp8_files._bits(mine[n])))]
        out[fmt]["fp8"] = sorted(n for n, t in full.items() if t.dtype == torch.float8_e4m3fn)
    return out


@pytest.fixture(scope="module")
def qwen_fp8_roots(tmp_path_factory):
    from vllm_diffusion_plugin.tiny.models import write_tiny_pipeline

    base = tmp_path_factory.mktemp("prequant-ranks")
    roots = {fmt: _quantize(write_tiny_pipeline(base / fmt, "qwen-image", runnable=True), fmt) for fmt in FORMATS}
    loras = [fp8_files.write_lora(base / "lora.safetensors", "qwen-image"),
             fp8_files.write_lora(base / "lora2.safetensors", "qwen-image")]
    return roots, loras


def test_rank_local_fp8_rows_and_scales_equal_fulls_on_every_rank(omni, qwen_fp8_roots, monkeypatch):
    monkeypatch.setenv("VLLM_DIFFUSION_OMNI_CPU", "1")  # our CPU platform, in the spawned ranks too
    roots, loras = qwen_fp8_roots
    results = run_distributed(prequant_rank, 2, args=({f: str(r) for f, r in roots.items()},
                                                      [str(lora) for lora in loras]),
                              timeout_s=600, start_method="spawn")
    for fmt, root in roots.items():
        total = tensor_bytes(root / "transformer")
        for rank, result in enumerate(results):
            r, what = result[fmt], f"{fmt}, rank {rank}"
            assert r["full"]["methods"] == ["CpuModelOptFp8LinearMethod"], (what, r["full"]["methods"])
            assert any(".to_qkv.weight" in n for n in r["fp8"]), (what, r["fp8"][:5])  # stacked parts
            assert r["full"]["strategy"] == "full" and r["rank_local"]["strategy"] == "rank_local", what
            assert r["names"], what
            assert not r["mismatches"], f"{what}: differs from full: {r['mismatches'][:8]}"
            assert r["full"]["fused"] > 0 and r["rank_local"]["fused"] > 0, what  # the LoRA went in
        local = [result[fmt]["rank_local"]["bytes"] for result in results]
        full = [result[fmt]["full"]["bytes"] for result in results]
        print(f"\n[bytes read] {fmt}: full {full}, rank_local {local} of {total}", flush=True)
        assert max(local) <= 0.6 * total and sum(local) <= 1.01 * total, (fmt, local, total)


@pytest.mark.parametrize("algo", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN"])
def test_broadcast_loads_a_modelopt_fp8_checkpoint_as_full(omni, algo):
    """vllm-omni's HSDP load falls back to per-rank loads for a quantized checkpoint (its ``has_online_quant``: no
    ModelOpt config sets ``is_checkpoint_quantized``), and gloo cannot broadcast FP8: ours loads with ``full``, said."""
    from vllm_omni.quantization import build_quant_config

    from vllm_diffusion_plugin.doors.omni.serve_options import checkpoint_strategy
    from vllm_diffusion_plugin.testing.logs import captured_logs

    config = build_quant_config({"quant_method": "modelopt", "quant_algo": algo})
    with captured_logs("vllm_diffusion_plugin.doors.omni.serve_options") as logs:
        assert checkpoint_strategy(config, "broadcast") == "full"
    assert any("vllm-omni broadcasts only unquantized weights, so every rank reads the checkpoint" in line
               for line in logs.messages(logging.INFO)), logs.messages(logging.INFO)
    assert checkpoint_strategy(config, "full") == "full"
