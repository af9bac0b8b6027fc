"""HSDP in one process: config validation, block selection, and the structure ``apply_hsdp`` produces.

Sharding structure runs on torch's fake process group (one process pretending to be rank 0 of a larger
world; collectives return garbage, so values are checked on each rank's own local shard only). Numerics
across real ranks are in test_hsdp_multiproc.py.
"""

from __future__ import annotations

import contextlib
import logging
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from vllm_diffusion_plugin.engine.hsdp import BUILTIN_BLOCK_PATTERNS, HSDPConfig, apply_hsdp, build_mesh, select_blocks
from vllm_diffusion_plugin.engine.postprocess import move_parameter
from vllm_diffusion_plugin.tiny.models import build_tiny_model

FP8 = torch.float8_e4m3fn


@contextlib.contextmanager
def cpu_fake_mesh(shape: tuple[int, ...] = (1, 2)):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    try:
        yield init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    finally:
        dist.destroy_process_group()


# --- config ----------------------------------------------------------------------------------------------

def test_config_resolves_shard_size():
    assert HSDPConfig().resolved(4) == HSDPConfig(replicate_size=1, shard_size=4)
    assert HSDPConfig(replicate_size=2).resolved(8).mesh_shape == (2, 4)
    assert HSDPConfig(replicate_size=2, shard_size=2).resolved(4).mesh_shape == (2, 2)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(replicate_size=0), ValueError, "replicate_size must be a positive integer, got 0"),
    (dict(replicate_size=-2), ValueError, "replicate_size must be a positive integer, got -2"),
    (dict(shard_size=0), ValueError, r"shard_size must be a positive integer or -1 .*got 0"),
    (dict(shard_size=-3), ValueError, r"shard_size must be a positive integer or -1 .*got -3"),
    (dict(replicate_size=2.0), TypeError, r"replicate_size must be an int, got 2.0"),
    (dict(shard_size=True), TypeError, r"shard_size must be an int, got True"),
    (dict(param_dtype=torch.int8), TypeError, r"param_dtype must be a floating torch.dtype"),
    (dict(reshard_after_forward=1), TypeError, r"reshard_after_forward must be a bool"),
])
def test_bad_config_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        HSDPConfig(**kwargs)


@pytest.mark.parametrize("config, world, match", [
    (HSDPConfig(replicate_size=3), 4, r"world size 4 is not divisible by HSDP replicate_size 3"),
    (HSDPConfig(replicate_size=2, shard_size=3), 4, r"replicate_size 2 x shard_size 3 = 6 does not equal "
                                                    r"the world size 4"),
    (HSDPConfig(shard_size=8), 4, r"replicate_size 1 x shard_size 8 = 8 does not equal the world size 4"),
    (HSDPConfig(), 0, r"world size must be a positive integer, got 0"),
])
def test_config_against_world_fails_with_the_numbers(config, world, match):
    with pytest.raises(ValueError, match=match):
        config.resolved(world)  # pure: no process group, no model, no weights


def test_bad_config_fails_before_any_weight_is_touched():
    model = build_tiny_model("wan")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with cpu_fake_mesh((1, 2)) as mesh:
        with pytest.raises(ValueError, match=r"replicate_size 2 x shard_size 2 = 4 does not equal the world size 2"):
            apply_hsdp(model, mesh=mesh, config=HSDPConfig(replicate_size=2, shard_size=2))
        with pytest.raises(ValueError, match=r"world size 2 is not divisible by HSDP replicate_size 3"):
            build_mesh(HSDPConfig(replicate_size=3), device_type="cpu")
    for name, param in model.named_parameters():
        assert not isinstance(param, DTensor) and torch.equal(param, before[name]), name


# --- block selection -------------------------------------------------------------------------------------

def meta_model(class_name: str, **config) -> nn.Module:
    import diffusers

    with torch.device("meta"):
        return getattr(diffusers, class_name)(**config)


