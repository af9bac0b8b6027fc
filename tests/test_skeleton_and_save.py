"""skeleton.py: modules from config.json without random init (real buffers kept), equal to diffusers'
``from_pretrained`` bit for bit; ``save_component`` round-trips through diffusers and writes atomically."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_diffusion_plugin.engine.errors import CheckpointError
from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint, resolve_component
from vllm_diffusion_plugin.engine.skeleton import build_component
from vllm_diffusion_plugin.engine.save import save_component
from vllm_diffusion_plugin.engine.io.stream import iterate_weights
from vllm_diffusion_plugin.engine.weights import load_into_module

CLASSES = {"wan": "WanTransformer3DModel", "flux": "FluxTransformer2DModel"}


def _full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and *all* buffers (non-persistent ones too)."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _assert_same(ours: torch.nn.Module, reference: torch.nn.Module) -> None:
    a, b = _full_state(ours), _full_state(reference)
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, (key, a[key].dtype, b[key].dtype)
        assert torch.equal(a[key].cpu(), b[key].cpu()), key


def _load(source, dtype, device="cpu"):
    module = build_component(source, dtype=dtype, device=device)
    load_into_module(module, iterate_weights(source), source=source)
    return module


@pytest.mark.parametrize("kind", ["wan", "flux"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_component_equals_from_pretrained(tiny_checkpoint_factory, tiny_model_inputs, kind, dtype):
    import diffusers

    root = tiny_checkpoint_factory(kind)
    for source in resolve_checkpoint(root):
        ours = _load(source, dtype)
        reference = getattr(diffusers, CLASSES[kind]).from_pretrained(source.folder, torch_dtype=dtype)
        _assert_same(ours, reference)  # parameters, keep-in-fp32 dtypes, and non-persistent buffers
        assert not ours.training
        # CPU kernels' rounding depends on storage alignment: from_pretrained's parameters are not 64-byte
        # aligned (seen: 4.5e-6 apart with identical weights); a deep copy re-allocates them like ours.
        reference = copy.deepcopy(reference)
        with torch.no_grad():
            out = ours(**tiny_model_inputs(kind, dtype))[0]
            expected = reference(**tiny_model_inputs(kind, dtype))[0]
        assert torch.isfinite(out).all() and torch.equal(out, expected)


def test_non_persistent_buffers_keep_their_computed_values(tiny_wan_dir):
    import diffusers

    [source, _] = resolve_checkpoint(tiny_wan_dir)
    module = build_component(source, dtype=torch.float32, device="cpu")  # before any weight is loaded
    fresh = diffusers.WanTransformer3DModel.from_config(dict(source.config))
    persistent = set(fresh.state_dict())
    non_persistent = {k: v for k, v in fresh.named_buffers() if k not in persistent}
    assert set(non_persistent) == {"rope.freqs_cos", "rope.freqs_sin"}
    built = dict(module.named_buffers())
    for key, value in non_persistent.items():
        assert torch.equal(built[key], value), f"{key} lost its computed value"


class _RandomInitCounter(TorchDispatchMode):
    """Counts elements written by random-init kernels into real (non-meta) tensors."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if re.search(r"uniform|normal|rand|bernoulli|random_|trunc", name) and isinstance(out, torch.Tensor) \
                and not out.is_meta:
            self.elements += out.numel()
        return out


@pytest.mark.parametrize("kind", ["wan", "flux"])
def test_build_component_does_not_random_init(tiny_checkpoint_factory, kind):
    [source, *_] = resolve_checkpoint(tiny_checkpoint_factory(kind))
    with _RandomInitCounter() as counter:
        module = build_component(source, dtype=torch.float32, device="cpu")
    n_params = sum(p.numel() for p in module.parameters())
    # only parameters a class draws explicitly with torch.randn (Wan's scale_shift_table) are computed
    assert counter.elements < 0.05 * n_params, (counter.elements, n_params)
    skeleton = build_component(source, dtype=torch.bfloat16, device="meta")
    assert all(p.is_meta for p in skeleton.parameters())
    assert all(not b.is_meta for b in skeleton.buffers())


def test_init_functions_skip_meta_parameters_but_still_fill_buffers():
    """Under ``parameters_on_meta`` ``nn.init`` returns meta tensors untouched (no decomposition calls) and still
    initializes real tensors (a buffer a class fills with ``nn.init``); the functions are restored afterwards."""
    from torch import nn

    from vllm_diffusion_plugin.engine.skeleton import parameters_on_meta

    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)
            gen = torch.Generator().manual_seed(0)
            self.register_buffer("table", nn.init.normal_(torch.empty(3, 5), generator=gen))

    class RandomOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.on = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if re.search(r"uniform|normal", func.overloadpacket.__name__):
                self.on.append(out.device.type)
            return out

    before = {name: getattr(nn.init, name) for name in ("normal_", "kaiming_uniform_", "uniform_")}
    with parameters_on_meta(), RandomOps() as ops:
        module = Module()
    assert module.lin.weight.is_meta and module.lin.bias.is_meta
    assert torch.equal(module.table, torch.empty(3, 5).normal_(generator=torch.Generator().manual_seed(0)))
    assert ops.on == ["cpu"]  # the buffer's draw only; none for the meta parameters (kaiming/uniform skipped)
    assert {name: getattr(nn.init, name) for name in before} == before


