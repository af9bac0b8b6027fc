"""diffusers / PEFT LoRA files: reading them (with their adapter config) and PEFT's scaling rule.

Keys ``[prefix.]<module>.lora_A.weight`` / ``lora_B.weight`` (prefix ``transformer.``, ``base_model.model.``,
``diffusion_model.``, ... or none), optional ``<module>.alpha`` and ``lora_B.bias`` (PEFT ``lora_bias``, scaled
like ``B @ A``); the key grammar itself is ``normal``'s. Without an ``.alpha`` entry the scale is the adapter
config's ``lora_alpha / r`` (``rank_pattern``/``alpha_pattern``/``use_rslora`` honoured). A leaf: it imports only
``types``.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.errors import CheckpointError
from vllm_diffusion_plugin.engine.io.headers import read_safetensors_header
from vllm_diffusion_plugin.engine.lora.types import LoraFile, LoraFormatError, LoraRankError

logger = init_logger(__name__)


def load_lora(path: str | Path) -> LoraFile:
    """Read a ``.safetensors`` LoRA file, or a folder holding one (PEFT ``adapter_model.safetensors`` with
    ``adapter_config.json``, or diffusers' ``pytorch_lora_weights.safetensors``). The adapter config comes
    from ``adapter_config.json`` or, failing that, diffusers' ``lora_adapter_metadata`` header entry."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"LoRA path {path} does not exist")
    config_file = None
    if path.is_dir():
        config_file = path / "adapter_config.json"
        candidates = sorted(path.glob("*.safetensors"))
        known = ("adapter_model.safetensors", "pytorch_lora_weights.safetensors")
        preferred = [p for p in candidates if p.name in known]
        if len(preferred) == 1 or len(candidates) == 1:
            file = (preferred or candidates)[0]
        else:
            raise LoraFormatError(
                f"LoRA folder {path} must hold adapter_model.safetensors, pytorch_lora_weights.safetensors or "
                f"exactly one .safetensors file; found {[p.name for p in candidates] or 'none'} "
                f"(.bin/.pt adapters are not read: convert them to safetensors)")
    elif path.suffix != ".safetensors":
        raise LoraFormatError(f"LoRA file {path} is not a .safetensors file (pickled adapters are not read)")
    else:
        file = path
        if path.name == "adapter_model.safetensors":  # a PEFT folder's file, named directly
            config_file = path.parent / "adapter_config.json"

    try:
        read_safetensors_header(file)  # a saved HTML page or a truncated download: one line naming the file
        with safe_open(str(file), framework="pt") as f:
            state_dict = {key: f.get_tensor(key) for key in f.keys()}
            metadata = f.metadata() or {}
    except CheckpointError as exc:
        raise LoraFormatError(f"LoRA file {exc}") from exc
    except Exception as exc:  # safetensors' own SafetensorError and I/O errors
        raise LoraFormatError(f"LoRA file {file}: cannot read it as safetensors: {exc}") from exc
    config = None
    if config_file is not None and config_file.is_file():
        config = json.loads(config_file.read_text())
    elif "lora_adapter_metadata" in metadata:
        config = _config_from_metadata(json.loads(metadata["lora_adapter_metadata"]), file)
    logger.debug("Read %d LoRA tensors from %s (adapter config: %s)", len(state_dict), file, config is not None)
    return LoraFile(file, state_dict, config)


def _config_from_metadata(raw: dict, file: Path) -> dict | None:
    """diffusers' ``save_lora_weights`` prefixes every config entry with its component (``transformer.r``)."""
    if "r" in raw or "lora_alpha" in raw:
        return raw
    components: dict[str, dict] = defaultdict(dict)
    for key, value in raw.items():
        component, _, entry = key.partition(".")
        components[component][entry] = value
    if "transformer" in components or len(components) == 1:
        return components.get("transformer") or next(iter(components.values()))
    logger.warning("LoRA %s carries adapter configs for %s; none is used (alpha entries or scale 1.0 apply)",
                   file, sorted(components))
    return None


def load_lora_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a LoRA file or folder (see ``load_lora``, which also returns the adapter config)."""
    return load_lora(path).state_dict


def config_scale(config: Mapping, names: Sequence[str], rank: int, keys: Sequence[str]) -> float:
    """PEFT's scaling for one module: ``lora_alpha / r`` (or ``/ sqrt(r)`` with rslora), patterns applied."""
    def pattern_value(patterns: Mapping, default):
        for pattern, value in (patterns or {}).items():
            if any(re.match(rf"(.*\.)?({pattern})$", n) for n in names):
                return value
        return default

    r = int(pattern_value(config.get("rank_pattern"), config.get("r", rank)))
    alpha = float(pattern_value(config.get("alpha_pattern"), config.get("lora_alpha", r)))
    if r != rank:
        raise LoraRankError(f"adapter config says r={r} for {names[0]} but {keys[0]} has rank {rank}")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
