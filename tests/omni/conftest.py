"""Fixtures for the vllm-omni patch tests. They run against the real vllm-omni 0.30.0 and vLLM 0.30.0 in the
``[omni]`` environment (``pip install -e ".[omni,test]"``, CI stage 2 of ``.ci/run``), with nothing of either
package stubbed or bridged, and are skipped where vllm-omni is not installed (the main environment, vLLM 0.34:
vllm-omni 0.30 imports only with vLLM 0.30).

``OMNI_TESTS_REQUIRED=1`` (set by ``.ci/run``'s omni stage) turns "vllm-omni cannot be imported" from a skip
into an error, so the omni stage can never pass by skipping everything.
"""

from __future__ import annotations

import importlib
import types

import pytest
from omni_support import import_omni


@pytest.fixture(scope="session")
def omni() -> types.SimpleNamespace:
    """Our patches applied (through the real post-import hook) and vllm-omni's patched modules."""
    from vllm_diffusion_plugin.doors.omni import apply_patches, patch_status

    vllm_omni = import_omni()
    apply_patches()
    loader_mod = importlib.import_module("vllm_omni.diffusion.model_loader.diffusers_loader")
    lora_mod = importlib.import_module("vllm_omni.diffusion.lora.loader")
    importlib.import_module("vllm_omni.config.omni_config")
    status = patch_status()
    units = ("load-format", "postprocess", "lora-device", "load-path", "serve-flag")
    assert {name: status.get(name) for name in units} == dict.fromkeys(units, "applied"), status
    return types.SimpleNamespace(version=vllm_omni.__version__, loader_mod=loader_mod, lora_mod=lora_mod,
                                 Loader=loader_mod.DiffusersPipelineLoader)
