"""LoRA files read and validated against a module (a ``meta`` skeleton is enough) before any weight is read.

``prepare_lora_files`` is the one place every door turns LoRA files into deltas: it reads each file (a file
that is not safetensors is an error naming it), maps its keys onto the module and checks every shape and rank
(``normal.normalize_lora``), and refuses a file that would fuse nothing -- a LoRA silently dropped is a wrong
result with exit code 0. With ``strict=False`` (``lora_strict=false``) unmatched keys and a file that fuses
nothing are warnings instead. The deltas do not depend on the module instance, so a load validates them on
its meta skeleton first and fuses the same deltas into the loaded weights later.

Every error about a file's content is one line naming the file, the component it was meant for and the first
offending keys: ``LoRA file PATH for COMPONENT (Class): ...`` (the same type as ``normalize_lora`` raised); each
delta carries the same ``origin`` so that fusion-time errors name the file too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.lora.normal import normalize_lora
from vllm_diffusion_plugin.engine.lora.peft import load_lora
from vllm_diffusion_plugin.engine.lora.types import LoraDelta, LoraFormatError, NoLoraTargetsError

logger = init_logger(__name__)

__all__ = ["NoLoraTargetsError", "PreparedLora", "prepare_lora_files"]


@dataclass(frozen=True)
class PreparedLora:
    """One LoRA file, validated: its deltas keyed by target name (see ``normalize_lora``), in fusion order."""

    path: Path
    scale: float
    deltas: Mapping[str, LoraDelta]


def prepare_lora_files(module: nn.Module, files: Iterable[tuple[str | Path, float]], *, strict: bool = True,
                       packed_modules: Mapping[str, Sequence[str]] | None = None,
                       component: str | None = None) -> list[PreparedLora]:
    """Read, normalize and validate every LoRA file against ``module``; nothing in ``module`` is touched.
    ``component``: what the module is called in messages (the checkpoint component; default its class)."""
    target = f"{component} ({type(module).__name__})" if component else type(module).__name__
    prepared = []
    for path, scale in files:
        try:
            lora = load_lora(path)
            deltas = normalize_lora(lora.state_dict, module, scale=scale, strict=strict,
                                    adapter_config=lora.adapter_config, packed_modules=packed_modules)
        except LoraFormatError as exc:
            raise type(exc)(_naming(str(exc), Path(path), target)) from exc
        origin = f"LoRA file {lora.path} for {target}"
        if not deltas:
            message = f"{origin} fuses no target ({len(lora.state_dict)} keys, none of them a LoRA weight of it)"
            if strict:
                raise NoLoraTargetsError(f"{message}; first keys: {', '.join(list(lora.state_dict)[:5]) or 'none'}; "
                                         f"check that it is meant for this model (lora_strict=false makes this a "
                                         f"warning)")
            logger.warning("%s; it changes nothing (lora_strict=false)", message)
        deltas = {name: dataclasses.replace(delta, origin=origin) for name, delta in deltas.items()}
        prepared.append(PreparedLora(lora.path, scale, deltas))
    return prepared


def _naming(message: str, path: Path, target: str) -> str:
    """``message`` as one line led by ``LoRA file PATH for TARGET:`` (a message naming the file already keeps its
    own words after the lead)."""
    message = " | ".join(line.strip() for line in message.splitlines() if line.strip())
    for named in (f"LoRA file {path}: ", f"LoRA file {path} ", f"LoRA folder {path} "):
        if message.startswith(named):
            message = message[len(named):]
            break
    return f"LoRA file {path} for {target}: {message}"
