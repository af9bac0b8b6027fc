"""weights.py: streaming order and byte accounting, copies into existing storage, strict checks that leave
the module untouched when the headers already show the problem."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vllm_diffusion_plugin.engine.errors import CheckpointError
from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint, resolve_component
from vllm_diffusion_plugin.engine.io.stream import LoadStats, iterate_weights
from vllm_diffusion_plugin.engine.errors import WeightLoadError
from vllm_diffusion_plugin.engine.weights import load_into_module, strict_check_exemptions

INDEX = "diffusion_pytorch_model.safetensors.index.json"


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_identical(module: nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    now = module.state_dict()
    assert now.keys() == snapshot.keys()
    changed = [k for k in now if not torch.equal(now[k], snapshot[k])]
    assert not changed, f"module changed before the error: {changed[:5]}"


def _diffusers_model(source, **overrides) -> nn.Module:
    import diffusers

    cls = getattr(diffusers, source.config["_class_name"])
    torch.manual_seed(123)
    return cls.from_config({**source.config, **overrides}).eval()


def _rewrite(source, edit) -> None:
    """Apply ``edit(state_dict) -> state_dict`` to every shard of ``source`` and rewrite its index."""
    weight_map = {}
    for file in source.files:
        state = edit(load_file(str(file)))
        save_file(state, str(file), metadata={"format": "pt"})
        weight_map.update({k: file.name for k in state})
    index = json.loads(source.index.read_text())
    index["weight_map"] = weight_map
    source.index.write_text(json.dumps(index))


def test_iterate_weights_order_and_bytes(tiny_wan_dir):
    [source] = resolve_checkpoint(tiny_wan_dir, components=["transformer_2"])
    stats = LoadStats()
    names = [name for name, _ in iterate_weights(source, stats=stats)]
    assert names == list(source.tensors)  # file order, then on-disk order
    assert names == [name for name, _ in iterate_weights(source)]
    assert stats.total_bytes == source.total_bytes and stats.tensors == len(names)
    assert set(stats.bytes_per_file) == set(source.files)
    for file, nbytes in stats.bytes_per_file.items():
        header = 8 + int.from_bytes(file.read_bytes()[:8], "little")
        assert nbytes == file.stat().st_size - header
    subset = list(source.tensors)[::3]
    assert [n for n, _ in iterate_weights(source, keys=subset)] == subset


def test_load_equals_diffusers_from_pretrained(tiny_flux_dir):
    import diffusers

    [source] = resolve_checkpoint(tiny_flux_dir)
    module = _diffusers_model(source)
    storage = {k: v.data_ptr() for k, v in module.state_dict().items()}
    result = load_into_module(module, source=source)
    reference = diffusers.FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer")
    for key, value in reference.state_dict().items():
        assert torch.equal(module.state_dict()[key], value), key
    assert {k: v.data_ptr() for k, v in module.state_dict().items()} == storage  # copied in place
    assert result.loaded == set(source.tensors) and result.unexpected == ()
    assert result.bytes_read == source.total_bytes and result.files == source.files
    assert sum(result.bytes_per_file.values()) == result.bytes_read and result.seconds > 0


def test_bf16_checkpoint_casts_into_fp32_module(tiny_checkpoint_factory):
    [source] = resolve_checkpoint(tiny_checkpoint_factory("flux", dtype=torch.bfloat16))
    module = _diffusers_model(source)
    load_into_module(module, source=source)
    for key, tensor in iterate_weights(source):
        target = module.state_dict()[key]
        assert target.dtype == torch.float32 and torch.equal(target, tensor.float()), key


def test_shape_mismatch_names_key_shapes_file_and_leaves_module_untouched(tiny_wan_dir):
    [source] = resolve_checkpoint(tiny_wan_dir, components=["transformer"])
    module = _diffusers_model(source, ffn_dim=48)
    before = _snapshot(module)
    key = "blocks.0.ffn.net.0.proj.weight"
    file = source.tensors[key].file.name
    with pytest.raises(WeightLoadError, match=rf"nothing was copied:(?s:.*)\n  {key}: checkpoint shape \[32, 24\] "
                                              rf"\(from {file}\) != module shape \[48, 24\]\n"):
        load_into_module(module, source=source)
    _assert_identical(module, before)


def test_broadcastable_shape_is_still_a_mismatch(tiny_flux_dir, copy_checkpoint):
    # copy_ would silently broadcast a [1, N] tensor into an [M, N] parameter
    [source] = resolve_checkpoint(copy_checkpoint(tiny_flux_dir))
    key = "x_embedder.weight"
    _rewrite(source, lambda s: {k: (v[:1] if k == key else v) for k, v in s.items()})
    [source] = resolve_checkpoint(source.folder.parent)
    module = _diffusers_model(source)
    with pytest.raises(WeightLoadError, match=rf"{key}: checkpoint shape \[1, 4\]"):
        load_into_module(module, source=source)
    # without the header validation, the per-tensor check catches it too
    with pytest.raises(WeightLoadError, match=rf"{key}: checkpoint shape \[1, 4\] \(from .*\) != module shape"):
        load_into_module(module, iterate_weights(source))


def test_dtype_category_mismatch(tiny_flux_dir, copy_checkpoint):
    [source] = resolve_checkpoint(copy_checkpoint(tiny_flux_dir))
    key = "proj_out.bias"
    _rewrite(source, lambda s: {k: (v.to(torch.int32) if k == key else v) for k, v in s.items()})
    [source] = resolve_checkpoint(source.folder.parent)
    module = _diffusers_model(source)
    before = _snapshot(module)
    with pytest.raises(WeightLoadError, match=rf"{key}: checkpoint dtype torch.int32 \(from "
                                              rf"diffusion_pytorch_model-\d+-of-\d+.safetensors\) cannot be cast "
                                              rf"into module dtype torch.float32"):
        load_into_module(module, source=source)
    _assert_identical(module, before)


def test_missing_keys_listed_and_module_untouched(tiny_wan_dir, copy_checkpoint):
    [source] = resolve_checkpoint(copy_checkpoint(tiny_wan_dir), components=["transformer"])
    dropped = {"blocks.1.attn2.to_v.weight", "proj_out.bias"}
    _rewrite(source, lambda s: {k: v for k, v in s.items() if k not in dropped})
    [source] = resolve_checkpoint(source.folder.parent, components=["transformer"])
    module = _diffusers_model(source)
    before = _snapshot(module)
    with pytest.raises(WeightLoadError, match=r"missing from the checkpoint \(2\): blocks.1.attn2.to_v.weight, "
                                              r"proj_out.bias"):
        load_into_module(module, source=source)
    _assert_identical(module, before)
    # streamed without a manifest, the end-of-load check still catches it
    with pytest.raises(WeightLoadError, match=r"2 parameter\(s\)/buffer\(s\) of WanTransformer3DModel were not in "
                                              r".*/transformer: blocks.1.attn2.to_v.weight, proj_out.bias"):
        load_into_module(module, iterate_weights(source))


def test_unexpected_keys_warn_or_fail(tiny_flux_dir, copy_checkpoint, caplog):
    [source] = resolve_checkpoint(copy_checkpoint(tiny_flux_dir))
    _rewrite(source, lambda s: {**s, "extra.lora_A.weight": torch.ones(2)} if "proj_out.bias" in s else s)
    [source] = resolve_checkpoint(source.folder.parent)
    module = _diffusers_model(source)
    before = _snapshot(module)
    with pytest.raises(WeightLoadError, match=r"unexpected in the checkpoint \(1\): extra.lora_A.weight"):
        load_into_module(module, source=source, strict_unexpected=True)
    _assert_identical(module, before)
    with caplog.at_level(logging.WARNING):
        result = load_into_module(module, source=source)
    assert result.unexpected == ("extra.lora_A.weight",)
    assert "extra.lora_A.weight" in caplog.text and "skipped" in caplog.text
    assert result.bytes_read == source.total_bytes - 2 * 4  # the unexpected tensor is never read


def test_meta_target_is_refused_before_copying(tiny_flux_dir):
    [source] = resolve_checkpoint(tiny_flux_dir)
    with torch.device("meta"):
        module = _diffusers_model(source)
    with pytest.raises(WeightLoadError, match=r"on the meta device .* materialize the module first"):
        load_into_module(module, source=source)


def test_read_error_names_the_file(tiny_wan_dir, copy_checkpoint):
    [source] = resolve_checkpoint(copy_checkpoint(tiny_wan_dir), components=["transformer"])
    victim = source.files[-1]
    victim.write_bytes(victim.read_bytes()[:-64])  # damaged after it was resolved
    module = _diffusers_model(source)
    with pytest.raises(CheckpointError, match=rf"{victim}: (cannot open|error while reading)"):
        load_into_module(module, source=source)


class _VllmStyle(nn.Module):
    """A module with its own ``load_weights`` (like vLLM models): stacked q/k/v, names remapped."""

    def __init__(self, skip: str | None = None):
        super().__init__()
        self.qkv = nn.Linear(4, 12, bias=False)
        self.out = nn.Linear(12, 4, bias=False)
        self.skip = skip

    def load_weights(self, weights):
        loaded = set()
        params = dict(self.named_parameters())
        for name, tensor in weights:
            for i, shard in enumerate(("q", "k", "v")):
                if name == f"{shard}.weight":
                    params["qkv.weight"].data[4 * i:4 * i + 4].copy_(tensor)
                    name = "qkv.weight"
            if name != self.skip and name in params:
                if name != "qkv.weight":
                    params[name].data.copy_(tensor)
                loaded.add(name)
        return loaded


def _vllm_weights():
    gen = torch.Generator().manual_seed(3)
    return [(n, torch.randn(4, 4, generator=gen)) for n in ("q.weight", "k.weight", "v.weight")] + \
        [("out.weight", torch.randn(4, 12, generator=gen))]


def test_module_load_weights_is_used_and_checked():
    module = _VllmStyle()
    result = load_into_module(module, _vllm_weights())
    assert result.loaded == {"qkv.weight", "out.weight"} and result.bytes_read == (3 * 16 + 48) * 4
    assert torch.equal(module.qkv.weight[4:8], _vllm_weights()[1][1])
    with pytest.raises(WeightLoadError, match=r"_VllmStyle.load_weights left 1 parameter\(s\) not initialized "
                                              r"from weights: out.weight"):
        load_into_module(_VllmStyle(skip="out.weight"), _vllm_weights())


class _OnlineQuant:
    uses_meta_device = True


class _PostProcessOnly:
    def process_weights_after_loading(self, layer):
        pass


def test_strict_check_exemptions_follow_vllm():
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    module = _VllmStyle(skip="out.weight")
    module.out.quant_method = _OnlineQuant()  # online quant: scales come from quantizing, not the checkpoint
    load_into_module(module, _vllm_weights())

    attn = nn.Module()
    attn.k_scale = nn.Parameter(torch.tensor(1.0))
    attn.quant_method = BaseKVCacheMethod(quant_config=None)
    linear = nn.Linear(2, 2)
    linear.quant_method = _PostProcessOnly()  # a plain method that post-processes: weights still required
    linear.input_scale_ub = nn.Parameter(torch.tensor(1.0))
    root = nn.ModuleDict({"attn": attn, "linear": linear})
    root.empty = nn.Parameter(torch.empty(0))
    assert strict_check_exemptions(root) == {"attn.k_scale", "linear.input_scale_ub", "empty"}


def test_progress_bar_only_on_rank_zero_terminals(tiny_flux_dir, monkeypatch):
    from vllm_diffusion_plugin.engine.io import stream as weights

    [source] = resolve_checkpoint(tiny_flux_dir)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setenv("RANK", "0")
    assert weights._progress_bar(source, source.total_bytes, None) is None  # small: no bar by default
    bar = weights._progress_bar(source, source.total_bytes, True)
    assert bar is not None and bar.total == source.total_bytes
    bar.close()
    assert weights._progress_bar(source, 2 << 30, None) is not None
    monkeypatch.setenv("RANK", "1")
    assert weights._progress_bar(source, 2 << 30, True) is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert weights._progress_bar(source, 2 << 30, True) is None


def test_pickle_weights_stream_like_safetensors(tiny_checkpoint_factory):
    [pickled] = resolve_checkpoint(tiny_checkpoint_factory("flux", safe_serialization=False), allow_pickle=True)
    [safe] = resolve_checkpoint(tiny_checkpoint_factory("flux"))
    a, b = dict(iterate_weights(pickled)), dict(iterate_weights(safe))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    module = _diffusers_model(pickled)
    assert load_into_module(module, source=pickled).bytes_read == safe.total_bytes


def test_single_component_without_index(tiny_flux_dir, tmp_path):
    module = _diffusers_model(resolve_component(tiny_flux_dir / "transformer"))
    folder = tmp_path / "single"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_flux_dir / "transformer" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in module.state_dict().items()},
              str(folder / "diffusion_pytorch_model.safetensors"))
    source = resolve_component(folder)
    target = _diffusers_model(source)
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    load_into_module(target, source=source)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in module.state_dict().items())
    assert Path(source.files[0]).name == "diffusion_pytorch_model.safetensors"
