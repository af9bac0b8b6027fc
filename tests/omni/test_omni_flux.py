"""FLUX.1 through vllm-omni's own ``FluxPipeline`` (in-process, real vllm-omni 0.30 classes; the real servers are
tests/serve/test_serve_images.py):

- the runnable tiny folder (``write_tiny_pipeline(DIR, "flux", runnable=True)``) runs in diffusers' pipeline;
- vllm-omni's ``FluxPipeline`` loads its DiT through our path with a ComfyUI-layout LoRA and holds diffusers'
  merged weights, stacked into its ``to_qkv`` / ``add_kv_proj``, single block included.
"""

from __future__ import annotations

import glob
import logging
import sys
import types
from pathlib import Path

import pytest
import torch
from omni_support import captured_logs, hsdp_world, import_omni, load_pipeline, tensor_bytes

from vllm_diffusion_plugin.testing.lora_layouts import write_layout
from vllm_diffusion_plugin.tiny.models import write_tiny_pipeline

import_omni()  # skips this module where vllm-omni is not installed

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """A runnable tiny FLUX.1 folder and a ComfyUI-layout LoRA for its DiT."""
    root = write_tiny_pipeline(tmp_path_factory.mktemp("flux") / "pipe", "flux", runnable=True)
    lora = root.parent / "lora_comfyui.safetensors"
    write_layout("flux", "comfyui", lora)
    return types.SimpleNamespace(root=root, lora=lora)


