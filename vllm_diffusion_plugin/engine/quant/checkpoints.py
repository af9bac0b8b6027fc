"""Pre-quantized FP8 checkpoints in diffusers layout: what is carried, what is refused, and LoRA fused into them.

Carried, each a component folder of safetensors whose linear weights are ``float8_e4m3fn``
``[out, in]`` with an fp32 ``weight_scale`` (and maybe a static ``input_scale``), declared by
``quantization_config`` in its ``config.json`` (or a ModelOpt ``hf_quant_config.json`` beside it):

- ModelOpt ``{"quant_method": "modelopt", "quant_algo": "FP8"}`` -- a 0-dim scale per tensor;
- ModelOpt ``"FP8_PER_CHANNEL_PER_TOKEN"`` -- one scale per output row (``[out]``, as ModelOpt writes it, or
  ``[out, 1]``);
- vLLM's serialized ``{"quant_method": "fp8"}`` (no ``weight_block_size``) -- a 0-dim scale per tensor.

Which layers are FP8 is read from the headers (a ``.weight`` stored as FP8 beside its ``.weight_scale``), so
ModelOpt's excluded layers stay in the load dtype. :func:`fp8_layers` says it from the resolved source alone (no
data byte); ``skeleton.build_component`` gives those layers ``quant.layer.Fp8Linear``'s parameters, so every strategy
reads the FP8 bytes and scales as they are, into the layers online quantization ends with; nothing is
dequantized and kept. Refused by name in one line, before any weight byte is read (:func:`check_sources`):
NVFP4, ModelOpt mixed precision, block-wise FP8, GGUF, torchao, bitsandbytes or any other method,
``pre_quant_scale`` (AWQ / SmoothQuant pre-scaling), FP8 tensors without a quantization config.

A LoRA is fused into these layers exactly by ``fuse`` (dequantized, added in fp32, requantized once).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.errors import PreQuantError
from vllm_diffusion_plugin.engine.quant.fp8 import FP8

logger = init_logger(__name__)

FP8_ALGOS = {"FP8": False, "FP8_PER_CHANNEL_PER_TOKEN": True}
"""ModelOpt ``quant_algo`` values carried -> per channel."""
REFUSED_SUFFIXES = {".pre_quant_scale": "pre_quant_scale (AWQ / SmoothQuant pre-scaling of the activations)",
                    ".weight_scale_2": "weight_scale_2 (NVFP4's second-level scale)",
                    ".weight_scale_inv": "weight_scale_inv (block-wise FP8 scales)"}


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What a component's FP8 checkpoint holds, from its config and headers."""

    method: str
    """``modelopt`` or ``fp8`` (vLLM's serialized FP8)."""
    algo: str
    layers: Mapping[str, tuple[bool, tuple[int, ...], bool]]
    """Module name -> (per channel, its ``weight_scale``'s shape, has an ``input_scale``)."""


def quantization_config(source) -> tuple[dict | None, str]:
    """The component's quantization config and where it came from: ``quantization_config`` of its
    ``config.json``, else a ModelOpt ``hf_quant_config.json`` in its folder; ``(None, "")`` when neither."""
    config = source.config.get("quantization_config")
    if isinstance(config, Mapping):
        return dict(config), "config.json quantization_config"
    legacy = Path(source.folder) / "hf_quant_config.json"
    if legacy.is_file():
        return json.loads(legacy.read_text(encoding="utf-8")), "hf_quant_config.json"
    return None, ""


def saved_config(source) -> dict:
    """The ``config.json`` a saved copy of ``source`` gets: its own, with the quantization config of a ModelOpt
    ``hf_quant_config.json`` carried into ``quantization_config`` (the saved folder holds FP8 tensors too)."""
    config, where = quantization_config(source)
    return {**source.config, "quantization_config": config} if where == "hf_quant_config.json" else dict(source.config)


def _method_and_algo(config: Mapping[str, Any]) -> tuple[str, str]:
    nested = config.get("quantization") if isinstance(config.get("quantization"), Mapping) else {}
    algo = str(config.get("quant_algo") or nested.get("quant_algo") or "").upper()
    method = str(config.get("quant_method") or config.get("method") or "").lower().replace("-", "_")
    producer = config.get("producer")
    if not method and isinstance(producer, Mapping) and str(producer.get("name", "")).lower() == "modelopt":
        method = "modelopt"
    return method, algo


