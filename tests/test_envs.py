"""The env table: every variable parses its default, accepts good values, rejects bad ones by name."""

import dataclasses
import os

import pytest

from vllm_diffusion_plugin import envs
from vllm_diffusion_plugin.engine.config import LoadOptions

GOOD = {"bool": ("on", True), "int": ("7", 7), "float": ("0.5", 0.5), "str": ("blocks", "blocks"),
        "list[str]": ("a.safetensors, b.safetensors", ("a.safetensors", "b.safetensors")),
        "list[dir]": (f"/srv/loras{os.pathsep} /tmp/a,b", ("/srv/loras", "/tmp/a,b"))}
BAD = {"bool": "maybe", "int": "seven", "float": "half"}


@pytest.mark.parametrize("var", list(envs.ENV_VARS.values()), ids=list(envs.ENV_VARS))
def test_every_variable(var, monkeypatch):
    assert var.name.startswith("VLLM_DIFFUSION_")
    assert var.doc and var.type in GOOD
    monkeypatch.delenv(var.name, raising=False)
    assert envs.get(var.name) == var.default
    raw, parsed = GOOD[var.type]
    monkeypatch.setenv(var.name, raw)
    assert envs.get(var.name) == parsed
    if var.type in BAD:
        monkeypatch.setenv(var.name, BAD[var.type])
        with pytest.raises(ValueError, match=var.name):
            envs.get(var.name)


@pytest.mark.parametrize("raw", ["1", "true", "YES", "on", " On "])
def test_plugin_switch_enables(raw, monkeypatch):
    monkeypatch.setenv("VLLM_DIFFUSION_PLUGIN", raw)
    assert envs.get("VLLM_DIFFUSION_PLUGIN") is True


@pytest.mark.parametrize("raw", ["0", "false", "No", "off", ""])
def test_plugin_switch_disables(raw, monkeypatch):
    monkeypatch.setenv("VLLM_DIFFUSION_PLUGIN", raw)
    assert envs.get("VLLM_DIFFUSION_PLUGIN") is False


def test_plugin_switch_bad_value_names_variable_value_and_accepted(monkeypatch):
    monkeypatch.setenv("VLLM_DIFFUSION_PLUGIN", "enable")
    with pytest.raises(ValueError) as err:
        envs.get("VLLM_DIFFUSION_PLUGIN")
    message = str(err.value)
    assert "VLLM_DIFFUSION_PLUGIN" in message and "'enable'" in message
    for accepted in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        assert accepted in message


def test_unknown_name_is_an_error():
    with pytest.raises(KeyError, match="VLLM_DIFFUSION_NOPE"):
        envs.get("VLLM_DIFFUSION_NOPE")


def test_every_load_option_has_an_env_fallback_and_back():
    options = {f.name for f in dataclasses.fields(LoadOptions)} - {"extra"}
    assert set(envs.by_extra_config_key()) == options
