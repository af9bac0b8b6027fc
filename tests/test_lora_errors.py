"""Every LoRA error names its file, the component it was meant for and the first offending keys, in one line
(issue 21 item 3): one bad file per error kind (``testing.bad_loras``) given as the second of two files, through
the CLI and through the engine call every door's fusion goes through. The vLLM loader's table runs in real vLLM
(``tests/test_vllm_loader.py``), vllm-omni's in ``tests/omni/test_omni_lora_errors.py``.
"""

from __future__ import annotations

import pytest

from vllm_diffusion_plugin.doors import cli
from vllm_diffusion_plugin.testing.bad_loras import KINDS, write_bad_lora
from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora

LOAD = ("--device", "cpu", "--dtype", "float32")


@pytest.fixture(autouse=True)
def keep_vllm_logging(monkeypatch):
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_tiny_lora(tmp_path_factory.mktemp("good") / "good.safetensors", build_tiny_model("wan"), seed=1)


@pytest.mark.parametrize("kind", list(KINDS))
def test_cli_error_is_one_line_naming_file_component_and_key(kind, good, tiny_wan_dir, tmp_path, capsys):
    bad = tmp_path / "low_noise.safetensors"
    key = write_bad_lora(kind, good, bad)
    assert cli.main(["load", str(tiny_wan_dir), f"--lora={good}", f"--lora={bad}", *LOAD]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("vllm-diffusion: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    line = lines[0]
    assert f"LoRA file {bad} for transformer_2 (WanTransformer3DModel)" in line, line
    assert key is None or key in line, line
    assert str(good) not in line, line