def test_builtin_blocks_for_known_dits():
    wan = select_blocks(build_tiny_model("wan"))
    assert (wan.source, wan.names) == ("builtin", ("blocks.0", "blocks.1"))
    flux = select_blocks(build_tiny_model("flux"))
    assert (flux.source, flux.names) == ("builtin", ("transformer_blocks.0", "single_transformer_blocks.0"))
    qwen = select_blocks(meta_model("QwenImageTransformer2DModel", in_channels=16, out_channels=4, num_layers=2,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                    axes_dims_rope=(4, 6, 6)))
    assert (qwen.source, qwen.names) == ("builtin", ("transformer_blocks.0", "transformer_blocks.1"))
    zimage = select_blocks(meta_model("ZImageTransformer2DModel", dim=64, n_layers=3, n_refiner_layers=1, n_heads=2,
                                      n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 12, 12]))
    assert zimage.source == "builtin"
    assert {n for n in zimage.names if n.startswith("layers.")} == {"layers.0", "layers.1", "layers.2"}
    assert set(BUILTIN_BLOCK_PATTERNS) >= {"WanTransformer3DModel", "FluxTransformer2DModel",
                                           "QwenImageTransformer2DModel", "ZImageTransformer2DModel"}


def test_model_attribute_wins_over_builtin_and_pattern_wins_over_both():
    model = build_tiny_model("wan")
    model._hsdp_shard_conditions = [lambda name, module: name == "blocks.1"]  # the vllm-omni convention
    assert (select_blocks(model).source, select_blocks(model).names) == ("attribute", ("blocks.1",))
    chosen = select_blocks(model, pattern=r"blocks\.0")
    assert (chosen.source, chosen.names) == ("pattern", ("blocks.0",))
    explicit = select_blocks(model, conditions=[lambda name, module: name == "blocks.0"])
    assert (explicit.source, explicit.names) == ("conditions", ("blocks.0",))


def test_selection_errors_name_the_pattern_or_conditions():
    model = build_tiny_model("wan")
    with pytest.raises(ValueError, match=r"pattern 'layers\\\\.\\\\d\+' matches no module of WanTransformer3DModel"):
        select_blocks(model, pattern=r"layers\.\d+")
    with pytest.raises(ValueError, match=r"not a valid regex"):
        select_blocks(model, pattern="blocks.(")
    model._hsdp_shard_conditions = [lambda name, module: False]
    with pytest.raises(ValueError, match=r"conditions \(attribute: .*<lambda>\) of WanTransformer3DModel match no"):
        select_blocks(model)
    model._hsdp_shard_conditions = ["blocks"]
    with pytest.raises(TypeError, match="must be callables"):
        select_blocks(model)


class TwoStacks(nn.Module):
    def __init__(self, big: int, small: int):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.trunk = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)) for _ in range(big))
        self.heads = nn.ModuleList(nn.Linear(8, 8) for _ in range(small))
        self.mixed = nn.ModuleList([nn.Linear(8, 8), nn.LayerNorm(8)])  # not one block class


def test_generic_rule_picks_largest_stack_and_comparable_ones():
    assert select_blocks(TwoStacks(big=6, small=2)).names == tuple(f"trunk.{i}" for i in range(6))
    both = select_blocks(TwoStacks(big=2, small=4))
    assert both.source == "generic" and both.names == ("heads.0", "heads.1", "heads.2", "heads.3",
                                                       "trunk.0", "trunk.1")
    declared = TwoStacks(big=6, small=2)
    declared._repeated_blocks = ["Linear"]  # diffusers' hint wins over size
    assert select_blocks(declared).names == ("heads.0", "heads.1")


def cogvideox():
    import diffusers

    torch.manual_seed(0)
    return diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=16, num_layers=3, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
        max_text_seq_length=8)


def test_generic_fallback_shards_an_unknown_diffusers_dit_and_logs_it(caplog):
    model = cogvideox()
    assert type(model).__name__ not in BUILTIN_BLOCK_PATTERNS
    caplog.set_level(logging.INFO, logger="vllm.vllm_diffusion_plugin")
    with cpu_fake_mesh((1, 2)) as mesh:
        report = apply_hsdp(model, mesh=mesh, config=HSDPConfig())
    assert report.source == "generic"
    assert report.blocks == ("transformer_blocks.0", "transformer_blocks.1", "transformer_blocks.2")
    assert "transformer_blocks (3 x CogVideoXBlock" in report.detail
    assert any("generic rule chose transformer_blocks (3 x CogVideoXBlock" in r.getMessage() for r in caplog.records)
    for block in model.transformer_blocks:
        assert all(isinstance(p, DTensor) and p.placements == (Replicate(), Shard(0)) for p in block.parameters())
    assert 0.45 < report.block_fraction < 0.55


