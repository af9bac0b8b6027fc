"""HSDP-aware post-load processing and the online-quant finalize (DESIGN.md fixes #2 and #3).

Seed bug A: a per-parameter ``param.data = param.data.to(cpu)`` move breaks on FSDP-sharded DTensor
parameters on an accelerator. Seed bug B: a whole-module ``module.to(target)`` breaks on a layer that online
quantization left on ``meta``. Each seed test first shows the naive code failing on the same model, then
shows ours succeeding — and fails if ours regresses to that naive code.

Online quant here uses vLLM's real layerwise machinery (``initialize_online_processing`` wraps the weight
loaders, ``finalize_layerwise_processing`` finalizes stragglers) with a small pure-torch per-tensor fp8
method: vLLM's own online fp8 methods quantize with ``torch.ops._C.static_scaled_fp8_quant``, which the PyPI
wheel lacks on CPU (no ``vllm._C``), and its MXFP8 method has no CPU kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.model_loader.reload import layerwise

from vllm_diffusion_plugin import compat
from vllm_diffusion_plugin.engine.postprocess import PROCESSED_ATTR, has_online_quant, process_weights_after_loading
from vllm_diffusion_plugin.testing.online_quant import TorchFp8OnlineMethod

FP8 = torch.float8_e4m3fn


class RecordingScaleMethod(QuantizeMethodBase):
    """An offline method whose post-processing does real work: doubles the weight in place and records the
    device and tensor type each parameter had while it ran."""

    def __init__(self) -> None:
        self.calls: list[dict[str, tuple[torch.device, str]]] = []

    def create_weights(self, layer, *args, **kwargs):
        raise NotImplementedError("weights are created by nn.Linear in these tests")

    def apply(self, layer, x, bias=None):
        return nn.functional.linear(x, layer.weight, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls.append({n: (p.device, type(p).__name__) for n, p in layer.named_parameters()})
        with torch.no_grad():
            layer.weight.mul_(2.0)


def full_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def padded_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Loads fewer rows than the parameter has (padding): the layer never counts as fully loaded."""
    rows = loaded.shape[0]
    param.data[:rows].copy_(loaded)
    param.data[rows:].zero_()


class QuantLinear(nn.Module):
    def __init__(self, method: QuantizeMethodBase, in_features: int, out_features: int, loader=full_loader):
        super().__init__()
        self.quant_method = method
        if method.uses_meta_device:
            method.create_weights(self, in_features, out_features, loader)
        else:
            self.weight = nn.Parameter(torch.randn(out_features, in_features))
            self.bias = nn.Parameter(torch.randn(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, getattr(self, "bias", None))


def naive_per_parameter_process(model: nn.Module, target: torch.device) -> None:
    """The per-parameter move that regressed HSDP (``.data`` swap on every parameter, then back)."""
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
            homes = {}
            for name, p in module.named_parameters():
                homes[name] = p.device
                p.data = p.data.to(target)
            module.quant_method.process_weights_after_loading(module)
            for name, p in module.named_parameters():
                p.data = p.data.to(homes[name])


def naive_whole_module_process(model: nn.Module, target: torch.device) -> None:
    """The whole-module move without the online-quant finalize (what crashed on meta stragglers)."""
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
            home = next(module.parameters()).device
            if home != target:
                module.to(target)
            module.quant_method.process_weights_after_loading(module)
            if home != target:
                module.to(home)


# --- seed bug A: FSDP-sharded DTensor parameters on an accelerator -------------------------------------------

def sharded_model_on(device: torch.device, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(QuantLinear(RecordingScaleMethod(), 8, 6)) for _ in range(2)))
    model.to(device)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def dtensor_snapshot(model: nn.Module) -> dict[str, tuple]:
    return {n: (p.device, p.placements, tuple(p.shape), p.to_local().detach().to("cpu", copy=True))
            for n, p in model.named_parameters()}


def test_seed_a_naive_per_parameter_move_breaks_on_sharded_dtensors(fake_accelerator):
    from vllm_diffusion_plugin.testing.fake_mesh import fake_mesh

    with fake_mesh((1, 2)) as mesh:
        model = sharded_model_on(fake_accelerator.device, mesh)
        with pytest.raises(RuntimeError):
            naive_per_parameter_process(model, torch.device("cpu"))


