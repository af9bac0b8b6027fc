"""Distilled-LoRA support: file formats -> normalized deltas, fusion with the device rule (``fuse``).

The normal form and the key dispatch live in ``normal``; one module per format family: ``peft`` (diffusers /
PEFT keys, reading files and adapter configs), ``kohya``, ``wan`` (Wan / LightX2V names).

One call for the load pipeline::

    stats = fuse_lora_files(transformer, [("distill.safetensors", 1.0)])

or, step by step: ``load_lora`` -> ``normalize_lora`` (validates everything, touches nothing) ->
``fuse_lora`` / ``unfuse_lora``.
"""

from vllm_diffusion_plugin.engine.lora.normal import (
    LoraDelta,
    LoraFile,
    LoraFormatError,
    LoraRankError,
    LoraShapeError,
    NonFiniteLoraError,
    PartialPackedLoraError,
    UnmatchedLoraKeysError,
    UnsupportedLoraError,
    normalize_lora,
)
from vllm_diffusion_plugin.engine.lora.peft import load_lora, load_lora_state_dict
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
from vllm_diffusion_plugin.engine.lora.prepare import NoLoraTargetsError, PreparedLora, prepare_lora_files

__all__ = [
    "FuseStats", "LoraDelta", "NoLoraTargetsError", "PreparedLora", "fuse_prepared", "prepare_lora_files", "LoraFile", "LoraFormatError", "LoraFusionError", "LoraRankError", "LoraShapeError",
    "NonFiniteFusionError", "NonFiniteLoraError", "PartialPackedLoraError", "PartiallyFusedError",
    "UnmatchedLoraKeysError", "UnsupportedLoraError", "cpu_kernel", "fuse_lora", "fuse_lora_files", "fuse_weight_",
    "load_lora", "load_lora_state_dict", "normalize_lora", "resolve_compute_device", "unfuse_lora",
]