# --- apply_hsdp structure -----------------------------------------------------------------------------------

def test_wan_blocks_sharded_half_per_rank_with_mixed_precision():
    model = build_tiny_model("wan")
    with cpu_fake_mesh((1, 2)) as mesh:
        report = apply_hsdp(model, mesh=mesh, config=HSDPConfig(param_dtype=torch.bfloat16))
    assert report.source == "builtin" and report.param_dtype == torch.bfloat16
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert report.local_bytes < report.total_bytes and 0.45 < report.block_fraction < 0.55
    assert report.as_dict()["mesh_shape"] == [1, 2]


class Block(nn.Module):
    """A block with what FSDP2 refuses: a 0-dim scale, an integer table, a non-contiguous (transposed)
    weight and an fp8 ``.t()`` view like vLLM's fp8 kernels keep."""

    def __init__(self, with_fp8: bool):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.table = nn.Parameter(torch.arange(6, dtype=torch.int32), requires_grad=False)
        self.t_weight = nn.Parameter(torch.randn(6, 8).t())
        if with_fp8:
            self.fp8_weight = nn.Parameter((torch.randn(6, 8) * 10).to(FP8).t(), requires_grad=False)


class Net(nn.Module):
    def __init__(self, with_fp8: bool = True):
        super().__init__()
        self.global_scale = nn.Parameter(torch.tensor(2.0))
        self.blocks = nn.ModuleList(Block(with_fp8) for _ in range(2))


def test_fsdp2_refuses_what_apply_hsdp_handles():
    """Negative controls: without the handling, plain fully_shard fails on these parameters."""
    with cpu_fake_mesh((1, 2)) as mesh:
        with pytest.raises(ValueError, match="scalar"):
            fully_shard(Net().blocks[0], mesh=mesh)
        block = Block(with_fp8=False)
        del block.scale, block.table
        with pytest.raises(NotImplementedError, match="non-contiguous"):
            fully_shard(block, mesh=mesh)