def test_the_runnable_folder_runs_in_diffusers(flux):
    import json

    from diffusers import FluxPipeline

    index = json.loads((flux.root / "model_index.json").read_text())
    assert {k for k, v in index.items() if isinstance(v, list) and v[0]} == {
        "transformer", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "vae", "scheduler"}
    assert len(glob.glob(str(flux.root / "transformer" / "*.safetensors"))) >= 3
    assert (flux.root / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    pipe = FluxPipeline.from_pretrained(flux.root, torch_dtype=torch.float32)
    assert pipe.text_encoder.config.hidden_size == pipe.transformer.config.pooled_projection_dim
    assert pipe.text_encoder_2.config.d_model == pipe.transformer.config.joint_attention_dim
    ids = pipe.tokenizer("a red cat sits on the beach").input_ids
    assert ids[0] == pipe.tokenizer.bos_token_id and ids[-1] == pipe.tokenizer.eos_token_id and len(ids) == 9
    image = pipe("a red cat sits on the beach", height=32, width=32, num_inference_steps=2,
                 generator=torch.Generator().manual_seed(0), output_type="np", max_sequence_length=16).images
    assert image.shape == (1, 32, 32, 3) and 0.05 < float(image.std()) and float(image.mean()) < 0.9  # not flat grey


# --- vllm-omni's FluxPipeline through our path -----------------------------------------------------------------
def diffusers_merged(flux) -> dict[str, torch.Tensor]:
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(flux.root, torch_dtype=torch.float32)
    pipe.load_lora_weights(str(flux.lora))
    pipe.fuse_lora(components=["transformer"], lora_scale=1.0)
    pipe.unload_lora_weights()
    return {k: v.clone() for k, v in pipe.transformer.state_dict().items()}


STACKED = {"to_q": ("to_qkv", 0), "to_k": ("to_qkv", 1), "to_v": ("to_qkv", 2),
           "add_q_proj": ("add_kv_proj", 0), "add_k_proj": ("add_kv_proj", 1), "add_v_proj": ("add_kv_proj", 2)}


def omni_view(params: dict[str, torch.Tensor], name: str, rows: int) -> torch.Tensor:
    """The rows of vllm-omni's parameter holding the diffusers weight ``name`` (q/k/v stacked)."""
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in STACKED:
        stacked, i = STACKED[last]
        return params[f"{parent}.{stacked}.{leaf}"][i * rows:(i + 1) * rows]
    return params.get(name, params.get(name.replace(".to_out.0.", ".to_out.")))


def test_vllm_omnis_flux_pipeline_loads_the_merged_weights_through_our_path(omni_world, flux):
    with captured_logs("vllm_diffusion_plugin.doors.omni.patch_load_path", logging.INFO) as logs:
        model, _ = load_pipeline(flux.root, "FluxPipeline", omni_world, {"lora_path": [f"transformer={flux.lora}"]})
    assert type(model).__name__ == "FluxPipeline"
    merged = diffusers_merged(flux)
    params = dict(model.transformer.named_parameters())
    base = {}
    from safetensors.torch import load_file

    for file in glob.glob(str(flux.root / "transformer" / "*.safetensors")):
        base.update(load_file(file))
    fused = []
    for name, want in merged.items():
        got = omni_view(params, name, want.shape[0])
        assert got is not None, name
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
        if not torch.equal(want, base[name]):
            fused.append(name)
    assert len(fused) == 16 and {"single_transformer_blocks.0.proj_out.weight",
                                 "single_transformer_blocks.0.norm.linear.weight"} <= set(fused), fused
    reports = [m for m in logs.messages(logging.INFO) if m.startswith("diffusion-hsdp load report: ")]
    assert any(" component=transformer " in m and " lora_targets=16 " in m for m in reports), reports
    assert any(" component=text_encoder_2 " in m for m in reports), reports  # vllm-omni's T5 source, read by us


# --- rank_local at 2 ranks: the DiT's rows rank-locally, vllm-omni's T5 source whole ----------------------------
def flux_rank_worker(rank: int, world_size: int, root: str, lora: str) -> dict:
    """One rank of a vllm-omni diffusion worker loading ``FluxPipeline`` with ``full``, then ``rank_local``."""
    from vllm_diffusion_plugin.doors.omni import apply_patches

    import_omni()
    apply_patches()  # before the names below are imported: they must be the patched ones
    from torch.distributed.tensor import DTensor
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_diffusion_plugin.doors.omni.load_path import component_name

    out = {}
    config = VllmConfig()
    with set_current_vllm_config(config):
        hsdp_world(world_size, rank)
        for strategy in ("full", "rank_local"):
            options = {"lora_path": [f"transformer={lora}"], "hsdp_weight_load": strategy}
            model, loader = load_pipeline(root, "FluxPipeline", config, options, use_hsdp=True,
                                          hsdp_shard_size=world_size)
            reports = {c.name: c.bytes_read for c in loader._diffusion_hsdp_state["report"].components}
            sources = [component_name(s) for s in loader._get_weight_sources(model)]
            params = {}
            for component in sources:
                for n, p in getattr(model, component).named_parameters():
                    params[f"{component}.{n}"] = p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            sharded = all(isinstance(p, DTensor) for p in model.transformer.parameters())
            out[strategy] = {"bytes": reports, "sharded": sharded, "params": params if rank == 0 else {},
                             "sources": sources}
            del model
    return out


def test_rank_local_reads_the_dits_rows_and_the_t5_source_whole_at_two_ranks(omni, flux, monkeypatch):
    """FLUX.1's pipeline reads its T5 encoder through the DiT loader (a second weight source; from vllm-omni 0.32
    on its CLIP encoder too), which vllm-omni does not shard. Before ``rank_local.split_sources``, ``rank_local``
    refused this pipeline ("do not match"). The sources expected are the ones the installed pipeline declares."""
    sys.path.insert(0, str(HERE.parent))
    from dist_utils import run_distributed

    monkeypatch.setenv("VLLM_DIFFUSION_OMNI_CPU", "1")  # vllm-omni picks its platform when first imported
    results = run_distributed(flux_rank_worker, 2, args=(str(flux.root), str(flux.lora)), timeout_s=600,
                              start_method="spawn")
    sources = results[0]["full"]["sources"]
    assert sources[0] == "transformer" and "text_encoder_2" in sources, sources
    whole = {name: tensor_bytes(flux.root / name) for name in sources}
    dit, encoders = whole.pop("transformer"), whole
    local = [r["rank_local"]["bytes"] for r in results]
    print(f"\n[bytes read] rank_local {local}; full {[r['full']['bytes'] for r in results]} (DiT {dit}, {encoders})")
    assert [r["full"]["bytes"] for r in results] == [{"transformer": dit, **encoders}] * 2
    assert sum(b["transformer"] for b in local) == dit and max(b["transformer"] for b in local) <= 0.6 * dit
    for b in local:  # not sharded: every rank reads each encoder whole
        assert {name: b[name] for name in encoders} == encoders, local
    assert all(r["rank_local"]["sharded"] and r["full"]["sharded"] for r in results)
    want, got = results[0]["full"]["params"], results[0]["rank_local"]["params"]
    assert sorted(got) == sorted(want) and any(".to_qkv." in n for n in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage, options, want", [
    ({"enable_multithread_weight_load": False}, {}, 1),
    ({"num_weight_load_threads": 3}, {}, 3),
    ({"num_weight_load_threads": 3}, {"read_threads": 2}, 2),
])
def test_the_door_reads_with_vllm_omnis_threads_unless_ours_are_set(omni_world, flux, stage, options, want):
    """vllm-omni's ``--num-weight-load-threads`` / ``enable_multithread_weight_load`` reach our reader (ours win when
    set), and the weights are the same whatever the thread count."""
    lora = {"lora_path": [f"transformer={flux.lora}"]}
    with captured_logs("vllm_diffusion_plugin.doors.omni.patch_load_path", logging.INFO) as logs:
        model, _ = load_pipeline(flux.root, "FluxPipeline", omni_world, {**lora, **options}, **stage)
    reports = [m for m in logs.messages(logging.INFO) if m.startswith("diffusion-hsdp load report: ")]
    assert reports and all(f" read_threads={want} " in m for m in reports), reports
    reference, _ = load_pipeline(flux.root, "FluxPipeline", omni_world, {**lora, "read_threads": 1})
    want_params = dict(reference.transformer.named_parameters())
    for name, param in model.transformer.named_parameters():
        assert torch.equal(param, want_params[name]), name
