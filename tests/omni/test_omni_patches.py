"""The vllm-omni patches against the real vllm-omni (0.30.0 with vLLM 0.30.0, the [omni] extra): the import hook, shape checks,
idempotence and rebinding, the load format, HSDP sizes, and one end-to-end load through vllm-omni's own
``load_model``. Where a patch changes behaviour, vllm-omni's own code (``__wrapped__``) is run next to it.
(Post-load processing and the LoRA device rule: test_omni_seed_bugs.py.)

Fake-accelerator limit met here: FSDP2 moves CPU parameters to the mesh device with ``param.data = ...``,
which the pure-Python ``fakeacc`` backend refuses (real CUDA/NPU accept it), so the end-to-end test moves the
DiT to the device right before vllm-omni's own ``apply_hsdp_to_model`` runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from omni_support import RecordedLinear, captured_logs, import_omni, omni_loader
from torch import nn

from vllm_diffusion_plugin.doors.omni import _patching, patch_load_format, patch_lora_device, patch_postprocess
from vllm_diffusion_plugin.engine.postprocess import PROCESSED_ATTR
from vllm_diffusion_plugin.testing.fake_mesh import fake_mesh
from vllm_diffusion_plugin.tiny.models import TINY_CONFIGS, build_tiny_model, write_tiny_lora

import_omni()  # skips this module where vllm-omni is not installed

FP8 = torch.float8_e4m3fn


# --- the hook: lazy, idempotent, rebinding, silent without vllm-omni ----------------------------------------
def test_patches_wait_for_vllm_omni_imports_and_nothing_without_it():
    script = textwrap.dedent("""
        import importlib.util, sys
        import vllm.v1.outputs  # vLLM first, as in a server; not vllm_omni
        from vllm_diffusion_plugin.doors.omni import _patching, apply_patches, patch_status
        real_find_spec = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "vllm_omni" else real_find_spec(name, *a)
        apply_patches()  # vllm-omni "absent"
        assert patch_status() == {} and _patching._finder is None, patch_status()
        assert not [m for m in sys.modules if m.startswith("vllm_omni")]
        importlib.util.find_spec = real_find_spec
        apply_patches()
        assert set(patch_status().values()) == {"pending (vllm_omni.diffusion.model_loader.diffusers_loader not "
            "imported yet)", "pending (vllm_omni.diffusion.lora.loader not imported yet)",
            "pending (vllm_omni.config.omni_config not imported yet)",
            "pending (vllm_omni.config.config_factory not imported yet)",
            "pending (vllm_omni.diffusion.executor.multiproc_executor not imported yet)",
            "pending (vllm_omni.diffusion.worker.diffusion_worker not imported yet)",
            "pending (vllm_omni.entrypoints.openai.api_server not imported yet)"}, patch_status()
        assert not [m for m in sys.modules if m.startswith("vllm_omni")], "apply_patches imported vllm-omni"
        from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader as L
        from vllm_omni.diffusion.lora import loader
        from vllm_omni.config import config_factory, omni_config
        from vllm_omni.diffusion.executor import multiproc_executor
        from vllm_omni.diffusion.worker import diffusion_worker
        status = patch_status()
        assert status.pop("lora-routes") == "pending (vllm_omni.entrypoints.openai.api_server not imported yet)"
        assert set(status.values()) == {"applied"}, status
        assert diffusion_worker.DiffusionWorker.diffusion_hsdp_loras
        before = (L._prepare_weights, L.__init__, L.load_weights, L._process_weights_after_loading,
                  loader._resolve_lora_compute_device, loader._prepare_lora_delta,
                  omni_config.extract_diffusion_stage_config_kwargs,
                  config_factory.StageConfigFactory._normalize_default_diffusion)
        apply_patches()
        after = (L._prepare_weights, L.__init__, L.load_weights, L._process_weights_after_loading,
                 loader._resolve_lora_compute_device, loader._prepare_lora_delta,
                 omni_config.extract_diffusion_stage_config_kwargs,
                 config_factory.StageConfigFactory._normalize_default_diffusion)
        assert before == after and not any(_patching.is_patched(f.__wrapped__) for f in after)
        print("HOOK-OK")
    """)
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).parent)
    assert "HOOK-OK" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]


def fresh_copy(name: str, monkeypatch) -> types.ModuleType:
    """A second, unpatched instance of the real vllm-omni module ``name``, installed under its name."""
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_lora_unit_rebinds_every_importer_and_is_idempotent(omni, monkeypatch):
    fresh = fresh_copy(patch_lora_device.TARGET, monkeypatch)
    importer = types.ModuleType("vllm_omni._test_importer")  # as after `from ...lora.loader import name`
    importer._resolve_lora_compute_device = original_resolver = fresh._resolve_lora_compute_device
    importer._prepare_lora_delta = original_prepare = fresh._prepare_lora_delta
    monkeypatch.setitem(sys.modules, importer.__name__, importer)

    assert patch_lora_device.apply(fresh) == "applied"
    for module in (fresh, importer):
        assert module._resolve_lora_compute_device.__wrapped__ is original_resolver
        assert module._prepare_lora_delta.__wrapped__ is original_prepare
    patched = (fresh._resolve_lora_compute_device, fresh._prepare_lora_delta)
    assert patch_lora_device.apply(fresh) == "already applied"
    assert (importer._resolve_lora_compute_device, importer._prepare_lora_delta) == patched


def test_loader_units_patch_the_class_once(omni, monkeypatch):
    fresh = fresh_copy(patch_load_format.TARGET, monkeypatch)
    cls = fresh.DiffusersPipelineLoader
    originals = (cls._prepare_weights, cls.load_model, cls._process_weights_after_loading)
    assert patch_load_format.apply(fresh) == "applied" and patch_postprocess.apply(fresh) == "applied"
    patched = (cls._prepare_weights, cls.load_model, cls._process_weights_after_loading)
    assert tuple(f.__wrapped__ for f in patched) == originals
    assert patch_load_format.apply(fresh) == patch_postprocess.apply(fresh) == "already applied"
    assert (cls._prepare_weights, cls.load_model, cls._process_weights_after_loading) == patched


def shaped_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    vars(module).update(attrs)
    return module


def test_unrecognized_vllm_omni_shapes_warn_once_naming_the_version_and_are_skipped(omni, monkeypatch):
    monkeypatch.setattr(_patching, "_status", dict(_patching._status))  # keep the session's record
    def prepare_028(lora_state_dict, base_key, param_to_weight_names=None, is_bias=False):  # 0.28: no device
        raise AssertionError("not called")

    class Loader022:  # 0.22: load_model(self, od_config, ...)
        def __init__(self, load_config, od_config=None): ...
        def _prepare_weights(self, model_name_or_path, subfolder, revision, fall_back_to_pt,
                             allow_patterns_overrides): ...
        def load_model(self, od_config, load_device, load_format="default"): ...
        def _load_model_with_hsdp(self): ...

    lora_028 = shaped_module(patch_lora_device.TARGET, _prepare_lora_delta=prepare_028)
    loader_022 = shaped_module(patch_load_format.TARGET, DiffusersPipelineLoader=Loader022)
    crashing = types.SimpleNamespace(NAME="crashing", apply=lambda module: 1 / 0)
    with captured_logs("vllm_diffusion_plugin.doors.omni._patching") as logs:
        assert _patching.run_unit(patch_lora_device, lora_028).startswith("skipped: ")
        assert _patching.run_unit(patch_load_format, loader_022).startswith("skipped: ")
        assert _patching.run_unit(crashing, lora_028) == "failed: ZeroDivisionError: division by zero"
    warnings = logs.messages()
    assert len(warnings) == 3 and all(f"vllm-omni {omni.version}" in w for w in warnings), warnings
    assert "_resolve_lora_compute_device" in warnings[0]
    assert "load_model" in warnings[1] and "(self, od_config" in warnings[1]
    assert lora_028._prepare_lora_delta is prepare_028
    assert not any(_patching.is_patched(f) for f in vars(Loader022).values())  # nothing half-applied


# --- load format --------------------------------------------------------------------------------------------
def test_prepare_weights_unpatched_raises_patched_accepts_diffusion_hsdp(omni, tiny_wan_dir):
    loader = omni_loader("diffusion-hsdp", {"hsdp_shard_size": 1})
    args = (str(tiny_wan_dir), "transformer", None, True, None)

    with pytest.raises(ValueError, match="Unknown load_format: diffusion-hsdp"):
        omni.Loader._prepare_weights.__wrapped__(loader, *args)  # vllm-omni's own code
    folder, files, use_safetensors = loader._prepare_weights(*args)

    assert use_safetensors and loader.load_config.load_format == "diffusion-hsdp"  # the swap was undone
    shards = sorted(p.name for p in (tiny_wan_dir / "transformer").glob("*.safetensors"))
    assert len(shards) >= 3 and sorted(f.rsplit("/", 1)[1] for f in files) == shards
    assert (folder, files, use_safetensors) == omni_loader("hf")._prepare_weights(*args)


def test_pickled_weights_need_allow_pickle(omni, tiny_checkpoint_factory):
    ckpt = tiny_checkpoint_factory("wan", safe_serialization=False)
    args = (str(ckpt), "transformer", None, True, None)
    with pytest.raises(ValueError, match='no safetensors weights.*"allow_pickle": true'):
        omni_loader("diffusion-hsdp")._prepare_weights(*args)
    _, files, use_safetensors = omni_loader("diffusion-hsdp", {"allow_pickle": True})._prepare_weights(*args)
    assert not use_safetensors and files and all(f.endswith(".bin") for f in files)


def test_extra_config_keys_are_checked_before_any_file_is_read(omni, tiny_wan_dir):
    args = (str(tiny_wan_dir), "transformer", None, True, None)
    with pytest.raises(ValueError, match="Unknown key.*'hsdp_shards'.*known keys: allow_pickle"):
        omni_loader("diffusion-hsdp", {"hsdp_shards": 2})._prepare_weights(*args)
    with pytest.raises(ValueError, match="'hsdp_block_pattern'.*no effect under vllm-omni.*_hsdp_shard_conditions"):
        omni_loader("diffusion-hsdp", {"hsdp_block_pattern": "blocks"})._prepare_weights(*args)


def test_other_load_formats_reach_vllm_omni_untouched(omni, tiny_wan_dir):
    args = (str(tiny_wan_dir), "transformer", None, True, None)
    auto = omni_loader("auto", {"anything": 1})  # our extra-config rules do not apply to other formats
    assert auto._prepare_weights(*args) == omni.Loader._prepare_weights.__wrapped__(auto, *args)
    with pytest.raises(ValueError, match="Unknown load_format: bogus"):
        omni_loader("bogus")._prepare_weights(*args)


# --- HSDP sizes ---------------------------------------------------------------------------------------------
def test_hsdp_sizes_from_extra_config_or_from_vllm_omni(omni):
    from vllm_omni.diffusion.data import DiffusionParallelConfig

    from vllm_diffusion_plugin.engine.config import LoadOptions

    plain = DiffusionParallelConfig()
    enabled = patch_load_format.hsdp_parallel_config(
        plain, LoadOptions.from_extra_config({"hsdp_replicate_size": 2}), world_size=4)
    assert (enabled.use_hsdp, enabled.hsdp_replicate_size, enabled.hsdp_shard_size) == (True, 2, 2)
    assert not plain.use_hsdp  # vllm-omni's shared config is not changed
    with pytest.raises(ValueError, match="replicate_size 1 x shard_size 3 = 3 does not equal the world size 4"
                                         ".*vllm-omni started 4 rank"):
        patch_load_format.hsdp_parallel_config(plain, LoadOptions.from_extra_config({"hsdp_shard_size": 3}),
                                               world_size=4)
    own = DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=4)
    assert patch_load_format.hsdp_parallel_config(own, LoadOptions(), world_size=4) is own
    with pytest.raises(ValueError, match="HSDP sizes disagree: vllm-omni's --use-hsdp options give .* 1 x 4"):
        patch_load_format.hsdp_parallel_config(own, LoadOptions.from_extra_config({"hsdp_replicate_size": 2}),
                                               world_size=4)


def tiny_wan_pipeline_class():
    from vllm_omni.diffusion.lora.loader import WanLoraLoaderMixin
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    class TinyWanPipeline(nn.Module, WanLoraLoaderMixin):
        """A vllm-omni custom pipeline: a diffusers Wan DiT read from ``<model>/transformer`` by vllm-omni's
        loader, sharded by ``blocks.N``, plus one quantized layer outside the checkpoint."""

        has_transformer_2 = False

        def __init__(self, *, od_config) -> None:
            super().__init__()
            import diffusers

            self.transformer = diffusers.WanTransformer3DModel(**TINY_CONFIGS["wan"])
            self.transformer._hsdp_shard_conditions = [lambda name, _: re.fullmatch(r"blocks\.\d+", name)]
            self.quantized = RecordedLinear(8, 4)
            self.weights_sources = [DiffusersPipelineLoader.ComponentSource(
                model_or_path=od_config.model, subfolder="transformer", revision=None, prefix="transformer.")]

        def load_weights(self, weights):
            params, loaded = dict(self.named_parameters()), set()
            for name, tensor in weights:
                params[name].data.copy_(tensor)
                loaded.add(name)
            return loaded

    return TinyWanPipeline


def test_load_model_diffusion_hsdp_end_to_end_on_fake_mesh(omni, tiny_wan_dir, tmp_path, fake_accelerator,
                                                           monkeypatch):
    """vllm-omni's own load_model with --load-format diffusion-hsdp: HSDP sizes from our extra-config, the DiT read
    through our path with vllm-omni's distilled LoRA fused by our rule (deltas on the accelerator for CPU
    weights), our post-processing, then vllm-omni's apply_hsdp_to_model on a one-process (1, 2) fake mesh."""
    import vllm_omni.diffusion.distributed.hsdp as omni_hsdp

    base = build_tiny_model("wan", seed=0)  # the weights of tiny_wan_dir/transformer
    lora = write_tiny_lora(tmp_path / "distill.safetensors", base, alpha=None, targets=("to_q", "to_k", "to_v"))
    loader = omni_loader("diffusion-hsdp", {"hsdp_shard_size": 2}, model=str(tiny_wan_dir),
                         lora_backend="distill", lora_path=str(lora))
    seen = {}

    def apply_hsdp_to_model(model, hsdp_config, target_device=None):  # vllm-omni's, after a look and a move
        seen.update(config=hsdp_config, h2d=fake_accelerator.h2d_copies,
                    mm=fake_accelerator.op_counts["aten::addmm_"] + fake_accelerator.op_counts["aten::addmm"],
                    devices={p.device.type for p in model.parameters()},
                    state={k: v.detach().clone() for k, v in model.state_dict().items()})
        model.to(target_device)  # see the module docstring (fakeacc refuses FSDP2's own .data move)
        return real_apply(model, hsdp_config, target_device=target_device)

    real_apply = omni.loader_mod.apply_hsdp_to_model
    monkeypatch.setattr(omni.loader_mod, "apply_hsdp_to_model", apply_hsdp_to_model)
    with fake_mesh((1, 2)) as mesh:
        monkeypatch.setattr(omni_hsdp, "_create_hsdp_mesh", lambda device_type, replicate_size, shard_size: mesh)
        monkeypatch.setattr(omni_hsdp, "get_world_group", lambda: types.SimpleNamespace(world_size=2, rank_in_group=0))
        model = loader.load_model(load_device=str(fake_accelerator.device), load_format="custom_pipeline",
                                  custom_pipeline_name=tiny_wan_pipeline_class(), device=fake_accelerator.device)

        assert (seen["config"].hsdp_replicate_size, seen["config"].hsdp_shard_size) == (1, 2)
        assert seen["devices"] == {"cpu"}  # fused and processed while still on the CPU, as vllm-omni does
        assert seen["mm"] == 2 * 2 * 3 and seen["h2d"] > 0  # 2 blocks x 2 attentions x q/k/v on the accelerator
        lora_sd = omni.lora_mod._load_lora_state_dict(str(lora))
        for name, weight in base.state_dict().items():
            expected = weight.double()
            key = f"transformer.{name.removesuffix('.weight')}.lora_A.weight"
            if name.endswith(".weight") and key in lora_sd:
                expected = expected + lora_sd[key.replace("lora_A", "lora_B")].double() @ lora_sd[key].double()
            torch.testing.assert_close(seen["state"][name].double(), expected, rtol=1e-6, atol=1e-6)
        assert model.quantized.quant_method.calls == [{"weight": ("fakeacc:0", "Parameter"),
                                                       "bias": ("fakeacc:0", "Parameter")}]
        assert getattr(model.quantized, PROCESSED_ATTR)  # our post-processing ran (vllm-omni's sets no marker)
        from torch.distributed.tensor import DTensor, Replicate, Shard

        block_weight = model.transformer.blocks[0].attn1.to_q.weight
        assert isinstance(block_weight, DTensor) and block_weight.device == fake_accelerator.device
        assert block_weight.placements == (Replicate(), Shard(0))
        assert not loader.od_config.parallel_config.use_hsdp and loader.parallel_config.use_hsdp
