"""Which LoRA files a load fuses, and into which DiT: ``[COMPONENT=]PATH[@SCALE]`` entries (``lora_path``,
``--lora``) parsed and assigned to the loaded transformers, the same way in every door."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_diffusion_plugin.engine.config import split_lora_entry


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA file to fuse: ``[COMPONENT=]PATH[@SCALE]`` on the command line / in ``lora_path``."""

    path: Path
    scale: float = 1.0
    component: str | None = None
    """The component it applies to; None: decided by position (see ``assign_loras``)."""

    @classmethod
    def parse(cls, text: str, *, default_scale: float = 1.0) -> LoraSpec:
        """``@SCALE`` multiplies ``default_scale``. An ``@`` whose tail is no number belongs to the file name,
        unless only the part before it names a file: then the scale is malformed, an error naming the spec."""
        component, rest, scale_text = split_lora_entry(text)
        path, scale = rest, default_scale
        if scale_text is not None:
            head = rest[:-len(scale_text) - 1]
            try:
                path, scale = head, float(scale_text) * default_scale
            except ValueError:
                if Path(head).is_file() and not Path(rest).exists():
                    raise ValueError(f"LoRA {text!r}: the scale {scale_text!r} after '@' is not a number "
                                     f"([COMPONENT=]PATH[@SCALE])") from None
                # else an '@' that is part of the file name
        return cls(Path(path), scale, component)


def assign_loras(specs: Sequence[LoraSpec], transformers: Sequence[str]) -> dict[str, list[LoraSpec]]:
    """Which LoRA files each transformer gets.

    A spec naming its component goes there. Unnamed specs: one transformer -> all of them (stacked);
    as many unnamed specs as transformers -> by position (Wan2.2 A14B: the high-noise LoRA for
    ``transformer``, the low-noise one for ``transformer_2``); one spec and several transformers -> all
    transformers; anything else is ambiguous and an error.
    """
    if specs and not transformers:
        raise ValueError(f"{len(specs)} LoRA file(s) ({specs[0].path} ...) but no DiT is loaded (no component "
                         f"whose class is a diffusers transformer); nothing would fuse them")
    assigned: dict[str, list[LoraSpec]] = {name: [] for name in transformers}
    unnamed = [s for s in specs if s.component is None]
    for spec in specs:
        if spec.component is not None:
            if spec.component not in assigned:
                raise ValueError(f"LoRA {spec.path} names component {spec.component!r}, which is not loaded; "
                                 f"loaded transformers: {', '.join(transformers)}")
            assigned[spec.component].append(spec)
    for spec in specs:
        if not spec.path.exists():
            raise FileNotFoundError(f"LoRA file {spec.path} does not exist")
    if not unnamed:
        return assigned
    if len(transformers) == 1 or len(unnamed) == 1:
        for name in transformers:
            assigned[name].extend(unnamed)
    elif len(unnamed) == len(transformers):
        for name, spec in zip(transformers, unnamed):
            assigned[name].append(spec)
    else:
        raise ValueError(
            f"{len(unnamed)} LoRA files for {len(transformers)} transformers ({', '.join(transformers)}) is "
            f"ambiguous: give one file, one per transformer (matched by position), or name the component "
            f"as COMPONENT=PATH")
    return assigned
