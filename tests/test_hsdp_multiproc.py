"""HSDP numerics on real gloo ranks (spawned CPU processes): world 2 as (1, 2) and world 4 as (2, 2).

For tiny diffusers DiTs written by diffusers' ``save_pretrained`` (Wan and Flux with built-in block rules;
CogVideoX through the generic rule) every rank loads the checkpoint, runs the unsharded forward, shards with
``apply_hsdp``, runs the sharded forward (FSDP2 all-gathers over gloo) and gathers the full state dict.
Checked: sharded output == unsharded output; gathered state == the checkpoint; each rank holds ~1/S of the
block parameters, shard-group peers hold different shards, replicate-group peers identical ones.

Ranks start from dist_utils' fork server (torch/diffusers imported once, not once per rank), and each world
size is one run doing all models. This module's top level stays light: ranks import it to find the worker.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

pytestmark = pytest.mark.multiproc

COGVIDEOX_CONFIG = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                        time_embed_dim=8, text_embed_dim=16, num_layers=3, sample_width=8, sample_height=8,
                        sample_frames=9, patch_size=2, max_text_seq_length=8)
CLASSES = {"wan": "WanTransformer3DModel", "flux": "FluxTransformer2DModel",
           "cogvideox": "CogVideoXTransformer3DModel"}


def inputs_for(kind: str) -> dict:
    from vllm_diffusion_plugin.tiny.models import TINY_CONFIGS

    gen = torch.Generator().manual_seed(7)
    if kind == "wan":
        cfg = TINY_CONFIGS["wan"]
        return dict(hidden_states=torch.randn(1, cfg["in_channels"], 2, 4, 4, generator=gen),
                    timestep=torch.tensor([500]),
                    encoder_hidden_states=torch.randn(1, 8, cfg["text_dim"], generator=gen), return_dict=False)
    if kind == "flux":
        cfg = TINY_CONFIGS["flux"]
        grid = torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij")
        return dict(hidden_states=torch.randn(1, 16, cfg["in_channels"], generator=gen),
                    encoder_hidden_states=torch.randn(1, 8, cfg["joint_attention_dim"], generator=gen),
                    pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=gen),
                    timestep=torch.tensor([0.5]), img_ids=torch.stack(grid, -1).reshape(16, 3),
                    txt_ids=torch.zeros(8, 3), return_dict=False)
    return dict(hidden_states=torch.randn(1, 3, 4, 8, 8, generator=gen),
                encoder_hidden_states=torch.randn(1, 8, 16, generator=gen), timestep=torch.tensor([10]),
                return_dict=False)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha1(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def hsdp_worker(rank: int, world_size: int, shape: tuple[int, int], checkpoints: dict[str, str]) -> dict:
    """One rank: for each model, unsharded forward, apply_hsdp, sharded forward, gather."""
    import diffusers
    from torch.distributed.tensor import DTensor

    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig, apply_hsdp, build_mesh
    from vllm_diffusion_plugin.engine.save import gather_full_state_dict

    config = HSDPConfig(replicate_size=shape[0])
    mesh = build_mesh(config, device_type="cpu")
    results = {}
    for kind, path in checkpoints.items():
        model = getattr(diffusers, CLASSES[kind]).from_pretrained(path).eval()
        inputs = inputs_for(kind)
        with torch.no_grad():
            reference = model(**inputs)[0]
        report = apply_hsdp(model, mesh=mesh, config=config)
        with torch.no_grad():
            sharded = model(**inputs)[0]
            sharded_again = model(**inputs)[0]  # a second forward after reshard_after_forward
        state = gather_full_state_dict(model)
        results[kind] = {
            "max_abs_diff": (sharded - reference).abs().max().item(),
            "max_abs_ref": reference.abs().max().item(),
            # not bit-exact: the all-gathered parameters live in a different buffer (alignment changes the
            # CPU GEMM's blocking); a wrong or missing shard would be off by ~0.1, not 1e-6
            "close": all(torch.allclose(out, reference, rtol=1e-5, atol=1e-5) for out in (sharded, sharded_again)),
            "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
            "report": report.as_dict(),
            "local_digests": {n: digest(p.to_local()) for n, p in model.named_parameters()
                              if n.split(".")[0] in {b.split(".")[0] for b in report.blocks}},
            "state": state,
        }
    return results


def checkpoint_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    return state


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint_factory, tmp_path_factory) -> dict[str, Path]:
    import diffusers

    cog_dir = tmp_path_factory.mktemp("cogvideox")
    torch.manual_seed(0)
    cog = diffusers.CogVideoXTransformer3DModel(**COGVIDEOX_CONFIG)
    with torch.no_grad():
        for param in cog.parameters():
            param.normal_(0.0, 0.2)
    cog.save_pretrained(cog_dir, max_shard_size="20KB")
    return {"wan": tiny_checkpoint_factory("wan") / "transformer",
            "flux": tiny_checkpoint_factory("flux") / "transformer", "cogvideox": cog_dir}


def check_world(results: list[dict], shape: tuple[int, int], checkpoints: dict[str, Path]) -> None:
    replicas, shards = shape
    for kind in results[0]:
        per_rank = [r[kind] for r in results]
        for rank, res in enumerate(per_rank):
            assert res["close"], f"{kind} rank {rank}: sharded forward differs by {res['max_abs_diff']:.3g}"
            assert res["all_dtensor"], f"{kind} rank {rank}: a parameter is not a DTensor"
            report = res["report"]
            assert report["mesh_shape"] == [replicas, shards] and report["rank"] == rank
            assert report["source"] == ("generic" if kind == "cogvideox" else "builtin")
            assert abs(report["block_fraction"] - 1 / shards) < 0.05, (kind, rank, report)
            assert res["state"] is None or rank == 0  # rank0_only
        # each shard group's ranks together hold exactly the blocks, once; peers hold different shards
        for group in range(replicas):
            ranks = range(group * shards, (group + 1) * shards)
            assert sum(per_rank[r]["report"]["block_local_bytes"] for r in ranks) == \
                per_rank[0]["report"]["block_total_bytes"]
            assert per_rank[ranks[0]]["local_digests"] != per_rank[ranks[1]]["local_digests"]
        # the same shard index in each replicate group holds identical data
        for rank in range(shards, replicas * shards):
            assert per_rank[rank]["local_digests"] == per_rank[rank % shards]["local_digests"], (kind, rank)
        expected = checkpoint_state(checkpoints[kind])
        gathered = per_rank[0]["state"]
        assert gathered.keys() == expected.keys(), kind
        for name, tensor in expected.items():
            assert torch.equal(gathered[name], tensor), f"{kind}: gathered {name} differs from the checkpoint"


def test_world2_shard2_numerics(checkpoints):
    shape = (1, 2)
    paths = {k: str(v) for k, v in checkpoints.items()}
    results = run_distributed(hsdp_worker, 2, args=(shape, paths), timeout_s=240)
    check_world(results, shape, checkpoints)
    assert results[0]["cogvideox"]["report"]["blocks"] == 3  # the generic rule found transformer_blocks.0-2


def test_world4_replicate2_shard2_numerics(checkpoints):
    shape = (2, 2)
    paths = {k: str(checkpoints[k]) for k in ("wan", "flux")}
    results = run_distributed(hsdp_worker, 4, args=(shape, paths), timeout_s=300)
    check_world(results, shape, checkpoints)


# --- the harness itself ------------------------------------------------------------------------------------

def rank_fails(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        raise KeyError(f"boom on rank {rank}")
    dist.barrier()  # rank 0 would wait here forever: the harness must kill it
    return rank


def rank_hangs(rank: int, world_size: int) -> None:
    import time

    time.sleep(600)


def rank_sum(rank: int, world_size: int) -> tuple[int, float]:
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return rank, value.item()


def test_harness_returns_per_rank_results_in_order():
    assert run_distributed(rank_sum, 2, timeout_s=120) == [(0, 3.0), (1, 3.0)]


def test_harness_reraises_first_failure_with_child_traceback():
    with pytest.raises(KeyError, match="boom on rank 1") as err:
        run_distributed(rank_fails, 2, timeout_s=120)
    cause = err.value.__cause__
    assert "rank 1 of 2" in str(cause) and "in rank_fails" in str(cause)


def test_harness_times_out_naming_pending_ranks():
    with pytest.raises(TimeoutError,
                       match=r"rank_hangs, world_size=2\) timed out after 5 s; ranks not finished: \[0, 1\]"):
        run_distributed(rank_hangs, 2, timeout_s=5)
