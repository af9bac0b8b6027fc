"""Every ``vllm serve ... --omni`` command in README.md and docs/ parses with the installed vllm-omni's own
``vllm serve`` parser, and its ``diffusion_hsdp`` options are ours (the other commands: tests/test_docs_commands.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from omni_support import import_omni

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from docs_commands import all_commands, commands_in_block, serve_errors  # noqa: E402

import_omni()  # skips this module where vllm-omni is not installed

OMNI = [c for c in all_commands() if c.program == "vllm" and "--omni" in c.argv]


def check(command, errors=None) -> None:
    error = (errors if errors is not None else serve_errors([command], omni=True))[command.where]
    assert error is None, f"{command.where}: {error}"


@pytest.fixture(scope="module")
def errors():
    return serve_errors(OMNI, omni=True)


def test_the_pages_serve_every_family():
    served = " ".join(" ".join(c.argv) for c in OMNI)
    assert all(family in served for family in ("Wan2.2", "FLUX.1", "Qwen-Image", "Z-Image")), served


@pytest.mark.parametrize("command", OMNI, ids=[c.where for c in OMNI])
def test_each_omni_serve_command_parses(command, errors):
    check(command, errors)


@pytest.mark.parametrize("stale", [
    "vllm serve /models/x --omni --load-format diffusion-hsdp --hsdp-shard-sise 2",
    "vllm serve /models/x --omni --additional-config '{\"diffusion_hsdp\": {\"hsdp_block_pattern\": \"x\"}}'",
])
def test_a_stale_omni_command_fails_the_check(tmp_path, stale):
    with pytest.raises(AssertionError):
        for command in commands_in_block(stale, tmp_path):
            check(command)