def test_seed_a_sharded_model_is_processed_and_dtensors_kept(fake_accelerator):
    from torch.distributed.tensor import DTensor

    from vllm_diffusion_plugin.testing.fake_mesh import fake_mesh

    with fake_mesh((1, 2)) as mesh:
        model = sharded_model_on(fake_accelerator.device, mesh)
        before = dtensor_snapshot(model)
        assert all(dev == fake_accelerator.device for dev, *_ in before.values())

        report = process_weights_after_loading(model, torch.device("cpu"))

        assert report.processed == ("0.0", "1.0") and report.online_quant is False
        for layer in (model[0][0], model[1][0]):
            # processing ran once, on the target device, on DTensor parameters
            assert layer.quant_method.calls == [{"weight": (torch.device("cpu"), "DTensor"),
                                                 "bias": (torch.device("cpu"), "DTensor")}]
        after = dtensor_snapshot(model)
        for name, (dev, placements, shape, local) in before.items():
            param = model.get_parameter(name)
            assert isinstance(param, DTensor), name
            assert (after[name][0], after[name][1], after[name][2]) == (dev, placements, shape), name
            expected = local * 2 if name.endswith("weight") else local
            torch.testing.assert_close(after[name][3], expected, rtol=0, atol=0)

        again = process_weights_after_loading(model, torch.device("cpu"))  # idempotent
        assert again.processed == () and again.skipped == ("0.0", "1.0")
        torch.testing.assert_close(dtensor_snapshot(model)["0.0.weight"][3], after["0.0.weight"][3])


