"""The general plugin as vLLM meets it: entry-point discovery, env gate, registry, idempotence, import cost."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

import vllm_diffusion_plugin
from vllm_diffusion_plugin import LOAD_FORMAT


def run_python(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter (plugins load once per process) and return its last JSON line."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_PLUGINS", "VLLM_DIFFUSION"))}
    full_env.update(env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


DISCOVER = """
    import json
    from vllm.plugins import load_general_plugins
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER
    load_general_plugins()
    cls = _LOAD_FORMAT_TO_MODEL_LOADER.get("diffusion-hsdp")
    print(json.dumps({"loader": cls and f"{cls.__module__}.{cls.__qualname__}"}))
"""
OURS = "vllm_diffusion_plugin.doors.vllm_loader.DiffusionHSDPLoader"


@pytest.mark.parametrize("plugins, expected", [
    (None, OURS),                      # VLLM_PLUGINS unset: every general plugin loads
    ("diffusion_hsdp", OURS),          # selected by our entry-point name
    ("some_other_plugin", None),       # another plugin selected: ours is not loaded
])
def test_discovered_by_vllm_load_general_plugins(plugins, expected):
    env = {"VLLM_DIFFUSION_PLUGIN": "1"}
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    assert run_python(DISCOVER, **env)["loader"] == expected


def test_disabled_by_default_through_vllm():
    assert run_python(DISCOVER)["loader"] is None


def test_import_is_light():
    result = run_python("""
        import json, sys
        import vllm_diffusion_plugin, vllm_diffusion_plugin.testing.pytest_plugin
        heavy = ("torch_npu", "diffusers", "peft", "torch", "vllm")
        print(json.dumps({m: m in sys.modules for m in heavy}))
    """)
    assert result == {m: False for m in ("torch_npu", "diffusers", "peft", "torch", "vllm")}


def test_enabled_registers_without_heavy_optional_imports():
    result = run_python("""
        import json, sys
        import vllm_diffusion_plugin
        vllm_diffusion_plugin.register()
        print(json.dumps({m: m in sys.modules for m in ("torch_npu", "diffusers", "peft")}))
    """, VLLM_DIFFUSION_PLUGIN="1")
    assert result == {"torch_npu": False, "diffusers": False, "peft": False}


# In-process tests: restore vLLM's registry and our flag around each.

@pytest.fixture
def fresh_registry(monkeypatch):
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    monkeypatch.setattr(vllm_diffusion_plugin, "_registered", False)
    saved = dict(_LOAD_FORMAT_TO_MODEL_LOADER)
    _LOAD_FORMAT_TO_MODEL_LOADER.pop(LOAD_FORMAT, None)
    yield _LOAD_FORMAT_TO_MODEL_LOADER
    _LOAD_FORMAT_TO_MODEL_LOADER.clear()
    _LOAD_FORMAT_TO_MODEL_LOADER.update(saved)


def get_loader(**extra):
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    # LoadConfig lowercases the name, as `--load-format Diffusion-HSDP` would.
    return get_model_loader(LoadConfig(load_format="Diffusion-HSDP", model_loader_extra_config=extra))


def test_enabled_get_model_loader_returns_ours(fresh_registry, monkeypatch):
    from vllm_diffusion_plugin.doors.vllm_loader import DiffusionHSDPLoader

    monkeypatch.setenv("VLLM_DIFFUSION_PLUGIN", "1")
    vllm_diffusion_plugin.register()
    assert type(get_loader()) is DiffusionHSDPLoader


def test_disabled_vllm_says_not_supported(fresh_registry, monkeypatch):
    monkeypatch.setenv("VLLM_DIFFUSION_PLUGIN", "0")
    vllm_diffusion_plugin.register()
    assert LOAD_FORMAT not in fresh_registry
    with pytest.raises(ValueError, match="Load format `diffusion-hsdp` is not supported"):
        get_loader()


def test_bad_switch_value_fails_fast(fresh_registry, monkeypatch):
    monkeypatch.setenv("VLLM_DIFFUSION_PLUGIN", "sure")
    with pytest.raises(ValueError, match=r"VLLM_DIFFUSION_PLUGIN='sure'.*1, true, yes, on"):
        vllm_diffusion_plugin.register()
    assert LOAD_FORMAT not in fresh_registry


def test_bad_other_variable_fails_at_register(fresh_registry, monkeypatch):
    monkeypatch.setenv("VLLM_DIFFUSION_PLUGIN", "1")
    monkeypatch.setenv("VLLM_DIFFUSION_LORA_SCALE", "half")
    with pytest.raises(ValueError, match="VLLM_DIFFUSION_LORA_SCALE='half'"):
        vllm_diffusion_plugin.register()


def test_register_twice_registers_once_and_logs_once(fresh_registry, monkeypatch):
    from vllm.model_executor import model_loader

    from vllm_diffusion_plugin.testing.logs import captured_logs

    monkeypatch.setenv("VLLM_DIFFUSION_PLUGIN", "1")
    calls = []
    real = model_loader.register_model_loader
    monkeypatch.setattr(model_loader, "register_model_loader", lambda name: calls.append(name) or real(name))
    with captured_logs("vllm_diffusion_plugin", logging.INFO) as logs:
        vllm_diffusion_plugin.register()
        vllm_diffusion_plugin.register()
    assert calls == [LOAD_FORMAT]
    assert len(logs.records) == 1 and "load format `diffusion-hsdp` registered" in logs.records[0].getMessage()


def test_env_names_registered_with_vllm(fresh_registry, monkeypatch):
    import vllm.envs

    from vllm_diffusion_plugin import envs

    monkeypatch.setenv("VLLM_DIFFUSION_PLUGIN", "1")
    for name in envs.ENV_VARS:
        monkeypatch.delitem(vllm.envs.environment_variables, name, raising=False)
    vllm_diffusion_plugin.register()
    assert set(envs.ENV_VARS) <= set(vllm.envs.environment_variables)


def test_bad_extra_config_fails_when_vllm_builds_the_loader(fresh_registry, monkeypatch):
    monkeypatch.setenv("VLLM_DIFFUSION_PLUGIN", "1")
    vllm_diffusion_plugin.register()
    with pytest.raises(ValueError, match="Unknown key.*'shard_size'.*known keys"):
        get_loader(shard_size=2)