def test_scalar_and_integer_params_replicated_noncontiguous_made_contiguous(fake_accelerator):
    from vllm_diffusion_plugin.testing.fake_mesh import fake_mesh

    torch.manual_seed(0)
    model = Net(with_fp8=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # FSDP2 moves managed parameters with a `.data` swap, which a Python PrivateUse1 backend refuses from
    # CPU; start on the device (strides are preserved: the transposed weights stay non-contiguous).
    model.to(fake_accelerator.device)
    assert not model.blocks[0].t_weight.is_contiguous()
    # ... except the unshardable ones: FSDP ignores them, so apply_hsdp itself must place them on the device
    for owner, name in [(model, "global_scale"), (model.blocks[0], "scale"), (model.blocks[1], "table")]:
        move_parameter(owner, name, torch.device("cpu"))
    with fake_mesh((1, 2)) as mesh:
        report = apply_hsdp(model, mesh=mesh, config=HSDPConfig(param_dtype=torch.bfloat16))
        replicated = {"global_scale", "blocks.0.scale", "blocks.0.table", "blocks.1.scale", "blocks.1.table"}
        assert set(report.replicated_params) == replicated
        assert set(report.made_contiguous) == {f"blocks.{i}.{n}" for i in (0, 1) for n in ("t_weight", "fp8_weight")}
        assert report.param_dtype is None  # fp8 present: no all-gather cast
        assert all(fully_shard.state(m)._mp_policy.param_dtype is None for m in (model, *model.blocks))
        for name, param in model.named_parameters():
            if name in replicated:  # whole on this rank, on the mesh's device, values and dtype unchanged
                assert not isinstance(param, DTensor), name
                assert param.device == fake_accelerator.device and param.shape == before[name].shape
                assert torch.equal(param.cpu(), before[name]), name
            else:  # rank 0 of 2 holds the first ceil(n/2) rows, contiguous, values unchanged
                assert isinstance(param, DTensor) and param.placements == (Replicate(), Shard(0)), name
                local = param.to_local()
                rows = math.ceil(before[name].shape[0] / 2)
                assert local.device == fake_accelerator.device and local.is_contiguous(), name
                assert local.dtype == before[name].dtype, name
                assert torch.equal(local.cpu().float(), before[name][:rows].float()), name


def test_param_dtype_applies_without_fp8_and_double_sharding_refused():
    model = Net(with_fp8=False)
    with cpu_fake_mesh((1, 2)) as mesh:
        report = apply_hsdp(model, mesh=mesh, config=HSDPConfig(param_dtype=torch.bfloat16))
        assert report.param_dtype == torch.bfloat16
        assert all(fully_shard.state(m)._mp_policy.param_dtype == torch.bfloat16 for m in (model, *model.blocks))
        with pytest.raises(ValueError, match="already sharded"):
            apply_hsdp(model, mesh=mesh, config=HSDPConfig())


def test_nested_conditions_shard_bottom_up():
    model = build_tiny_model("wan")
    # vllm-omni's usual condition also matches nested ModuleList items (blocks.0.ffn.net.0, ...attn1.to_out.0)
    model._hsdp_shard_conditions = [lambda name, module: "blocks" in name and name.split(".")[-1].isdigit()]
    with cpu_fake_mesh((1, 2)) as mesh:
        report = apply_hsdp(model, mesh=mesh, config=HSDPConfig())
    assert {"blocks.0", "blocks.1", "blocks.0.ffn.net.2", "blocks.1.attn1.to_out.0"} <= set(report.blocks)
    assert report.source == "attribute"
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_meta_parameter_refused_with_its_name():
    model = Net(with_fp8=False)
    model.blocks[1].proj.to("meta")
    with cpu_fake_mesh((1, 2)) as mesh:
        with pytest.raises(ValueError, match=r"blocks\.1\.proj\.weight \(8, 8\) is still on the meta device"):
            apply_hsdp(model, mesh=mesh, config=HSDPConfig())


def test_one_dimensional_shard_mesh_accepted_when_replicate_is_one():
    model = build_tiny_model("flux")
    with cpu_fake_mesh((2,)) as mesh:
        report = apply_hsdp(model, mesh=mesh, config=HSDPConfig())
        assert report.mesh_shape == (2,)
        assert all(p.placements == (Shard(0),) for p in model.parameters())
    with cpu_fake_mesh((4,)) as mesh:
        with pytest.raises(ValueError, match=r"mesh shape \(4,\) does not match .* \(2, 2\)"):
            apply_hsdp(build_tiny_model("flux"), mesh=mesh, config=HSDPConfig(replicate_size=2))


def test_allow_meta_shards_a_skeleton_for_rank_local_loading():
    with torch.device("meta"):
        model = Net(with_fp8=False)
    with cpu_fake_mesh((1, 2)) as mesh:
        report = apply_hsdp(model, mesh=mesh, config=HSDPConfig(), allow_meta=True)
    assert set(report.replicated_params) == {"global_scale", "blocks.0.scale", "blocks.0.table",
                                             "blocks.1.scale", "blocks.1.table"}
    assert model.global_scale.is_meta and not isinstance(model.global_scale, DTensor)  # caller materializes
    weight = model.blocks[0].proj.weight
    assert isinstance(weight, DTensor) and weight.is_meta and weight.placements == (Replicate(), Shard(0))
    assert weight.to_local().shape == (4, 8) and 0.45 < report.block_fraction < 0.55


def test_seed_bug_3_a_per_parameter_data_move_splits_a_dtensor_from_its_shard():
    """Why fix #3 moves whole modules: ``p.data = p.data.to(x)`` on an FSDP2 DTensor parameter changes the wrapper
    and leaves its local shard behind (on CUDA the wrapper says cpu while the shard stays on the GPU: test_cuda;
    here a dtype change stands for the device move), while ``module.to(x)`` goes through FSDP2's ``_apply`` and
    moves both."""
    from torch.distributed.fsdp import fully_shard

    with cpu_fake_mesh((1, 2)) as mesh:
        naive, whole = (nn.Sequential(nn.Linear(8, 6)) for _ in range(2))
        for model in (naive, whole):
            fully_shard(model, mesh=mesh)
        for p in naive.parameters():
            p.data = p.data.to(torch.float64)
        whole.to(torch.float64)
        assert {(p.dtype, p.to_local().dtype) for p in naive.parameters()} == {(torch.float64, torch.float32)}
        assert {(p.dtype, p.to_local().dtype) for p in whole.parameters()} == {(torch.float64, torch.float64)}