def test_sharded_model_processed_after_a_forward_uses_processed_weights(fake_accelerator):
    """FSDP2 all-gathers from its own copy of each shard; after a forward (FSDP lazy init) a layer moved
    below an FSDP unit must be re-synced or the next forward silently uses the old weights. Real gloo,
    world 1, CPU mesh; the layers are processed on the fake accelerator."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(QuantLinear(RecordingScaleMethod(), 8, 8)) for _ in range(2)))
    expected = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8)) for _ in range(2)))
    expected.load_state_dict(model.state_dict())
    with torch.no_grad():
        for block in expected:
            block[0].weight.mul_(2.0)
    x = torch.randn(3, 8)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with torch.no_grad():
            model(x)  # FSDP lazy init
        process_weights_after_loading(model, fake_accelerator.device)
        assert model[0][0].quant_method.calls[0]["weight"] == (fake_accelerator.device, "DTensor")
        with torch.no_grad():
            torch.testing.assert_close(model(x), expected(x))
    finally:
        dist.destroy_process_group()


class ReplacingMethod(RecordingScaleMethod):
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight = nn.Parameter(layer.weight.to_local() * 2)  # drops the DTensor: FSDP would break later


def test_replacing_a_sharded_parameter_with_a_plain_one_is_named(fake_accelerator):
    from vllm_diffusion_plugin.testing.fake_mesh import fake_mesh

    with fake_mesh((1, 2)) as mesh:
        model = sharded_model_on(fake_accelerator.device, mesh)
        model[1][0].quant_method = ReplacingMethod()
        with pytest.raises(RuntimeError, match=r"ReplacingMethod.*replaced the FSDP-sharded parameter\(s\) "
                                               r"weight of layer 1\.0 with plain tensors"):
            process_weights_after_loading(model, fake_accelerator.device)


# --- seed bug B: online quant leaves a layer on meta ---------------------------------------------------------

def online_quant_model() -> nn.Module:
    """loaded: fully loaded (processed during loading); straggler: padded, still on meta; offline: an
    offline quant method on plain CPU weights."""
    torch.manual_seed(0)
    model = nn.Module()
    model.loaded = QuantLinear(TorchFp8OnlineMethod(), 16, 8)
    model.straggler = QuantLinear(TorchFp8OnlineMethod(), 16, 8, loader=padded_loader)
    model.offline = QuantLinear(RecordingScaleMethod(), 16, 4)
    return model


def load_checkpoint(model: nn.Module) -> dict[str, torch.Tensor]:
    ckpt = {"loaded.weight": torch.randn(8, 16), "straggler.weight": torch.randn(6, 16)}  # 6 of 8 rows
    for name, tensor in ckpt.items():
        param = model.get_parameter(name)
        param.weight_loader(param, tensor)
    return ckpt


def dequantized(layer: nn.Module) -> torch.Tensor:
    return (layer.weight.float() * layer.weight_scale).t()


def test_seed_b_naive_whole_module_move_breaks_on_meta_straggler(fake_accelerator):
    model = online_quant_model()
    load_checkpoint(model)
    assert model.straggler.weight.is_meta and not model.loaded.weight.is_meta
    with pytest.raises(NotImplementedError, match="meta"):
        naive_whole_module_process(model, fake_accelerator.device)


def test_seed_b_online_quant_finalized_by_vllm_then_rest_processed(fake_accelerator, mocker):
    model = online_quant_model()
    ckpt = load_checkpoint(model)
    offline_before = {n: p.detach().clone() for n, p in model.offline.named_parameters()}
    assert has_online_quant(model)
    assert getattr(model.loaded, "_already_called_process_weights_after_loading", False)  # during loading
    finalize = mocker.spy(layerwise, "finalize_layerwise_processing")

    report = process_weights_after_loading(model, fake_accelerator.device)

    finalize.assert_called_once_with(model, None)  # vLLM's real function, called by us
    assert report.online_quant is True
    assert report.processed == ("offline",) and report.skipped == ("loaded", "straggler")
    assert not any(p.is_meta for p in model.parameters())
    for name in ("loaded", "straggler"):
        layer = model.get_submodule(name)
        assert layer.weight.dtype == FP8 and not layer.weight.is_contiguous()  # fp8 .t() view
        rows = ckpt[f"{name}.weight"].shape[0]
        torch.testing.assert_close(dequantized(layer)[:rows], ckpt[f"{name}.weight"], rtol=0.07, atol=1e-2)
    assert torch.count_nonzero(dequantized(model.straggler)[6:]) == 0  # padding rows
    # the offline layer ran on the target device (a per-parameter move: online quant is in use) and its
    # parameters went back to the CPU afterwards
    assert model.offline.quant_method.calls == [{"weight": (fake_accelerator.device, "Parameter"),
                                                 "bias": (fake_accelerator.device, "Parameter")}]
    assert {p.device.type for p in model.offline.parameters()} == {"cpu"}
    torch.testing.assert_close(model.offline.weight, offline_before["weight"] * 2)
    torch.testing.assert_close(model.offline.bias, offline_before["bias"])
    assert getattr(model.offline, PROCESSED_ATTR)


class RegisteredFp8OnlineMethod:
    """``TorchFp8OnlineMethod``'s behaviour in a class that derives from nothing of vLLM: a
    ``QuantizeMethodBase`` only by ABC registration, as an out-of-tree quant method may be."""

    uses_meta_device = True
    per_channel = False
    quantized_dtype = TorchFp8OnlineMethod.quantized_dtype  # quantize_rows rounds to it
    create_weights = TorchFp8OnlineMethod.create_weights
    apply = TorchFp8OnlineMethod.apply
    row_amax = TorchFp8OnlineMethod.row_amax  # process_weights_after_loading quantizes through these two
    quantize_rows = TorchFp8OnlineMethod.quantize_rows
    process_weights_after_loading = TorchFp8OnlineMethod.process_weights_after_loading


QuantizeMethodBase.register(RegisteredFp8OnlineMethod)


def test_online_quant_is_finalized_whatever_the_quant_methods_class_hierarchy(fake_accelerator):
    # vLLM's loader decides by isinstance(quant_method, QuantizeMethodBase) and uses_meta_device, not by where
    # the classes were defined: a shortcut keyed on the MRO skipped finalize and left the straggler on meta.
    torch.manual_seed(0)
    model = nn.Module()
    model.loaded = QuantLinear(RegisteredFp8OnlineMethod(), 16, 8)
    model.straggler = QuantLinear(RegisteredFp8OnlineMethod(), 16, 8, loader=padded_loader)
    assert isinstance(model.loaded.quant_method, QuantizeMethodBase)
    ckpt = load_checkpoint(model)
    assert model.straggler.weight.is_meta

    report = process_weights_after_loading(model, fake_accelerator.device)

    assert report.online_quant is True and report.skipped == ("loaded", "straggler")
    assert not any(p.is_meta for p in model.parameters())
    assert model.straggler.weight.dtype == FP8
    torch.testing.assert_close(dequantized(model.straggler)[:6], ckpt["straggler.weight"], rtol=0.07, atol=1e-2)


class PlaceholderScaleMethod(RecordingScaleMethod):
    """Creates its scale as a ``meta`` placeholder and fills it while processing (a common quant-method
    pattern); the layer is not an online-quant layer, so vLLM's finalize never materializes it."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.weight_scale = nn.Parameter(layer.weight.detach().abs().amax(), requires_grad=False)


