"""LoRA files read and validated against a module (a ``meta`` skeleton is enough) before any weight is read.

``prepare_lora_files`` is the one place every door turns LoRA files into deltas: it reads each file (a file
that is not safetensors is an error naming it), maps its keys onto the module and checks every shape and rank
(``normal.normalize_lora``), and refuses a file that would fuse nothing -- a LoRA silently dropped is a wrong
result with exit code 0. With ``strict=False`` (``lora_strict=false``) unmatched keys and a file that fuses
nothing are warnings instead. The deltas do not depend on the module instance, so a load validates them on
its meta skeleton first and fuses the same deltas into the loaded weights later.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.lora.normal import normalize_lora
from vllm_diffusion_plugin.engine.lora.peft import load_lora
from vllm_diffusion_plugin.engine.lora.types import LoraDelta, NoLoraTargetsError

logger = init_logger(__name__)

__all__ = ["NoLoraTargetsError", "PreparedLora", "prepare_lora_files"]


@dataclass(frozen=True)
class PreparedLora:
    """One LoRA file, validated: its deltas keyed by target name (see ``normalize_lora``), in fusion order."""

    path: Path
    scale: float
    deltas: Mapping[str, LoraDelta]


def prepare_lora_files(module: nn.Module, files: Iterable[tuple[str | Path, float]], *, strict: bool = True,
                       packed_modules: Mapping[str, Sequence[str]] | None = None) -> list[PreparedLora]:
    """Read, normalize and validate every LoRA file against ``module``; nothing in ``module`` is touched."""
    prepared = []
    for path, scale in files:
        lora = load_lora(path)
        deltas = normalize_lora(lora.state_dict, module, scale=scale, strict=strict,
                                adapter_config=lora.adapter_config, packed_modules=packed_modules)
        if not deltas:
            message = (f"LoRA file {lora.path} fuses no target of {type(module).__name__} "
                       f"({len(lora.state_dict)} keys, none of them a LoRA weight of this module)")
            if strict:
                raise NoLoraTargetsError(f"{message}; check that it is meant for this model (lora_strict=false "
                                         f"makes this a warning)")
            logger.warning("%s; it changes nothing (lora_strict=false)", message)
        prepared.append(PreparedLora(lora.path, scale, deltas))
    return prepared