def fp8_layers(source) -> Fp8Checkpoint | None:
    """The FP8 layers of ``source`` (a resolved ``checkpoint.ComponentSource``) or None for an unquantized one;
    :class:`PreQuantError` naming what is not carried. Reads the config and the headers, no data byte."""
    config, where = quantization_config(source)
    fp8_keys = [k for k, info in source.tensors.items() if info.dtype.is_floating_point and info.dtype.itemsize == 1]
    what = f"{source.name} ({source.folder})"
    if config is None:
        if fp8_keys:
            raise PreQuantError(f"{what}: {len(fp8_keys)} FP8 tensors ({fp8_keys[0]} ...) but no quantization config "
                                f"(config.json quantization_config, hf_quant_config.json) says how to read them")
        return None
    method, algo = _method_and_algo(config)
    if method in ("modelopt", "modelopt_fp4", "modelopt_mixed") and algo not in FP8_ALGOS:
        name = {"NVFP4": "NVFP4", "W4A16_NVFP4": "NVFP4", "MIXED_PRECISION": "mixed precision"}.get(
            algo, f"quant_algo {algo or method!r}")
        raise PreQuantError(f"{what}: a ModelOpt {name} checkpoint ({where}) is not carried; ModelOpt FP8 (per "
                            f"tensor, per channel) and vLLM's serialized fp8 are")
    if method == "fp8" and config.get("weight_block_size"):
        raise PreQuantError(f"{what}: block-wise FP8 (weight_block_size {config['weight_block_size']}, {where}) is "
                            f"not carried; per-tensor FP8 and ModelOpt FP8 (per tensor, per channel) are")
    if method not in ("modelopt", "fp8"):
        raise PreQuantError(f"{what}: quantization method {method or config!r} ({where}) is not carried "
                            f"(GGUF, torchao, bitsandbytes, NVFP4 and others are refused); ModelOpt FP8 (per "
                            f"tensor, per channel) and vLLM's serialized fp8 are, and online quantization of an "
                            f"unquantized checkpoint")
    for key in source.tensors:
        for suffix, name in REFUSED_SUFFIXES.items():
            if key.endswith(suffix):
                raise PreQuantError(f"{what}: {key}: {name} is not carried ({where}: {method} {algo}); FP8 weights "
                                    f"with weight_scale / input_scale are")
    layers: dict[str, tuple[bool, tuple[int, ...], bool]] = {}
    for key in fp8_keys:
        info = source.tensors[key]
        module = key.removesuffix(".weight")
        scale = source.tensors.get(f"{module}.weight_scale")
        if info.dtype != FP8 or not key.endswith(".weight") or len(info.shape) != 2 or scale is None:
            raise PreQuantError(f"{what}: {key} {tuple(info.shape)} {info.dtype} is not an FP8 (e4m3fn) linear weight "
                                f"with its weight_scale; only those are carried ({where})")
        out = info.shape[0]
        if tuple(scale.shape) not in ((), (out,), (out, 1)) or scale.dtype != torch.float32:
            raise PreQuantError(f"{what}: {module}.weight_scale {tuple(scale.shape)} {scale.dtype} is neither one "
                                f"fp32 scale per tensor (0-dim) nor one per output row ({out} or [{out}, 1])")
        input_scale = source.tensors.get(f"{module}.input_scale")
        if input_scale is not None and tuple(input_scale.shape) != ():
            raise PreQuantError(f"{what}: {module}.input_scale {tuple(input_scale.shape)}: only a static per-tensor "
                                f"(0-dim) input scale is carried")
        layers[module] = (bool(scale.shape), tuple(scale.shape), input_scale is not None)
    if not layers:
        raise PreQuantError(f"{what}: {where} says {method} {algo} but no tensor is stored as FP8")
    return Fp8Checkpoint(method, algo or "FP8", layers)


def check_sources(sources: Iterable) -> dict[str, Fp8Checkpoint]:
    """Every component's FP8 layers (components without are left out), or the first refusal; before any read."""
    found = {}
    for source in sources:
        checkpoint = fp8_layers(source)
        if checkpoint is not None:
            found[source.name] = checkpoint
            per_channel = sum(p for p, _, _ in checkpoint.layers.values())
            logger.info("%s: pre-quantized %s %s checkpoint, %d FP8 linears (%d per channel), read as they are",
                        source.name, checkpoint.method, checkpoint.algo, len(checkpoint.layers), per_channel)
    return found


def read_together(keys: Sequence[str], layers: Iterable[str]) -> dict[str, int]:
    """For a stream reading ``keys`` in order: each FP8 layer's ``weight`` and ``weight_scale`` key -> the index
    after which both are read (a LoRA fusion rewrites both, so neither may be sent on before). ``broadcast``
    holds their buckets back until then."""
    index = {key: i for i, key in enumerate(keys)}
    together = {}
    for name in layers:
        pair = [k for k in (f"{name}.weight", f"{name}.weight_scale") if k in index]
        for key in pair:
            together[key] = max(index[k] for k in pair)
    return together