def test_online_quant_moves_only_real_params_of_a_layer_with_meta_placeholders(fake_accelerator):
    model = online_quant_model()
    load_checkpoint(model)
    model.offline.quant_method = PlaceholderScaleMethod()
    model.offline.weight_scale = nn.Parameter(torch.empty((), device="meta"), requires_grad=False)
    weight = model.offline.weight.detach().clone()

    report = process_weights_after_loading(model, fake_accelerator.device)  # module.to() would raise here

    assert "offline" in report.processed
    assert model.offline.quant_method.calls == [{"weight": (fake_accelerator.device, "Parameter"),
                                                 "bias": (fake_accelerator.device, "Parameter"),
                                                 "weight_scale": (torch.device("meta"), "Parameter")}]
    assert model.offline.weight.device.type == "cpu" and model.offline.bias.device.type == "cpu"  # restored
    assert model.offline.weight_scale.device == fake_accelerator.device  # created there; not ours to move
    torch.testing.assert_close(model.offline.weight_scale.cpu(), (weight * 2).abs().amax())


def test_missing_finalize_is_an_error_naming_vllm_version_only_under_online_quant(monkeypatch):
    monkeypatch.delattr(layerwise, "finalize_layerwise_processing")
    offline = nn.Module()
    offline.layer = QuantLinear(RecordingScaleMethod(), 4, 4)
    assert process_weights_after_loading(offline, "cpu").processed == ("layer",)  # no online quant: fine

    model = online_quant_model()
    load_checkpoint(model)
    with pytest.raises(compat.VllmCompatError, match=rf"vLLM {compat.vllm_version()} .*finalize_layerwise"):
        process_weights_after_loading(model, "cpu")


# --- the rest of the contract --------------------------------------------------------------------------------

def test_plain_model_moves_whole_module_to_target_and_back(fake_accelerator):
    model = nn.Module()
    model.layer = QuantLinear(RecordingScaleMethod(), 4, 3)
    model.plain = nn.Linear(4, 4)  # no quant method: untouched
    weight = model.layer.weight.detach().clone()

    report = process_weights_after_loading(model, fake_accelerator.device)

    assert report.processed == ("layer",)
    assert model.layer.quant_method.calls == [{"weight": (fake_accelerator.device, "Parameter"),
                                               "bias": (fake_accelerator.device, "Parameter")}]
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    torch.testing.assert_close(model.layer.weight, weight * 2)
    assert fake_accelerator.h2d_copies >= 2 and fake_accelerator.d2h_copies >= 2


def test_requires_device_loading_false_processes_in_place(fake_accelerator):
    method = RecordingScaleMethod()
    method.requires_device_loading = False
    model = nn.Module()
    model.layer = QuantLinear(method, 4, 3)
    process_weights_after_loading(model, fake_accelerator.device)
    assert method.calls == [{"weight": (torch.device("cpu"), "Parameter"),
                             "bias": (torch.device("cpu"), "Parameter")}]
    assert fake_accelerator.h2d_copies == 0


def test_vllm_attention_like_layers_need_model_config():
    from vllm.model_executor.layers.attention import Attention

    class FakeAttention(Attention):  # only the isinstance check and the post-load hook matter here
        def __init__(self):
            nn.Module.__init__(self)
            self.dtypes = []

        def process_weights_after_loading(self, act_dtype):
            self.dtypes.append(act_dtype)

    model = nn.Module()
    model.attn = FakeAttention()
    with pytest.raises(ValueError, match="model_config is required.*attn"):
        process_weights_after_loading(model, "cpu")

    class Config:
        dtype = torch.bfloat16

    report = process_weights_after_loading(model, "cpu", Config())
    assert report.attention_layers == ("attn",) and model.attn.dtypes == [torch.bfloat16]
    process_weights_after_loading(model, "cpu", Config())
    assert model.attn.dtypes == [torch.bfloat16]  # not processed twice


