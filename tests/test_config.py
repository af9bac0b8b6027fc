"""LoadOptions: extra-config wins over env, env over default; bad keys and types are named."""

import pytest

from vllm_diffusion_plugin.engine.config import LoadOptions


def test_defaults(monkeypatch):
    for name in ("VLLM_DIFFUSION_LORA_PATH", "VLLM_DIFFUSION_LORA_SCALE"):
        monkeypatch.delenv(name, raising=False)
    options = LoadOptions.from_extra_config(None)
    assert options == LoadOptions()


def test_extra_config_wins_over_env(monkeypatch):
    monkeypatch.setenv("VLLM_DIFFUSION_LORA_SCALE", "0.25")
    monkeypatch.setenv("VLLM_DIFFUSION_LORA_PATH", "env.safetensors")
    options = LoadOptions.from_extra_config({"lora_scale": 2})
    assert options.lora_scale == 2.0
    assert options.lora_path == ("env.safetensors",)


def test_unknown_key_lists_known_keys():
    with pytest.raises(ValueError) as err:
        LoadOptions.from_extra_config({"lora_pth": "x"})
    assert "'lora_pth'" in str(err.value)
    assert "lora_path" in str(err.value) and "hsdp_shard_size" in str(err.value)


@pytest.mark.parametrize("key, value, expected", [
    ("lora_scale", "1.0", "a number"),
    ("hsdp_shard_size", 2.5, "an integer"),
    ("hsdp_shard_size", True, "an integer"),
    ("allow_pickle", "yes", "a boolean"),
    ("lora_path", ["a", 3], "a string or a list of strings"),
])
def test_wrong_type_names_key_and_expected_type(key, value, expected):
    with pytest.raises(TypeError, match=f"'{key}' must be {expected}"):
        LoadOptions.from_extra_config({key: value})


@pytest.mark.parametrize("extra, match", [
    ({"hsdp_shard_size": 0}, "hsdp_shard_size must be positive or -1, got 0"),
    ({"hsdp_replicate_size": -2}, "hsdp_replicate_size must be positive, got -2"),
    ({"lora_device_chunk_mb": 0}, "lora_device_chunk_mb must be positive"),
    ({"collective_timeout_s": 0}, "collective_timeout_s must be positive, got 0"),
    ({"read_timeout_s": -1}, "read_timeout_s must be positive, got -1"),
])
def test_bad_values(extra, match):
    with pytest.raises(ValueError, match=match):
        LoadOptions.from_extra_config(extra)


def test_vllm_owned_keys_pass_through():
    options = LoadOptions.from_extra_config({"is_draft": True})
    assert options.extra == {"is_draft": True}


def test_the_cli_flags_then_the_env_set_the_collective_and_read_timeouts(monkeypatch):
    from vllm_diffusion_plugin.doors import cli

    monkeypatch.setenv("VLLM_DIFFUSION_COLLECTIVE_TIMEOUT_S", "12.5")
    monkeypatch.setenv("VLLM_DIFFUSION_READ_TIMEOUT_S", "30")
    env_only = cli._options(cli._parser().parse_args(["load", "x"]))
    assert (env_only.collective_timeout_s, env_only.read_timeout_s) == (12.5, 30.0)
    flags = cli._options(cli._parser().parse_args(["load", "x", "--collective-timeout", "42", "--read-timeout", "7"]))
    assert (flags.collective_timeout_s, flags.read_timeout_s) == (42.0, 7.0)
