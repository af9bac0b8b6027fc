"""kohya LoRA keys: ``lora_unet_<module_with_underscores>.lora_down.weight`` / ``lora_up.weight`` / ``.alpha``.

Underscores are mapped back by matching the module's own names (ambiguity is an error); ``alias`` turns a
module name into the naming the file uses (original Wan names for musubi-tuner files). Layouts that need more
than that (kohya files in original FLUX naming, ``lora_unet_double_blocks_*``) are diffusers' converters' job
(``diffusers_layouts``). A leaf: it imports only ``types``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

from vllm_diffusion_plugin.engine.lora.types import LoraFormatError

KOHYA_PREFIXES = ("lora_unet_", "lora_transformer_")


class KohyaNames:
    """kohya's underscored module paths -> the target's dotted names (built on first use)."""

    def __init__(self, names: Iterable[str], *, alias: Callable[[str], str] | None = None) -> None:
        self.names, self.alias = names, alias
        self._table: dict[str, list[str]] | None = None

    @staticmethod
    def claims(path: str) -> bool:
        """Whether ``path`` is a kohya module path (``lora_unet_...`` / ``lora_transformer_...``)."""
        return path.startswith(KOHYA_PREFIXES)

    def lookup(self, path: str) -> str | None:
        """The dotted name (in ``alias`` naming) a ``lora_unet_``/``lora_transformer_`` path stands for."""
        if self._table is None:
            table: dict[str, list[str]] = defaultdict(list)
            for name in self.names:
                alias = self.alias(name) if self.alias else name
                if name:
                    table[alias.replace(".", "_")].append(alias)
            self._table = table
        stem = path.split("_", 2)[2] if path.startswith("lora_unet_") else path[len("lora_transformer_"):]
        found = self._table.get(stem, [])
        if len(found) > 1:
            raise LoraFormatError(f"kohya key prefix {path!r} is ambiguous: it matches modules {sorted(found)}")
        return found[0] if found else None