def test_vllm_034_attention_hook_without_act_dtype_runs():
    """vLLM 0.34 dropped ``act_dtype`` from the attention hook: passing ``model_config.dtype`` is a TypeError."""
    from vllm.model_executor.layers.attention import Attention

    class NoArgAttention(Attention):
        def __init__(self):
            nn.Module.__init__(self)
            self.calls = 0

        def process_weights_after_loading(self):
            self.calls += 1

    class Config:
        dtype = torch.bfloat16

    model = nn.Module()
    model.attn = NoArgAttention()
    report = process_weights_after_loading(model, "cpu", Config())
    assert report.attention_layers == ("attn",) and model.attn.calls == 1
    model.other = NoArgAttention()
    process_weights_after_loading(model, "cpu")  # no act_dtype needed: no model_config needed
    assert model.other.calls == 1 and model.attn.calls == 1


def test_unknown_attention_hook_form_names_the_vllm_version():
    from vllm.model_executor.layers.attention import Attention

    class TwoArgAttention(Attention):
        def __init__(self):
            nn.Module.__init__(self)

        def process_weights_after_loading(self, act_dtype, something):
            raise AssertionError("must not be called")

    model = nn.Module()
    model.attn = TwoArgAttention()
    with pytest.raises(compat.VllmCompatError, match=rf"vLLM {compat.vllm_version()}: .* layer attn takes "
                                                     r"\(act_dtype, something\)"):
        process_weights_after_loading(model, "cpu", object())


def hooked_model(log: list[str]) -> nn.Module:
    """Modules with their own post-load hooks at every depth: an attention layer, plain modules, a module
    shared by two parents, a quantized layer with a hooked child (its quant method owns that child)."""
    from vllm.model_executor.layers.attention import Attention

    class Hooked(nn.Module):
        def __init__(self, tag: str):
            super().__init__()
            self.tag = tag
            self.weight = nn.Parameter(torch.ones(2))

        def process_weights_after_loading(self):
            log.append(self.tag)

    class Attn(Attention):
        def __init__(self):
            nn.Module.__init__(self)

        def process_weights_after_loading(self, *act_dtype):  # either vLLM form
            log.append("attn")

    model = Hooked("root")
    model.block = Hooked("block")
    model.block.inner = Hooked("inner")
    model.block.attn = Attn()
    model.other = nn.Module()
    model.other.shared = model.block.inner
    model.other.leaf = Hooked("leaf")
    model.quant = QuantLinear(RecordingScaleMethod(), 4, 3)
    model.quant.child = Hooked("quant-child")
    return model


def test_module_hooks_run_as_vllms_own_post_load_processing():
    """The same hooks, in the same order, as vLLM's own ``process_weights_after_loading`` of the installed
    vLLM: the attention layers then the model (0.30-0.33); every module, children first (0.34)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading as vllm_process

    class Config:
        dtype = torch.float32
        quantization = None
        word_embeddings_untied_by_checkpoint = False
        model = "hooked"

    theirs: list[str] = []
    vllm_process(hooked_model(theirs), Config(), torch.device("cpu"))
    ours: list[str] = []
    model = hooked_model(ours)
    report = process_weights_after_loading(model, "cpu", Config())
    assert ours == theirs
    assert ("inner" in theirs) == compat.post_load_hooks_on_every_module()
    assert report.hooks[-1] == "<root>" and report.attention_layers == ("block.attn",)
    process_weights_after_loading(model, "cpu", Config())
    assert ours == theirs  # each hook once


def test_direct_reload_mode_records_the_checkpoint_layout_as_vllm_does(monkeypatch):
    """vLLM 0.34, ``VLLM_RELOAD_MODE=direct``: post-load processing records each tensor's checkpoint layout,
    without which vLLM's direct reload refuses ("no checkpoint layout was recorded")."""
    direct = pytest.importorskip("vllm.model_executor.model_loader.reload.direct",
                                 reason="this vLLM has no direct in-place reload (added in 0.34)")
    monkeypatch.setenv("VLLM_RELOAD_MODE", "direct")
    assert direct.direct_reload_enabled()
    model = nn.Module()
    model.layer = QuantLinear(RecordingScaleMethod(), 4, 3)
    process_weights_after_loading(model, "cpu")
    assert hasattr(model, "_ckpt_param_names") and hasattr(model.layer.weight, "_ckpt")
    direct.begin_direct_reload(model)  # vLLM's own check that the record is there and usable


def test_meta_parameter_without_online_quant_is_named():
    model = nn.Module()
    model.layer = QuantLinear(RecordingScaleMethod(), 4, 3)
    model.layer.to("meta")
    with pytest.raises(ValueError, match="layer: parameter (weight|bias) is on the meta device"):
        process_weights_after_loading(model, "cpu")
