"""``hsdp_weight_load=rank_local`` with online quant methods without the row protocol (issue 50), on real gloo ranks.

Such a method finishes a layer whole in its own ``process_weights_after_loading`` (vLLM's ``fp8``: one scale over
stacked shards, the weight transposed for ``_scaled_mm``). ``rank_local`` gathers each layer's rows from the ranks
of its shard group into a whole transient layer, runs the method's own post-processing on it and keeps this rank's
dim-0 shard of every resulting parameter, as ``fully_shard`` cuts it (``engine.quant.whole``). So every rank's
parameters must be bit-identical to ``full``'s shard on the same mesh (``full``: the whole layer processed, then
sharded), with two stand-ins (``testing.online_quant``): the pure-torch fp8 method with its row protocol switched
off, and one that requantizes stacked shards to their largest scale and stores the weight transposed. Two LoRA
files are fused first; each rank still reads only its rows. Before this path, both were refused by name
(``RowQuantError``: "does not declare how").
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from test_distributed_load import write_rich_lora, write_uneven_wan

STAND_INS = ("rows-off", "stacked-transposed")


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> tuple[str, list]:
    import diffusers

    from vllm_diffusion_plugin.tiny.models import write_tiny_lora

    root = write_uneven_wan(tmp_path_factory.mktemp("uneven-wan-whole"))
    rich = write_rich_lora(root.parent / "rich_lora.safetensors", root)
    model = diffusers.WanTransformer3DModel.from_pretrained(root / "transformer")
    other = write_tiny_lora(root.parent / "second_lora.safetensors", model, seed=9,
                            targets=("to_k", "to_out.0", "ffn.net.2"))
    # two files into transformer (the second at 0.5), the rich one into transformer_2
    return str(root), [(str(rich), 1.0, "transformer"), (str(other), 0.5, "transformer"),
                       (str(rich), 0.7, "transformer_2")]


@pytest.fixture(scope="module")
def qwen_image(tmp_path_factory) -> tuple[str, list]:
    from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora, write_tiny_pipeline

    root = write_tiny_pipeline(tmp_path_factory.mktemp("qwen-image-whole"), "qwen-image", dtype=torch.bfloat16)
    model = build_tiny_model("qwen-image")
    first = write_tiny_lora(root.parent / "qwen_lora.safetensors", model, seed=4,
                            targets=("to_q", "to_k", "to_v", "add_k_proj", "img_mlp.net.0.proj"))
    second = write_tiny_lora(root.parent / "qwen_lora_2.safetensors", model, seed=6,
                             targets=("to_q", "add_v_proj", "txt_mlp.net.2"))
    return str(root), [(str(first), 1.0, None), (str(second), 0.5, None)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def whole_worker(rank: int, world_size: int, checkpoint: str, loras: list, stand_in: str, replicate: int = 1) -> dict:
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec
    from vllm_diffusion_plugin.engine.plan import plan_load
    from vllm_diffusion_plugin.engine.session import load_components
    from vllm_diffusion_plugin.testing.online_quant import attach_online_quant

    quantization = functools.partial(attach_online_quant, rows=False) if stand_in == "rows-off" else \
        functools.partial(attach_online_quant, stacked=True)
    specs = [LoraSpec(Path(path), scale, component) for path, scale, component in loras]
    common = dict(device=torch.device("cpu"), dtype=torch.bfloat16, lora_specs=specs, quantization=quantization,
                  hsdp=HSDPConfig(replicate_size=replicate))
    ref = load_components(checkpoint, options=LoadOptions(hsdp_weight_load="full"), **common)
    got = load_components(checkpoint, options=LoadOptions(hsdp_weight_load="rank_local"), **common)
    planned = plan_load(checkpoint, options=LoadOptions(), lora_specs=specs, world_size=world_size,
                        hsdp=HSDPConfig(replicate_size=replicate), dtype=torch.bfloat16, quantization=quantization)
    plan_rows = {c.name: c for r in planned.ranks if r.strategy == "rank_local" and r.rank == rank
                 for c in r.components}
    mismatches, fp8, transposed, checked = [], 0, 0, 0
    for name, module in got.modules.items():
        whole = ref.modules[name]
        want_params = dict(whole.named_parameters())
        mine = dict(module.named_parameters())
        if sorted(want_params) != sorted(mine):
            mismatches.append(f"{name}: parameters {sorted(set(want_params) ^ set(mine))[:6]}")
        for pname, param in mine.items():
            want = _local(want_params[pname]).detach()
            local = _local(param).detach()
            checked += 1
            fp8 += local.dtype == torch.float8_e4m3fn
            owner = module.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else module
            transposed += bool(pname.endswith(".weight") and local.dtype == torch.float8_e4m3fn and
                               owner.in_features != owner.out_features and param.shape[0] == owner.in_features)
            if local.dtype != want.dtype or local.shape != want.shape or not torch.equal(_bits(local), _bits(want)):
                mismatches.append(f"{name}.{pname} {tuple(local.shape)} {local.dtype} vs {tuple(want.shape)} "
                                  f"{want.dtype}")
    report = got.report.to_dict()
    return {"mismatches": mismatches, "fp8": fp8, "transposed": transposed, "checked": checked,
            "bytes_read": {c["name"]: c["bytes_read"] for c in report["components"]},
            "total_bytes": {n: s.total_bytes for n, s in got.sources.items()},
            "quant_path": {c["name"]: c["quant_path"] for c in report["components"]},
            "lora_keys_fused": (report["lora_keys_fused"], ref.report.to_dict()["lora_keys_fused"]),
            "plan": {n: (c.bytes_read, c.transient, c.transient_bytes) for n, c in plan_rows.items()}}


def check(results: list[dict], shards: int, stand_in: str) -> None:
    for name, total in results[0]["total_bytes"].items():  # each shard group reads the DiT exactly once
        assert sum(r["bytes_read"][name] for r in results) == total * len(results) // shards, (stand_in, name)
    for rank, r in enumerate(results):
        what = f"{stand_in}, rank {rank} of {len(results)}"
        assert r["fp8"] > 0 and r["checked"] > r["fp8"], (what, r["fp8"], r["checked"])
        assert not r["mismatches"], f"{what}: not bit-identical to full's shard: {r['mismatches'][:8]}"
        if stand_in == "stacked-transposed":
            assert r["transposed"] > 0, what  # the [in, out] layout reached FSDP2, as full's
        assert min(r["lora_keys_fused"]) > 0, (what, r["lora_keys_fused"])  # the bits above prove what was fused
        assert set(r["quant_path"].values()) == {"layer-whole"}, (what, r["quant_path"])
        for name, read in r["bytes_read"].items():
            total = r["total_bytes"][name]
            print(f"\n[bytes read] {what} {name}: {read} of {total} ({read * shards / total:.3f} x 1/S)", flush=True)
            # the goal is 1.05 x DiT / S; the tiny uneven Wan's 30-row FFN (split 8/8/8/6) and its 1-row tables put
            # rank 0 of 4 at 1.055: what each rank reads is exactly torch.chunk's share (the plan's, below)
            assert 0 < read <= 1.06 * total / shards, (what, name, read, total / shards)
            planned_read, transient, transient_bytes = r["plan"][name]
            assert planned_read == read, (what, name, planned_read, read)
            assert transient == "quantization" and transient_bytes > 0, (what, name, transient)


@pytest.mark.multiproc
@pytest.mark.parametrize("stand_in", STAND_INS)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", ["wan", "qwen_image"])
def test_rank_local_layer_whole_bit_identical_to_fulls_shard(request, family, world, stand_in):
    """Wan2.2 (two DiTs, an uneven FFN) and an image family (Qwen-Image's joint blocks)."""
    checkpoint, loras = request.getfixturevalue(family)
    check(run_distributed(whole_worker, world, args=(checkpoint, loras, stand_in), timeout_s=300), world, stand_in)


@pytest.mark.multiproc
def test_hsdp_replicas_gather_within_their_own_shard_group(wan):
    """(replicate 2, shard 2): each replica's shard group gathers its layers; every rank equals full's shard."""
    checkpoint, loras = wan
    check(run_distributed(whole_worker, 4, args=(checkpoint, loras, "stacked-transposed", 2), timeout_s=300), 2,
          "stacked-transposed")


# ---- single process: the layout probed before sharding, the plan ----------------------------------------------
class _ItemMethod:
    """An online method whose post-processing cannot run on ``meta`` (it reads a value: ``.item()``)."""

    uses_meta_device = True

    def process_weights_after_loading(self, layer) -> None:
        scale = layer.weight.abs().amax().item() / 448 or 1.0
        layer.weight = torch.nn.Parameter((layer.weight / scale).to(torch.float8_e4m3fn).t(), requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(torch.tensor(scale), requires_grad=False)
        layer.processed_by_item_method = True


def _wan_on_meta():
    import diffusers

    from vllm_diffusion_plugin.tiny.models import TINY_CONFIGS

    with torch.device("meta"):
        return diffusers.WanTransformer3DModel(**TINY_CONFIGS["wan"])


def test_layout_is_probed_on_meta_and_laid_out_contiguous_before_sharding():
    from vllm_diffusion_plugin.engine.quant.online import find_layers
    from vllm_diffusion_plugin.engine.quant.whole import Layout, find_whole_layers, to_whole_layout
    from vllm_diffusion_plugin.testing.online_quant import attach_online_quant

    module = _wan_on_meta()
    attach_online_quant(module, stacked=True)
    assert find_layers(module, others="skip") == []
    layers = find_whole_layers(module)
    proj = module.blocks[0].ffn.net[0].proj
    layer = next(x for x in layers if x.module == "blocks.0.ffn.net.0.proj")
    assert layer.outputs == {"weight": Layout((proj.in_features, proj.out_features), torch.float8_e4m3fn),
                             "bias": Layout((proj.out_features,), torch.float32),
                             "weight_scale": Layout((), torch.float32)}
    assert layer.read == ("blocks.0.ffn.net.0.proj.weight",)
    assert layer.added == ("blocks.0.ffn.net.0.proj.weight_scale",)
    weight = proj.weight
    weight.weight_loader = loader = object()
    to_whole_layout(module, layers)
    assert proj.weight is weight and weight.weight_loader is loader  # the same Parameter, its attributes kept
    assert weight.dtype == torch.float8_e4m3fn and weight.is_contiguous() and weight.is_meta
    assert tuple(weight.shape) == (proj.in_features, proj.out_features) and proj.weight_scale.shape == ()
    assert not hasattr(proj, "_already_called_process_weights_after_loading")  # the probe ran on a copy


def test_a_method_that_cannot_run_on_meta_is_probed_once_on_a_zero_filled_layer():
    from vllm_diffusion_plugin.engine.quant.whole import Layout, find_whole_layers

    module = _wan_on_meta()
    for name in ("blocks.0.attn1.to_q", "blocks.1.attn1.to_q"):
        module.get_submodule(name).quant_method = _ItemMethod()
    layers = find_whole_layers(module, device="cpu")
    assert [x.module for x in layers] == ["blocks.0.attn1.to_q", "blocks.1.attn1.to_q"]
    dim = module.blocks[0].attn1.to_q.in_features
    assert layers[0].outputs["weight"] == Layout((dim, dim), torch.float8_e4m3fn)
    assert not hasattr(module.blocks[0].attn1.to_q, "processed_by_item_method")


def test_vllms_fp8_is_planned_layer_whole_with_its_transient():
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.plan import plan_load
    from vllm_diffusion_plugin.engine.quant.plan import online_fp8_hook
    from vllm_diffusion_plugin.tiny.models import write_tiny_pipeline

    root = write_tiny_pipeline(Path(tempfile.mkdtemp(prefix="plan-whole-")), "wan", dtype=torch.bfloat16)
    plans = {method: plan_load(str(root), options=LoadOptions(), world_size=2, hsdp=HSDPConfig(),
                               dtype=torch.bfloat16, quantization=online_fp8_hook(method))
             for method in ("fp8", "torch_fp8")}
    for method, plan in plans.items():
        mine = next(r for r in plan.ranks if r.strategy == "rank_local" and r.rank == 0)
        dit = next(c for c in mine.components if c.name == "transformer")
        assert dit.transient == "quantization" and dit.transient_bytes > 0, (method, dit)
    whole = next(c for r in plans["fp8"].ranks if r.strategy == "rank_local" for c in r.components)
    rows = next(c for r in plans["torch_fp8"].ranks if r.strategy == "rank_local" for c in r.components)
    largest = max(m.weight.numel() for n, m in _wan_on_meta().named_modules()
                  if isinstance(m, torch.nn.Linear) and n.startswith("blocks."))
    assert whole.transient_bytes >= 3 * largest  # the largest layer whole in bf16 and its fp8 form, beside the rows
    assert abs(whole.held - rows.held) <= 0.01 * rows.held  # fp8 + one scale per layer either way


def test_a_lora_swap_into_layers_finished_whole_is_refused_by_name():
    from vllm_diffusion_plugin.engine.quant.whole import LAYER_WHOLE_ATTR
    from vllm_diffusion_plugin.engine.swap import LoraSwapRefused, module_rows
    from vllm_diffusion_plugin.testing.online_quant import attach_online_quant

    module = _wan_on_meta()
    attach_online_quant(module, rows=False)
    setattr(module.blocks[0].attn1.to_q, LAYER_WHOLE_ATTR, True)  # what gather_by_block marks
    with pytest.raises(LoraSwapRefused, match=r"transformer's online-quantized layers blocks\.0\.attn1\.to_q \.\.\. "
                                              r"were post-processed whole"):
        module_rows("transformer", module, None, device=torch.device("cpu"), dtype=torch.bfloat16)
