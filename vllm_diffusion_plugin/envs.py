"""Every environment variable the plugin reads, in one documented table.

Each entry names the variable, its type, its default and what it means. Values are parsed and validated
here and nowhere else; an invalid value raises ``ValueError`` naming the variable, the value and what is
accepted. Environment values are *fallbacks*: a key given in ``--model-loader-extra-config`` wins.

Read a value with ``envs.get("VLLM_DIFFUSION_PLUGIN")`` (parsed on every call, so tests and child
processes see the current environment).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE or value == "":
        return False
    raise ValueError(
        f"{name}={raw!r} is not a valid boolean; accepted values are "
        f"{', '.join(_TRUE)} (enable) or {', '.join(_FALSE)} (disable)"
    )


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _parse_float(name: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def _parse_str(name: str, raw: str) -> str:
    return raw


def _parse_path_list(name: str, raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _parse_dir_list(name: str, raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(os.pathsep) if part.strip())


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: how to parse it, its default and its meaning."""

    name: str
    type: str
    default: Any
    doc: str
    parse: Callable[[str, str], Any]
    extra_config_key: str | None = None
    """The ``--model-loader-extra-config`` key this variable is a fallback for, if any."""


ENV_VARS: dict[str, EnvVar] = {
    var.name: var
    for var in (
        EnvVar(
            "VLLM_DIFFUSION_PLUGIN", "bool", False,
            "Enables the plugin. 1/true/yes/on enables; 0/false/no/off or unset disables "
            "(register() then returns at once and changes nothing); anything else is an error.",
            _parse_bool,
        ),
        EnvVar(
            "VLLM_DIFFUSION_OMNI_CPU", "bool", False,
            "Makes vllm-omni run diffusion pipelines on the CPU through the plugin's CPU platform (entry point "
            "group vllm_omni.platform_plugins; development, tests, CI). Independent of VLLM_DIFFUSION_PLUGIN.",
            _parse_bool,
        ),
        EnvVar(
            "VLLM_DIFFUSION_OMNI_CPU_DEVICES", "int", 0,
            "How many CPU 'devices' (diffusion ranks) the CPU platform reports; 0 means one per CPU this "
            "process may run on.",
            _parse_int,
        ),
        EnvVar(
            "VLLM_DIFFUSION_LORA_PATH", "list[str]", (),
            "LoRA files fused at load, separated by ','.",
            _parse_path_list, extra_config_key="lora_path",
        ),
        EnvVar(
            "VLLM_DIFFUSION_LORA_UPDATE_DIRS", "list[dir]", (),
            "Directories a running vllm serve --omni server may read LoRA files from for the runtime LoRA update "
            "(POST /v1/diffusion_hsdp/loras), separated by os.pathsep (':' on Linux). Unset: the update is off "
            "and its routes do not exist.",
            _parse_dir_list, extra_config_key="lora_update_dirs",
        ),
        EnvVar(
            "VLLM_DIFFUSION_LORA_SCALE", "float", 1.0,
            "Multiplier applied to every LoRA delta on top of its own alpha/rank scale.",
            _parse_float, extra_config_key="lora_scale",
        ),
        EnvVar(
            "VLLM_DIFFUSION_LORA_STRICT", "bool", True,
            "A LoRA key that matches no module is an error (else a warning).",
            _parse_bool, extra_config_key="lora_strict",
        ),
        EnvVar(
            "VLLM_DIFFUSION_LORA_DEVICE_CHUNK_MB", "int", 256,
            "Upper bound (MiB) on weight rows staged on the accelerator at once while fusing "
            "CPU-resident weights there.",
            _parse_int, extra_config_key="lora_device_chunk_mb",
        ),
        EnvVar(
            "VLLM_DIFFUSION_LORA_CHECK_FINITE", "bool", False,
            "Check every fused weight chunk for NaN/inf (one extra pass over each fused weight); off, "
            "non-finite LoRA factors and overflowing deltas are still refused.",
            _parse_bool, extra_config_key="lora_check_finite",
        ),
        EnvVar(
            "VLLM_DIFFUSION_HSDP_SHARD_SIZE", "int", -1,
            "HSDP shard group size S; -1 means world_size / replicate size.",
            _parse_int, extra_config_key="hsdp_shard_size",
        ),
        EnvVar(
            "VLLM_DIFFUSION_HSDP_REPLICATE_SIZE", "int", 1,
            "HSDP replicate group size R (R x S must equal the world size).",
            _parse_int, extra_config_key="hsdp_replicate_size",
        ),
        EnvVar(
            "VLLM_DIFFUSION_HSDP_BLOCK_PATTERN", "str", None,
            "Regex over module names choosing the blocks to shard with HSDP.",
            _parse_str, extra_config_key="hsdp_block_pattern",
        ),
        EnvVar(
            "VLLM_DIFFUSION_HSDP_WEIGHT_LOAD", "str", "full",
            "How ranks get their weights: full (each reads all, then shards), broadcast (rank 0 reads, "
            "sends buckets) or rank_local (each rank reads only its own shard rows).",
            _parse_str, extra_config_key="hsdp_weight_load",
        ),
        EnvVar(
            "VLLM_DIFFUSION_HSDP_BROADCAST_BUCKET_MB", "int", 256,
            "Upper bound (MiB) on one single-dtype bucket of the broadcast weight load.",
            _parse_int, extra_config_key="hsdp_broadcast_bucket_mb",
        ),
        EnvVar(
            "VLLM_DIFFUSION_HSDP_BROADCAST_TIMEOUT_S", "float", 300.0,
            "Seconds a rank waits for one broadcast collective before failing (a peer died or stalled).",
            _parse_float, extra_config_key="hsdp_broadcast_timeout_s",
        ),
        EnvVar(
            "VLLM_DIFFUSION_COLLECTIVE_TIMEOUT_S", "float", 300.0,
            "Seconds any collective of the CLI's process group may take before it fails (a peer died or "
            "stalled).",
            _parse_float, extra_config_key="collective_timeout_s",
        ),
        EnvVar(
            "VLLM_DIFFUSION_READ_TIMEOUT_S", "float", 300.0,
            "Seconds the load waits for one read of the read threads before failing with the file and offset "
            "(a store that stopped answering).",
            _parse_float, extra_config_key="read_timeout_s",
        ),
        EnvVar(
            "VLLM_DIFFUSION_READ_THREADS", "int", 4,
            "Threads reading checkpoint bytes ahead of the load (1: the loading thread alone); under vllm-omni, "
            "vllm-omni's own num_weight_load_threads when unset.",
            _parse_int, extra_config_key="read_threads",
        ),
        EnvVar(
            "VLLM_DIFFUSION_PINNED_STAGING_MB", "int", 256,
            "Page-locked host memory (MiB) a load onto an accelerator stages its bytes through at most; 0 copies "
            "from pageable memory.",
            _parse_int, extra_config_key="pinned_staging_mb",
        ),
        EnvVar(
            "VLLM_DIFFUSION_LORA_HOST_WEIGHTS", "str", "auto",
            "Where LoRA deltas are fused into host-resident weights when an accelerator is usable: auto (the faster "
            "path, timed once per process), cpu or device.",
            _parse_str, extra_config_key="lora_host_weights",
        ),
        EnvVar(
            "VLLM_DIFFUSION_ALLOW_PICKLE", "bool", False,
            "Allow .bin/.pt checkpoints (loaded with torch.load(weights_only=True)) when no "
            "safetensors are present.",
            _parse_bool, extra_config_key="allow_pickle",
        ),
        EnvVar(
            "VLLM_DIFFUSION_STRICT_UNEXPECTED", "bool", False,
            "Checkpoint keys that match no parameter are an error (else a warning listing them).",
            _parse_bool, extra_config_key="strict_unexpected",
        ),
        EnvVar(
            "VLLM_DIFFUSION_PREFLIGHT", "str", "refuse",
            "Before the first weight byte, each rank's planned peak against its host (shared by the node's "
            "ranks) and accelerator memory: refuse a load that cannot fit, warn and load, or off (no plan).",
            _parse_str, extra_config_key="preflight",
        ),
    )
}


def is_set(name: str) -> bool:
    """True when the variable is present in the environment (even if empty)."""
    _lookup(name)
    return name in os.environ


def get(name: str) -> Any:
    """The parsed value of ``name`` from the current environment, or its default when unset."""
    var = _lookup(name)
    raw = os.environ.get(name)
    if raw is None:
        return var.default
    return var.parse(name, raw)


def validate_all() -> dict[str, Any]:
    """Parse every variable in the table; raises on the first invalid one."""
    return {name: get(name) for name in ENV_VARS}


def by_extra_config_key() -> dict[str, EnvVar]:
    """The variables that are fallbacks for extra-config keys, keyed by that key."""
    return {v.extra_config_key: v for v in ENV_VARS.values() if v.extra_config_key}


def _lookup(name: str) -> EnvVar:
    try:
        return ENV_VARS[name]
    except KeyError:
        raise KeyError(f"{name} is not a vllm-diffusion-plugin environment variable; "
                       f"known: {', '.join(ENV_VARS)}") from None
