"""``hsdp_weight_load=rank_local`` under vllm-omni.

- At 2 real gloo ranks: vllm-omni's own ``Wan22Pipeline`` (q/k/v stacked into ``to_qkv``) loaded through
  ``DiffusersPipelineLoader.load_model`` as its diffusion worker does, with one LoRA per DiT, on our CPU platform.
  Each rank must read only its own rows (the two ranks' bytes add up to the DiT tensors' bytes once, neither reads
  more than ~half), and the gathered DiT parameters must equal the ``full`` load of the same pipeline (which
  ``test_omni_serve_door`` holds to the float64 ``W + s B A`` reference).
- Other families, traced in-process: vllm-omni's FLUX, Qwen-Image and Z-Image transformers, fed the checkpoint
  names and shapes of diffusers' own class for the same config: every parameter row must be bound exactly once.

Before the row bindings existed, this load was refused at startup (``rank_local`` "not available under
vllm-omni"): vllm-omni's ``to_qkv`` rows come from three checkpoint tensors, which a key-by-key read cannot place.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from pathlib import Path

import pytest
import torch
from omni_support import import_omni
from torch import nn


import_omni()  # skips this module where vllm-omni is not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import run_distributed  # noqa: E402

FLAG = "diffusion-hsdp"
DITS = ("transformer", "transformer_2")


def load_on_rank(rank: int, world_size: int, root: str, high: str, low: str, strategy: str):
    """One rank of a vllm-omni diffusion worker: its parallel state, then ``load_model`` with our flag."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.load import LoadConfig
    from vllm_omni.config.omni_config import extract_diffusion_stage_config_kwargs
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.distributed import parallel_state
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    options = {"lora_path": [f"transformer={high}", f"transformer_2={low}@0.5"], "hsdp_weight_load": strategy}
    fields = extract_diffusion_stage_config_kwargs(dict(
        model=root, model_class_name="WanPipeline", dtype="float32", load_format=FLAG, use_hsdp=True,
        hsdp_shard_size=world_size, additional_config={"diffusion_hsdp": options}), stage_id=0)
    od_config = OmniDiffusionConfig(**fields)
    config = VllmConfig()
    with set_current_vllm_config(config):
        if parallel_state._WORLD is None:
            parallel_state.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank,
                                                        distributed_init_method="env://", backend="gloo")
            parallel_state.initialize_model_parallel(fully_shard_degree=world_size, use_hsdp=True,
                                                     backend="gloo")
        loader = DiffusersPipelineLoader(LoadConfig(), od_config=od_config)
        with set_forward_context(vllm_config=config, omni_diffusion_config=od_config):
            model = loader.load_model(load_device="cpu", load_format="default", device=torch.device("cpu"))
    return model, loader._diffusion_hsdp_state["reports"]


def rank_worker(rank: int, world_size: int, root: str, high: str, low: str) -> dict:
    from torch.distributed.tensor import DTensor

    from vllm_diffusion_plugin.doors.omni import apply_patches

    import_omni()
    apply_patches()
    out = {}
    for strategy in ("full", "rank_local"):
        model, reports = load_on_rank(rank, world_size, root, high, low, strategy)
        out[strategy] = {"bytes": {c: reports[c].bytes_read for c in DITS}, "params": {}, "sharded": {}}
        for component in DITS:
            dit = getattr(model, component)
            params = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in dit.named_parameters()}
            out[strategy]["sharded"][component] = all(isinstance(p, DTensor) for p in dit.parameters())
            if rank == 0:
                out[strategy]["params"][component] = params
        del model
    return out


def dit_tensor_bytes(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())
    return total


