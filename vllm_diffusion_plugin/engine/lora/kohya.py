"""kohya LoRA keys: ``lora_unet_<module_with_underscores>.lora_down.weight`` / ``lora_up.weight`` / ``.alpha``.

Underscores are mapped back by matching the module's own names (ambiguity is an error). Kohya files in
original FLUX naming (``lora_unet_double_blocks_*``) go through diffusers' own converter (lazy import).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.lora.normal import LoraFormatError
from vllm_diffusion_plugin.engine.lora.wan import diffusers_to_wan_name

logger = init_logger(__name__)

KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_")


class KohyaNames:
    """kohya's underscored module paths -> the target's dotted names (built on first use)."""

    def __init__(self, names: Iterable[str], *, wan: bool) -> None:
        self.names, self.wan = names, wan
        self._table: dict[str, list[str]] | None = None

    @staticmethod
    def claims(path: str) -> bool:
        """Whether ``path`` is a kohya module path (``lora_unet_...`` / ``lora_transformer_...``)."""
        return path.startswith(KOHYA_PREFIXES)

    def lookup(self, path: str) -> str | None:
        """The dotted name (Wan naming when ``wan``) a ``lora_unet_``/``lora_transformer_`` path stands for."""
        if self._table is None:
            table: dict[str, list[str]] = defaultdict(list)
            for name in self.names:
                alias = diffusers_to_wan_name(name) if self.wan else name
                if name:
                    table[alias.replace(".", "_")].append(alias)
            self._table = table
        stem = path.split("_", 2)[2] if path.startswith("lora_unet_") else path[len("lora_transformer_"):]
        found = self._table.get(stem, [])
        if len(found) > 1:
            raise LoraFormatError(f"kohya key prefix {path!r} is ambiguous: it matches modules {sorted(found)}")
        return found[0] if found else None


def maybe_convert_kohya_flux(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Kohya files in original FLUX naming need diffusers' converter (q/k/v splits, alpha baked in)."""
    if not any(k.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_")) for k in state_dict):
        return state_dict
    try:
        from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers
    except ImportError as exc:
        raise LoraFormatError(
            "This LoRA is a kohya file in original FLUX naming (lora_unet_double_blocks_*); converting it needs "
            "diffusers: pip install 'vllm-diffusion-plugin[test]' (or the [cli] extra)") from exc
    logger.info("Converting a kohya FLUX LoRA (%d keys) with diffusers' converter", len(state_dict))
    return _convert_kohya_flux_lora_to_diffusers(dict(state_dict))
