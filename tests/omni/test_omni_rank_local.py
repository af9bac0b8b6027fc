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

import sys
import types
from pathlib import Path

import pytest
import torch
from omni_support import (
    FAMILIES,
    OneDitPipeline,
    build_family_dit,
    hsdp_world,
    import_omni,
    load_pipeline,
    tensor_bytes,
)


import_omni()  # skips this module where vllm-omni is not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import run_distributed  # noqa: E402

DITS = ("transformer", "transformer_2")


def load_on_rank(rank: int, world_size: int, root: str, high: str, low: str, strategy: str):
    """One rank of a vllm-omni diffusion worker: its parallel state, then ``load_model`` with our flag."""
    from vllm.config import VllmConfig, set_current_vllm_config

    options = {"lora_path": [f"transformer={high}", f"transformer_2={low}@0.5"], "hsdp_weight_load": strategy}
    config = VllmConfig()
    with set_current_vllm_config(config):
        hsdp_world(world_size, rank)
        model, loader = load_pipeline(root, "WanPipeline", config, options, use_hsdp=True, hsdp_shard_size=world_size)
    return model, {c.name: c for c in loader._diffusion_hsdp_state["report"].components}


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


def test_each_rank_reads_its_own_rows_of_the_stacked_dits(omni, wan22, monkeypatch):
    # vllm-omni picks its platform once, when first imported (here: unpickling the worker's module), so the
    # ranks are spawned fresh with our CPU platform's variable already in their environment
    monkeypatch.setenv("VLLM_DIFFUSION_OMNI_CPU", "1")
    results = run_distributed(rank_worker, 2, args=(str(wan22.root), str(wan22.high), str(wan22.low)),
                              timeout_s=600, start_method="spawn")
    for component in DITS:
        total = tensor_bytes(wan22.root / component)
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


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_families_bind_every_row_once(omni_world, family):
    import diffusers

    from vllm_diffusion_plugin.doors.omni.rank_local import check_coverage, release_to_meta, trace_bindings

    pipeline = OneDitPipeline(build_family_dit(family))
    _, name, config = FAMILIES[family]
    with torch.device("meta"):
        reference = getattr(diffusers, name)(**config)  # diffusers' checkpoint names and shapes
    tensors = {k: types.SimpleNamespace(shape=tuple(v.shape), dtype=torch.bfloat16)
               for k, v in reference.state_dict().items()}
    dit = types.SimpleNamespace(component="transformer", prefix="transformer.", adapter=None,
                                source=types.SimpleNamespace(tensors=tensors, folder=f"/{family}/transformer"))
    release_to_meta(pipeline.transformer)
    bindings, _ = trace_bindings(pipeline, [dit])
    check_coverage(dit, pipeline.transformer, bindings["transformer"])
    per_target: dict[str, int] = {}
    for binding in bindings["transformer"]:
        per_target[binding.target] = per_target.get(binding.target, 0) + 1
    assert max(per_target.values()) >= 2, f"{family}: no stacked parameter found: {per_target}"
