"""Load options: one frozen dataclass built from ``--model-loader-extra-config`` with env fallbacks.

Precedence per key: the extra-config JSON, then its ``VLLM_DIFFUSION_*`` variable (see ``envs.py``), then the
default below. Unknown keys and wrong types are errors that name the key and list what is accepted, raised
before any weight is read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_diffusion_plugin import envs
from vllm_diffusion_plugin.engine.io.threads import DEFAULT_THREADS


@dataclass(frozen=True)
class LoadOptions:
    """Options of the ``diffusion-hsdp`` load path (extra-config keys are the field names)."""

    lora_path: tuple[str, ...] = ()
    """LoRA files fused at load. Several files: each applies to the transformer at the same position
    (Wan2.2 A14B: one file for ``transformer``, one for ``transformer_2``) when there are as many files as
    transformers, else every file applies to every transformer."""
    lora_scale: float = 1.0
    """Multiplier on every LoRA delta, on top of its own alpha / rank."""
    lora_strict: bool = True
    """A LoRA key that matches no module is an error (else a warning)."""
    lora_device_chunk_mb: int = 256
    """Bound on the weight rows staged on the accelerator at once while fusing CPU-resident weights."""
    lora_check_finite: bool = False
    """Check every fused weight chunk for NaN/inf (one extra pass over each fused weight). Off, non-finite
    LoRA factors and overflowing deltas are still refused; only a NaN/inf already in a base weight passes
    through unchanged (``lora.fuse``'s module doc)."""
    hsdp_shard_size: int = -1
    """HSDP shard group size S; -1 = world size / replicate size."""
    hsdp_replicate_size: int = 1
    """HSDP replicate group size R."""
    hsdp_block_pattern: str | None = None
    """Regex over module names choosing the blocks to shard (vLLM door: HSDP only when this is set or the
    model declares ``_hsdp_shard_conditions``)."""
    hsdp_weight_load: str = "full"
    """How the ranks get their weights: ``full`` (each reads everything, then shards), ``broadcast`` (rank 0
    reads once and sends bounded buckets; the others read nothing) or ``rank_local`` (the DiTs are sharded on
    ``meta`` first and each rank reads only its own rows). See ``engine.strategies``."""
    hsdp_broadcast_bucket_mb: int = 256
    """Upper bound (MiB) on one broadcast bucket (``broadcast``); tensors are sent in single-dtype buckets."""
    hsdp_broadcast_timeout_s: float = 300.0
    """Seconds any rank waits for one broadcast collective before failing (a peer died or stalled)."""
    collective_timeout_s: float = 300.0
    """Seconds any collective of the CLI's process group may take before it fails on every rank waiting in it
    (``init_process_group(timeout=...)``: the strategies' exchanges, FSDP's all-gathers on a ``(1, S)`` mesh, the
    report's gather): a peer that died or stalled fails the load in this time, not torch's 30 min. The vLLM and
    vllm-omni doors load in their framework's world, whose groups they create."""
    read_timeout_s: float = 300.0
    """Seconds the load waits for one read handed to the read threads (a tensor, a range of rows, a staging
    buffer) before it fails naming the file and the offset: a store that stopped answering (``engine.io``)."""
    read_threads: int | None = None
    """Threads reading checkpoint bytes ahead of the load, results in checkpoint order (``engine.io``);
    1 reads on the loading thread alone. Unset: 4 (:attr:`threads`), except behind vllm-omni's door, which
    takes vllm-omni's own ``num_weight_load_threads`` (1 with ``enable_multithread_weight_load`` off)."""
    pinned_staging_mb: int = 256
    """Page-locked host memory (MiB) a load onto an accelerator stages its bytes through at most
    (``staging.DeviceStaging``: a ring the read threads fill and a copy stream empties); 0 copies from pageable
    memory, as does a host where pinned memory cannot be had."""
    lora_host_weights: str = "auto"
    """Where LoRA deltas are fused into host-resident weights when an accelerator is usable: ``auto`` (the
    faster of the CPU and the through-device path, timed once per process on a representative chunk), ``cpu`` or
    ``device``."""
    allow_pickle: bool = False
    """Accept .bin/.pt checkpoints (``torch.load(weights_only=True)``) when no safetensors exist."""
    strict_unexpected: bool = False
    """Checkpoint keys that match no parameter are an error (else a warning listing them)."""
    preflight: str = "refuse"
    """Before the first weight byte, each rank's planned peak against its host (shared by the node's ranks) and
    accelerator memory (``engine.preflight``): ``refuse`` a load that cannot fit, ``warn`` and load, or ``off``."""

    lora_update_dirs: tuple[str, ...] = ()
    """Directories a running ``vllm serve --omni`` server may read LoRA files from for the runtime LoRA update
    (``POST /v1/diffusion_hsdp/loras``). Empty: the update is off and its routes do not exist. vllm-omni's door only
    (``doors.omni.lora_routes``); the vLLM loader refuses a value, the CLI has no server."""

    extra: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """Keys another vLLM component put into the extra config for its own use (e.g. ``is_draft``)."""

    @classmethod
    def from_extra_config(cls, extra_config: Mapping[str, Any] | None, *,
                          origin: str = "--model-loader-extra-config",
                          not_listed: Collection[str] = ()) -> LoadOptions:
        """Options from ``extra_config`` with env fallbacks; ``origin`` names where the keys came from in errors
        (vllm-omni's door: ``--additional-config diffusion_hsdp``). ``not_listed``: keys the unknown-key error
        leaves out of its list of known keys (those that have no effect behind that door)."""
        extra_config = dict(extra_config or {})
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        passthrough = {k: extra_config.pop(k) for k in _VLLM_OWNED_KEYS if k in extra_config}
        unknown = sorted(set(extra_config) - set(known))
        if unknown:
            raise ValueError(
                f"Unknown key(s) {', '.join(map(repr, unknown))} in {origin} for load "
                f"format `diffusion-hsdp`; known keys: {', '.join(sorted(set(known) - set(not_listed)))}"
            )
        env_for_key = envs.by_extra_config_key()
        values: dict[str, Any] = {}
        for name, f in known.items():
            if name in extra_config:
                values[name] = _coerce(name, extra_config[name], f.type, origin)
            elif name in env_for_key and envs.is_set(env_for_key[name].name):
                values[name] = _coerce(name, envs.get(env_for_key[name].name), f.type, env_for_key[name].name)
        options = cls(**values, extra=passthrough)
        options.validate()
        return options

    @property
    def threads(self) -> int:
        """``read_threads``, or the default (vllm-omni's: 4) when unset."""
        return DEFAULT_THREADS if self.read_threads is None else self.read_threads

    def validate(self) -> None:
        if self.lora_device_chunk_mb <= 0:
            raise ValueError(f"lora_device_chunk_mb must be positive, got {self.lora_device_chunk_mb}")
        if self.hsdp_replicate_size <= 0:
            raise ValueError(f"hsdp_replicate_size must be positive, got {self.hsdp_replicate_size}")
        if self.hsdp_shard_size == 0 or self.hsdp_shard_size < -1:
            raise ValueError(f"hsdp_shard_size must be positive or -1, got {self.hsdp_shard_size}")
        if self.hsdp_weight_load not in WEIGHT_LOAD_STRATEGIES:
            raise ValueError(f"hsdp_weight_load must be one of {', '.join(WEIGHT_LOAD_STRATEGIES)}, "
                             f"got {self.hsdp_weight_load!r}")
        if self.hsdp_broadcast_bucket_mb <= 0:
            raise ValueError(f"hsdp_broadcast_bucket_mb must be positive, got {self.hsdp_broadcast_bucket_mb}")
        if self.read_threads is not None and self.read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {self.read_threads}")
        if self.pinned_staging_mb < 0:
            raise ValueError(f"pinned_staging_mb must be >= 0, got {self.pinned_staging_mb}")
        if self.lora_host_weights not in LORA_HOST_SIDES:
            raise ValueError(f"lora_host_weights must be one of {', '.join(LORA_HOST_SIDES)}, "
                             f"got {self.lora_host_weights!r}")
        if self.preflight not in PREFLIGHT_MODES:
            raise ValueError(f"preflight must be one of {', '.join(PREFLIGHT_MODES)}, got {self.preflight!r}")
        for key in ("collective_timeout_s", "read_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be positive, got {getattr(self, key)}")
        if not self.hsdp_broadcast_timeout_s > 0:
            raise ValueError(f"hsdp_broadcast_timeout_s must be positive, got {self.hsdp_broadcast_timeout_s}")


LOAD_FORMAT = "diffusion-hsdp"
"""The load format name in every door (lowercase: vLLM lowercases ``LoadConfig.load_format``)."""

WEIGHT_LOAD_STRATEGIES = ("full", "broadcast", "rank_local")
"""Values of ``hsdp_weight_load`` (``strategies.STRATEGIES``; kept here so this module stays light)."""

LORA_HOST_SIDES = ("auto", "cpu", "device")
"""Values of ``lora_host_weights``."""
PREFLIGHT_MODES = ("refuse", "warn", "off")
"""Values of ``preflight`` (``engine.preflight.MODES``)."""

_VLLM_OWNED_KEYS = ("is_draft",)
"""Keys vLLM itself adds to a loader's extra config; accepted and passed through untouched."""

_TYPE_NAMES = {
    "tuple[str, ...]": "a string or a list of strings",
    "float": "a number",
    "bool": "a boolean",
    "int": "an integer",
    "int | None": "an integer",
    "str | None": "a string",
    "str": "a string",
}


def _coerce(key: str, value: Any, type_name: str, origin: str) -> Any:
    def bad() -> TypeError:
        return TypeError(f"{origin} key {key!r} must be {_TYPE_NAMES[type_name]}, "
                         f"got {type(value).__name__} {value!r}")

    if type_name == "tuple[str, ...]":
        if isinstance(value, str):
            return (value,)
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise bad()
    if type_name == "bool":
        if isinstance(value, bool):
            return value
        raise bad()
    if type_name in ("int", "int | None"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad()
    if type_name == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad()
    if type_name == "str":
        if isinstance(value, str):
            return value
        raise bad()
    if type_name == "str | None":
        if value is None or isinstance(value, str):
            return value
        raise bad()
    raise AssertionError(f"no coercion for {type_name}")  # a field was added without a rule


def split_lora_entry(text: str) -> tuple[str | None, str, str | None]:
    """``(component, the rest, the tail after its last '@')`` of a ``[COMPONENT=]PATH[@SCALE]`` entry (``lora_path``,
    ``--lora``; ``lora.specs.LoraSpec.parse``), nothing looked up on disk: the component is what precedes a ``=``
    holding no path separator; the tail is None without an ``@`` (a scale or part of the file name: the caller
    decides)."""
    component, sep, rest = text.partition("=")
    if not sep or os.sep in component:
        component, rest = None, text
    elif not component.strip():
        raise ValueError(f"LoRA {text!r}: empty component name before '=' (COMPONENT=PATH[@SCALE])")
    _, at, tail = rest.rpartition("@")
    return component or None, rest, tail if at else None
