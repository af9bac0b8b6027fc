"""Post-load processing (seed bugs A and B) and the LoRA compute device, through vllm-omni's real loader code
with our patches, next to vllm-omni's own code (``__wrapped__``), which fails where ours must not."""

from __future__ import annotations

import pytest
import torch
from omni_support import RecordedLinear, captured_logs, import_omni, omni_loader
from safetensors.torch import load_file
from torch import nn
from vllm.model_executor.model_loader.reload import layerwise

from vllm_diffusion_plugin.engine.postprocess import PROCESSED_ATTR
from vllm_diffusion_plugin.testing.fake_mesh import fake_mesh
from vllm_diffusion_plugin.testing.online_quant import FP8, TorchFp8OnlineMethod
from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora

import_omni()  # skips this module where vllm-omni is not installed


# --- post-load processing: the seed bugs ---------------------------------------------------------------------
def padded_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Fills fewer rows than the parameter has: the layer never completes and stays on ``meta``."""
    param.data[: loaded.shape[0]].copy_(loaded)
    param.data[loaded.shape[0]:].zero_()


def straggler_layer() -> nn.Module:
    layer = nn.Module()
    layer.quant_method = TorchFp8OnlineMethod()
    layer.quant_method.create_weights(layer, 16, 8, padded_loader)
    layer.weight.weight_loader(layer.weight, torch.randn(6, 16))  # 6 of 8 rows: left on meta
    assert layer.weight.is_meta
    return layer


def sharded_blocks(device: torch.device, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = nn.Sequential(*(nn.Sequential(RecordedLinear(8, 6)) for _ in range(2))).to(device)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    return blocks


@pytest.mark.parametrize("case", ["dtensor", "meta-straggler", "both"])
def test_postprocess_seed_bugs_patched_runs_vllm_omni_own_raises_on_both(omni, fake_accelerator, case):
    from torch.distributed.tensor import DTensor

    loader = omni_loader("auto")
    with fake_mesh((1, 2)) as mesh:
        def build() -> nn.Module:
            model = nn.Module()
            if case != "meta-straggler":
                model.blocks = sharded_blocks(fake_accelerator.device, mesh)
            if case != "dtensor":
                model.straggler = straggler_layer()
            return model

        if case == "both":  # vllm-omni 0.30: finalize, then `param.data = ...` on DTensors (seed bug A)
            with pytest.raises(RuntimeError):
                omni.Loader._process_weights_after_loading.__wrapped__(loader, build(), torch.device("cpu"))
        model = build()
        loader._process_weights_after_loading(model, torch.device("cpu"))

        if case != "meta-straggler":
            # without online quant the layer moves whole (FSDP keeps its DTensors); with it, DTensors stay put
            where = "cpu" if case == "dtensor" else "fakeacc:0"
            for block in model.blocks:
                assert block[0].quant_method.calls == [{"weight": (where, "DTensor"), "bias": (where, "DTensor")}]
                assert all(isinstance(p, DTensor) and p.device == fake_accelerator.device
                           for p in block.parameters())
                assert getattr(block[0], PROCESSED_ATTR)
        if case != "dtensor":  # finalized by vLLM's finalize_layerwise_processing, called by us
            assert model.straggler.weight.dtype == FP8 and not model.straggler.weight.is_meta
        assert not any(p.is_meta for p in model.parameters())


# --- LoRA compute device ---------------------------------------------------------------------------------------
def lora_case(tmp_path):
    module = build_tiny_model("wan", seed=3)
    path = write_tiny_lora(tmp_path / "l.safetensors", module, alpha=None, targets=("to_q", "to_k", "to_v"))
    state_dict = load_file(str(path))
    expected = {}
    for name, weight in module.state_dict().items():
        key = f"transformer.{name.removesuffix('.weight')}.lora_A.weight"
        delta = state_dict[key.replace("lora_A", "lora_B")].double() @ state_dict[key].double() \
            if name.endswith(".weight") and key in state_dict else 0
        expected[name] = weight.double() + delta
    return module, state_dict, expected


def assert_fused(module: nn.Module, expected: dict) -> None:
    for name, tensor in module.state_dict().items():
        torch.testing.assert_close(tensor.double(), expected[name], rtol=1e-6, atol=1e-6, msg=name)


def test_lora_cpu_weights_use_the_accelerator_only_when_patched(omni, fake_accelerator, tmp_path, monkeypatch):
    mixin = omni.lora_mod.LoraLoaderMixin
    module, state_dict, expected = lora_case(tmp_path)
    with monkeypatch.context() as unpatched:  # vllm-omni's own resolver: its platform names only "cpu" here
        unpatched.setattr(omni.lora_mod, "_resolve_lora_compute_device",
                          omni.lora_mod._resolve_lora_compute_device.__wrapped__)
        mixin.load_lora_into_module(state_dict, module, prefix="transformer")
    assert fake_accelerator.op_counts["aten::mm"] == 0 and fake_accelerator.h2d_copies == 0
    assert_fused(module, expected)

    module, state_dict, expected = lora_case(tmp_path)
    keys = mixin.load_lora_into_module(state_dict, module, prefix="transformer")
    assert keys == set(state_dict)
    assert fake_accelerator.op_counts["aten::mm"] == 12 and fake_accelerator.h2d_copies >= 24  # A, B per target
    assert {p.device.type for p in module.parameters()} == {"cpu"}
    assert_fused(module, expected)

    fake_accelerator.reset_counters()
    mixin.unload_module_lora(state_dict, module, prefix="transformer")  # the same rule on unload
    assert fake_accelerator.op_counts["aten::mm"] == 12
    assert_fused(module, {n: t.double() for n, t in build_tiny_model("wan", seed=3).state_dict().items()})


def test_lora_failed_probe_stays_on_cpu(omni, fake_accelerator, tmp_path):
    module, state_dict, expected = lora_case(tmp_path)
    with fake_accelerator.fail_probe(), captured_logs("vllm_diffusion_plugin.doors.omni.patch_lora_device") as logs:
        omni.lora_mod.LoraLoaderMixin.load_lora_into_module(state_dict, module, prefix="transformer")
    assert fake_accelerator.h2d_copies == 0 and fake_accelerator.op_counts["aten::mm"] == 0
    assert logs.messages() == []  # the device was never tried (not tried, failed and caught)
    assert_fused(module, expected)


def test_lora_h2d_failure_falls_back_to_cpu_vllm_omni_own_raises(omni, fake_accelerator, tmp_path, monkeypatch):
    mixin = omni.lora_mod.LoraLoaderMixin
    module, state_dict, _ = lora_case(tmp_path)
    with monkeypatch.context() as unpatched, fake_accelerator.fail_h2d_after(0):
        unpatched.setattr(omni.lora_mod, "_prepare_lora_delta", omni.lora_mod._prepare_lora_delta.__wrapped__)
        with pytest.raises(torch.OutOfMemoryError):
            mixin.load_lora_into_module(state_dict, module, prefix="transformer")

    module, state_dict, expected = lora_case(tmp_path)
    with fake_accelerator.fail_h2d_after(0), captured_logs("vllm_diffusion_plugin.doors.omni.patch_lora_device") as logs:
        mixin.load_lora_into_module(state_dict, module, prefix="transformer")
    assert_fused(module, expected)
    warnings = logs.messages()
    assert len(warnings) == 1 and "computing it on the CPU" in warnings[0] and "OutOfMemoryError" in warnings[0]


def test_finalize_runs_for_an_online_method_that_is_vllm_s_only_by_isinstance(omni, monkeypatch):
    """vllm-omni's own ``test_process_weights_skips_completed_online_quant_layer`` (found by the regression gate,
    ``doors/omni/regression.py``): a quant method that is a ``QuantizeMethodBase`` by ``isinstance`` but has no
    vLLM class in its MRO (here a registered virtual subclass) still gets vLLM's finalize, as in vllm-omni's own
    code; the layer it already processed during loading is not processed again."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    class RegisteredOnlineMethod:  # registered with the ABC, not derived from it
        uses_meta_device = True

        def __init__(self):
            self.processed = 0

        def process_weights_after_loading(self, layer):
            self.processed += 1

    QuantizeMethodBase.register(RegisteredOnlineMethod)
    real_finalize, calls = layerwise.finalize_layerwise_processing, []

    def recording_finalize(model, model_config):
        calls.append((model, model_config))
        return real_finalize(model, model_config)

    monkeypatch.setattr(layerwise, "finalize_layerwise_processing", recording_finalize)
    loader = omni_loader("auto")
    for process in (omni.Loader._process_weights_after_loading.__wrapped__, type(loader)._process_weights_after_loading):
        model = nn.Module()
        model.layer = nn.Linear(2, 2, bias=False)
        model.layer.quant_method = RegisteredOnlineMethod()
        model.layer._already_called_process_weights_after_loading = True
        calls.clear()
        process(loader, model, torch.device("cpu"))
        assert [m for m, _ in calls] == [model], process
        assert model.layer.quant_method.processed == 0
    assert calls[0][1].dtype == loader.od_config.dtype  # ours: a model-config view (vllm-omni's own: None)
