"""Distilled-LoRA support: file formats -> normalized deltas, fusion with the device rule (``fuse``).

The shared types (``LoraDelta``, ``LoraFile``, the errors) live in ``types``; one leaf module per layout family,
each importing only ``types``: ``diffusers_layouts`` (diffusers' own converters, through the target's LoRA
mixin), ``peft`` (diffusers / PEFT keys, reading files and adapter configs), ``kohya``, ``wan`` (Wan / LightX2V
names); ``normal`` is the one dispatch that imports them.

One call for the load pipeline::

    stats = fuse_lora_files(transformer, [("distill.safetensors", 1.0)])

or, step by step: ``load_lora`` -> ``normalize_lora`` (validates everything, touches nothing) ->
``fuse_lora`` / ``unfuse_lora``.
"""

from vllm_diffusion_plugin.engine.lora.fuse import (
    FuseStats,
    LoraFusionError,
    NonFiniteFusionError,
    PartiallyFusedError,
    cpu_kernel,
    fuse_lora,
    fuse_lora_files,
    fuse_prepared,
    fuse_weight_,
    resolve_compute_device,
    unfuse_lora,
)
from vllm_diffusion_plugin.engine.lora.normal import normalize_lora
from vllm_diffusion_plugin.engine.lora.peft import load_lora, load_lora_state_dict
from vllm_diffusion_plugin.engine.lora.prepare import PreparedLora, prepare_lora_files
from vllm_diffusion_plugin.engine.lora.types import (
    LoraConversionError,
    LoraDelta,
    LoraFile,
    LoraFormatError,
    LoraRankError,
    LoraShapeError,
    NoLoraTargetsError,
    NonFiniteLoraError,
    PartialPackedLoraError,
    UnmatchedLoraKeysError,
    UnsupportedLoraError,
)

__all__ = [
    "FuseStats", "LoraConversionError", "LoraDelta", "NoLoraTargetsError", "PreparedLora", "fuse_prepared", "prepare_lora_files", "LoraFile", "LoraFormatError", "LoraFusionError", "LoraRankError", "LoraShapeError",
    "NonFiniteFusionError", "NonFiniteLoraError", "PartialPackedLoraError", "PartiallyFusedError",
    "UnmatchedLoraKeysError", "UnsupportedLoraError", "cpu_kernel", "fuse_lora", "fuse_lora_files", "fuse_weight_",
    "load_lora", "load_lora_state_dict", "normalize_lora", "resolve_compute_device", "unfuse_lora",
]