def test_each_rank_reads_its_own_rows_of_the_stacked_dits(omni, wan22, monkeypatch):
    # vllm-omni picks its platform once, when first imported (here: unpickling the worker's module), so the
    # ranks are spawned fresh with our CPU platform's variable already in their environment
    monkeypatch.setenv("VLLM_DIFFUSION_OMNI_CPU", "1")
    results = run_distributed(rank_worker, 2, args=(str(wan22.root), str(wan22.high), str(wan22.low)),
                              timeout_s=600, start_method="spawn")
    for component in DITS:
        total = dit_tensor_bytes(wan22.root / component)
        full = [r["full"]["bytes"][component] for r in results]
        local = [r["rank_local"]["bytes"][component] for r in results]
        print(f"\n[bytes read] {component}: full {full}, rank_local {local} of {total}", flush=True)
        assert full == [total, total], (component, full, total)
        assert sum(local) == total and max(local) <= 0.6 * total, (component, local, total)
        assert all(r["rank_local"]["sharded"][component] for r in results), component
        want, got = results[0]["full"]["params"][component], results[0]["rank_local"]["params"][component]
        assert sorted(got) == sorted(want)
        assert any(".to_qkv." in name for name in got)  # vllm-omni's stacked parameters are among them
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=f"{component}.{name}")


FAMILIES = {  # vllm-omni module, class (diffusers has the same name), a tiny config both accept
    "flux": ("vllm_omni.diffusion.models.flux.flux_transformer", "FluxTransformer2DModel", dict(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6))),
    "qwen_image": ("vllm_omni.diffusion.models.qwen_image.qwen_image_transformer", "QwenImageTransformer2DModel",
                   dict(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
                        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))),
    "z_image": ("vllm_omni.diffusion.models.z_image.z_image_transformer", "ZImageTransformer2DModel", dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=64, n_layers=1, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 12, 12], axes_lens=[64, 32, 32])),
}


class OneDitPipeline(nn.Module):
    """A pipeline holding one vllm-omni DiT under ``transformer.`` (what its pipelines' ``load_weights`` route)."""

    def __init__(self, dit: nn.Module) -> None:
        super().__init__()
        self.transformer = dit

    def load_weights(self, weights):
        loaded = self.transformer.load_weights((n.removeprefix("transformer."), t) for n, t in weights)
        return {f"transformer.{n}" for n in loaded}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_families_bind_every_row_once(omni_world, family):
    import diffusers
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    from vllm_diffusion_plugin.doors.omni.rank_local import check_coverage, release_to_meta, trace_bindings

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_scenarios"))
    from cpu_ops import ensure_cpu_ops  # vLLM 0.30's CPU SiluAndMul looks up an op the PyPI wheel lacks

    ensure_cpu_ops()
    module, name, config = FAMILIES[family]
    cls = getattr(importlib.import_module(module), name)
    kwargs = dict(config)
    od_config = inspect.signature(cls).parameters.get("od_config")
    if od_config is not None and od_config.default is inspect.Parameter.empty:
        kwargs["od_config"] = OmniDiffusionConfig(model="/unused")  # required (Qwen-Image reads its parallel config)
    with set_default_torch_dtype(torch.float32):
        pipeline = OneDitPipeline(cls(**kwargs))
    with torch.device("meta"):
        reference = getattr(diffusers, name)(**config)  # diffusers' checkpoint names and shapes
    tensors = {k: types.SimpleNamespace(shape=tuple(v.shape), dtype=torch.bfloat16)
               for k, v in reference.state_dict().items()}
    dit = types.SimpleNamespace(component="transformer", prefix="transformer.",
                                source=types.SimpleNamespace(tensors=tensors, folder=f"/{family}/transformer"))
    release_to_meta(pipeline.transformer)
    bindings, _ = trace_bindings(pipeline, [dit])
    check_coverage(dit, pipeline.transformer, bindings["transformer"])
    per_target: dict[str, int] = {}
    for binding in bindings["transformer"]:
        per_target[binding.target] = per_target.get(binding.target, 0) + 1
    assert max(per_target.values()) >= 2, f"{family}: no stacked parameter found: {per_target}"
