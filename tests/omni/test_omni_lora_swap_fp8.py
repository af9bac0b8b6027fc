"""A LoRA swap into a pre-quantized ModelOpt FP8 checkpoint under vllm-omni with ``rank_local`` (issue 49), at 2 real
gloo ranks: vllm-omni's own ``QwenImagePipeline`` (q/k/v stacked into ``to_qkv``: one scale per part, requantized to
the largest), its transformer a ModelOpt FP8 checkpoint (per tensor, per channel; the CPU stand-in of vLLM's method,
``testing/cpu_modelopt.py``). Loaded with one LoRA file, swapped to two, to none, to two through the session kept on the served
pipeline (what the update endpoint calls): every rank's FP8 rows, scales and other parameters bit for bit those of a
fresh load with the two -- the FP8 rows and scales re-read and re-finished, the stacked parts requantized to their new
largest scale."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from omni_support import hsdp_world, import_omni, load_pipeline

import_omni()  # skips this module where vllm-omni is not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_utils import run_distributed  # noqa: E402
from test_omni_rank_local_prequant import fp8_files, qwen_fp8_roots  # noqa: E402, F401 (a fixture)


def swap_rank(rank: int, world_size: int, roots: dict[str, str], loras: list[str]) -> dict:
    from torch.distributed.tensor import DTensor
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_diffusion_plugin.doors.omni import apply_patches, lora_update
    from vllm_diffusion_plugin.engine.session import LoraSpec
    from vllm_diffusion_plugin.testing.cpu_modelopt import register

    import_omni()
    apply_patches()
    register()
    config = VllmConfig()

    def load(root: str, files: list[str]):
        options = {"lora_path": [f"transformer={p}" for p in files], "hsdp_weight_load": "rank_local"}
        with set_current_vllm_config(config):
            hsdp_world(world_size, rank)
            model, _ = load_pipeline(root, "QwenImagePipeline", config, options, use_hsdp=True,
                                     hsdp_shard_size=world_size)
        return model

    def params(model) -> dict[str, torch.Tensor]:
        return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in model.transformer.named_parameters()}

    out = {}
    for fmt, root in roots.items():
        model = load(root, loras[:1])
        before = params(model)
        state = lora_update.state_of(model)
        for specs in (loras, [], loras):  # one file -> both stacked -> none -> both
            state.session.swap_loras([LoraSpec(Path(p), 1.0, "transformer") for p in specs], dits=state.rows)
        swapped = params(model)
        del model
        fresh = params(load(root, loras))
        out[fmt] = {"mismatches": [n for n in fresh if not torch.equal(fp8_files._bits(fresh[n]),
                                                                        fp8_files._bits(swapped[n]))],
                    "changed": sum(not torch.equal(fp8_files._bits(before[n]), fp8_files._bits(swapped[n]))
                                   for n in fresh),
                    "fp8": sum(t.dtype == torch.float8_e4m3fn for t in fresh.values())}
    return out


def test_a_swap_into_modelopt_fp8_layers_equals_a_fresh_load_on_every_rank(omni, qwen_fp8_roots, monkeypatch):
    monkeypatch.setenv("VLLM_DIFFUSION_OMNI_CPU", "1")  # our CPU platform, in the spawned ranks too
    roots, loras = qwen_fp8_roots
    results = run_distributed(swap_rank, 2, args=({f: str(r) for f, r in roots.items()}, [str(p) for p in loras]),
                              timeout_s=600, start_method="spawn")
    for rank, result in enumerate(results):
        for fmt, r in result.items():
            assert r["fp8"] > 0, (fmt, rank)
            assert r["changed"] > 0, (fmt, rank)  # the swap changed what the first load fused
            assert not r["mismatches"], f"{fmt}, rank {rank}: differs from a fresh load: {r['mismatches'][:8]}"
