"""Fixtures for the vllm-omni patch tests, which run against the real vllm-omni in the separate environment
built by ``.ci/omni-env.sh`` and are skipped where vllm-omni is not installed (the main environment).

``OMNI_TESTS_REQUIRED=1`` (set by ``.ci/omni-env.sh``) turns "vllm-omni cannot be imported" from a skip into
an error, so the omni stage can never pass by skipping everything.

vLLM 0.33 bridge (test environment only). vllm-omni 0.30.0's package ``__init__`` reaches
``vllm.v1.outputs.RoutedExpertsLists`` through its autoregressive scheduler
(``vllm_omni.config`` -> ``core.sched.omni_ar_scheduler`` -> ``core.sched.utils``); vLLM 0.33 no longer has that
name, so ``import vllm_omni`` fails next to the vLLM this plugin targets. Nothing on the diffusion loading path
uses it (importing the loader modules with the package ``__init__`` bypassed works without it). The bridge
defines the missing name as an empty class before vllm-omni is imported, so the real package ``__init__``
(including vllm-omni's own patches to vLLM) runs unchanged. It is the only name missing (checked by importing
with bridges added one at a time).
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
    status = patch_status()
    assert status == {"load-format": "applied", "postprocess": "applied", "lora-device": "applied"}, status
    return types.SimpleNamespace(version=vllm_omni.__version__, loader_mod=loader_mod, lora_mod=lora_mod,
                                 Loader=loader_mod.DiffusersPipelineLoader)
