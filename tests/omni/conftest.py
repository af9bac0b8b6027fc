"""Fixtures for the vllm-omni patch tests. They run against the real vllm-omni 0.30.0 and vLLM 0.30.0 in the
``[omni]`` environment (``pip install -e ".[omni,test]"``, CI stage 2 of ``.ci/run``), with nothing of either
package stubbed or bridged, and are skipped where vllm-omni is not installed (the main environment, vLLM 0.34:
vllm-omni 0.30 imports only with vLLM 0.30).

``OMNI_TESTS_REQUIRED=1`` (set by ``.ci/run``'s omni stage) turns "vllm-omni cannot be imported" from a skip
into an error, so the omni stage can never pass by skipping everything.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import types
from contextlib import contextmanager

import pytest
from omni_support import import_omni

from vllm_diffusion_plugin.doors.omni import _patching
from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora, write_tiny_pipeline


@pytest.fixture(scope="session")
def omni() -> types.SimpleNamespace:
    """Our patches applied (through the real post-import hook) and vllm-omni's patched modules."""
    from vllm_diffusion_plugin.doors.omni import apply_patches, patch_status

    vllm_omni = import_omni()
    apply_patches()
    loader_mod = importlib.import_module("vllm_omni.diffusion.model_loader.diffusers_loader")
    lora_mod = importlib.import_module("vllm_omni.diffusion.lora.loader")
    importlib.import_module("vllm_omni.config.omni_config")
    importlib.import_module("vllm_omni.config.config_factory")
    importlib.import_module("vllm_omni.diffusion.executor.multiproc_executor")
    status = patch_status()
    units = ("load-format", "postprocess", "lora-device", "load-path", "serve-flag", "default-stage", "worker-death")
    assert {name: status.get(name) for name in units} == dict.fromkeys(units, "applied"), status
    return types.SimpleNamespace(version=vllm_omni.__version__, loader_mod=loader_mod, lora_mod=lora_mod,
                                 Loader=loader_mod.DiffusersPipelineLoader)


@contextmanager
def cpu_platform():
    """vllm-omni's CPU platform (ours, ``VLLM_DIFFUSION_OMNI_CPU=1``) in this process: vllm-omni resolves its
    platform once and modules hold it as a global, so the instance is swapped in every ``vllm_omni`` module."""
    import vllm_omni.platforms as omni_platforms

    old = omni_platforms.current_omni_platform
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_DIFFUSION_OMNI_CPU", "1")
        omni_platforms._current_omni_platform = None
        new = omni_platforms.current_omni_platform
        assert type(new).__name__ == "CpuOmniPlatform", type(new)
        _patching.rebind(old, new)
        try:
            yield new
        finally:
            _patching.rebind(new, old)
            omni_platforms._current_omni_platform = old


@pytest.fixture(scope="module")
def omni_world(omni):
    """vllm-omni's parallel state for one in-process gloo rank on the CPU platform (what a DiffusionWorker sets
    up before it loads)."""
    import torch.distributed as dist
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm_omni.diffusion.distributed import parallel_state

    config = VllmConfig()
    # a fresh file store, not a TCP port picked free and bound later (another process can take it in between)
    method = "file://" + os.path.join(tempfile.mkdtemp(prefix="omni-world-"), "store")
    with cpu_platform(), set_current_vllm_config(config):
        dist.init_process_group("gloo", init_method=method, world_size=1, rank=0)
        parallel_state.init_distributed_environment(world_size=1, rank=0, distributed_init_method=method,
                                                    local_rank=0, backend="gloo")
        parallel_state.initialize_model_parallel(backend="gloo")
        try:
            yield config
        finally:
            parallel_state.destroy_distributed_env()
            if dist.is_initialized():
                dist.destroy_process_group()


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    """A runnable tiny Wan2.2 folder (two DiTs, >= 3 shards each) and one diffusers LoRA per DiT."""
    root = write_tiny_pipeline(tmp_path_factory.mktemp("wan22"), "wan", runnable=True)
    high = write_tiny_lora(root.parent / "high.safetensors", build_tiny_model("wan", seed=0), seed=1)
    low = write_tiny_lora(root.parent / "low.safetensors", build_tiny_model("wan", seed=1), seed=2)
    return types.SimpleNamespace(root=root, high=high, low=low)