def test_skeleton_is_constructed_on_one_thread_and_the_count_is_restored(tiny_wan_dir, monkeypatch):
    """Construction computes only small buffers: one intra-op thread (no pool wake-ups on a busy host);
    the caller's thread count is back afterwards, also when construction fails."""
    import diffusers

    from vllm_diffusion_plugin.engine import skeleton

    seen = []
    real = diffusers.WanTransformer3DModel

    class Probe(real):
        @classmethod
        def from_config(cls, config, **kwargs):
            seen.append(torch.get_num_threads())
            if config.get("fail"):
                raise RuntimeError("boom")
            return real.from_config(config, **kwargs)

    monkeypatch.setattr(skeleton, "component_class", lambda source: Probe)
    source = resolve_component(tiny_wan_dir / "transformer")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        build_component(source, dtype=torch.float32, device="cpu")
        assert seen == [1] and torch.get_num_threads() == 2
        broken = copy.copy(source)
        object.__setattr__(broken, "config", {**source.config, "fail": True})
        with pytest.raises(CheckpointError, match="boom"):
            build_component(broken, dtype=torch.float32, device="cpu")
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_build_on_the_fake_accelerator(tiny_wan_dir, fake_accelerator):
    import diffusers

    [source, _] = resolve_checkpoint(tiny_wan_dir)
    device = fake_accelerator.device
    module = build_component(source, dtype=torch.float32, device=device)
    assert all(p.device == device for p in module.parameters())
    assert all(b.device == device for b in module.buffers())
    fake_accelerator.reset_counters()
    load_into_module(module, source=source)
    assert fake_accelerator.h2d_bytes == source.total_bytes and fake_accelerator.d2h_bytes == 0
    reference = diffusers.WanTransformer3DModel.from_pretrained(source.folder)
    _assert_same(module, reference)


def test_unknown_or_missing_class_names_the_file(tiny_flux_dir, copy_checkpoint):
    folder = copy_checkpoint(tiny_flux_dir) / "transformer"
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_class_name": "NoSuchTransformer3DModel"}))
    with pytest.raises(CheckpointError, match=rf"{folder / 'config.json'}: _class_name 'NoSuchTransformer3DModel' "
                                              rf"is not a class diffusers"):
        build_component(resolve_component(folder), dtype=torch.float32, device="cpu")
    del config["_class_name"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"{folder / 'config.json'}: no _class_name"):
        build_component(resolve_component(folder), dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("kind", ["wan", "flux"])
def test_save_component_round_trips_through_diffusers(tiny_checkpoint_factory, tmp_path, kind):
    import diffusers

    [source, *_] = resolve_checkpoint(tiny_checkpoint_factory(kind))
    module = _load(source, torch.float32)
    with torch.no_grad():  # a "fused" change, so the output is not a byte copy of the input
        next(module.parameters()).add_(1.0)
    out = tmp_path / "fused" / "transformer"
    total = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    assert save_component(module, None, out, max_shard_size=total // 3) == out
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) >= 3 and all(re.fullmatch(rf"diffusion_pytorch_model-\d{{5}}-of-{len(shards):05d}"
                                                 rf"\.safetensors", n) for n in shards)
    assert names == sorted(["config.json", "diffusion_pytorch_model.safetensors.index.json", *shards])
    assert json.loads((out / "config.json").read_text())["_class_name"] == CLASSES[kind]
    reference = getattr(diffusers, CLASSES[kind]).from_pretrained(out)
    _assert_same(module, reference)
    again = resolve_component(out)  # and our own resolver reads it back the same
    assert again.index is not None and len(again.files) == len(shards)
    _assert_same(_load(again, torch.float32), module)
    assert [p.name for p in out.parent.iterdir()] == ["transformer"]  # no temp folders left


def test_single_shard_save_still_has_an_index(tiny_flux_dir, tmp_path):
    import diffusers

    [source] = resolve_checkpoint(tiny_flux_dir)
    state = dict(iterate_weights(source))
    out = save_component(state, source.config, tmp_path / "one")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "diffusion_pytorch_model-00001-of-00001.safetensors",
        "diffusion_pytorch_model.safetensors.index.json"]
    reference = diffusers.FluxTransformer2DModel.from_pretrained(out)
    assert all(torch.equal(reference.state_dict()[k], v) for k, v in state.items())


def test_save_is_atomic(tiny_flux_dir, tmp_path, monkeypatch):
    import safetensors.torch

    [source] = resolve_checkpoint(tiny_flux_dir)
    state = dict(iterate_weights(source))
    real_save, calls = safetensors.torch.save_file, []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    with pytest.raises(OSError, match="No space left"):
        save_component(state, source.config, tmp_path / "out", max_shard_size=source.total_bytes // 3)
    assert list(tmp_path.iterdir()) == []  # neither the output nor a partial folder
    monkeypatch.undo()

    save_component(state, source.config, tmp_path / "out")
    with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"):
        save_component(state, source.config, tmp_path / "out")
    state["proj_out.bias"] = state["proj_out.bias"] + 1
    save_component(state, source.config, tmp_path / "out", overwrite=True, max_shard_size=source.total_bytes // 3)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    reloaded = dict(iterate_weights(resolve_component(tmp_path / "out")))
    assert torch.equal(reloaded["proj_out.bias"], state["proj_out.bias"])


def test_save_rejects_what_it_cannot_write(tmp_path):
    config = {"_class_name": "FluxTransformer2DModel"}
    with pytest.raises(ValueError, match=r"'w' \[2, 2\] is on the meta device"):
        save_component({"w": torch.empty(2, 2, device="meta")}, config, tmp_path / "a")
    with pytest.raises(ValueError, match="needs a _class_name"):
        save_component({"w": torch.ones(2)}, {}, tmp_path / "b")
    assert list(tmp_path.iterdir()) == []
    shared = torch.ones(4)
    out = save_component({"a": shared, "b": shared, "c": shared[:2]}, config, tmp_path / "tied")
    loaded = dict(iterate_weights(resolve_component(out)))
    assert torch.equal(loaded["a"], shared) and torch.equal(loaded["b"], shared)
    assert torch.equal(loaded["c"], shared[:2])
