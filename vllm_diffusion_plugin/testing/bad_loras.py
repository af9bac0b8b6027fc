"""Bad LoRA files, one per error kind, made from a good one: the table the door tests share.

``write_bad_lora(kind, good, path)`` edits the good file's tensors (its first ``lora_A`` / ``lora_B`` pair) and
returns the first key the error must name (None when the file has none). Every door must answer each with one
line naming the file, the component it was meant for and that key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

Tensors = dict[str, torch.Tensor]


def _first_pair(tensors: Mapping[str, torch.Tensor]) -> tuple[str, str, str]:
    """``(module path, lora_A key, lora_B key)`` of the first A/B pair."""
    a = next(k for k in tensors if k.endswith("lora_A.weight"))
    module = a.removesuffix(".lora_A.weight")
    return module, a, f"{module}.lora_B.weight"


def _unknown_layout(t: Tensors) -> tuple[Tensors, str]:
    renamed = {k.replace(".lora_A.", ".lora_left.").replace(".lora_B.", ".lora_right."): v for k, v in t.items()
               if not k.endswith(".alpha")}
    return renamed, sorted(renamed)[0]


def _unmatched(t: Tensors) -> tuple[Tensors, str]:
    module, a, b = _first_pair(t)
    ghost = f"{module}_ghost"
    return t | {k.replace(module, ghost): t[k].clone() for k in (a, b)}, f"{ghost}.lora_A.weight"


def _shape(t: Tensors) -> tuple[Tensors, str]:
    _, _, b = _first_pair(t)
    return t | {b: torch.zeros(t[b].shape[0] + 1, t[b].shape[1])}, b


def _rank(t: Tensors) -> tuple[Tensors, str]:
    _, _, b = _first_pair(t)
    return t | {b: t[b][:, :-1].contiguous()}, b


def _non_finite(t: Tensors) -> tuple[Tensors, str]:
    _, a, _ = _first_pair(t)
    bad = t[a].clone()
    bad[0, 0] = float("nan")
    return t | {a: bad}, a


def _zero_targets(t: Tensors) -> tuple[Tensors, None]:
    return {}, None


def _unsupported(t: Tensors) -> tuple[Tensors, str]:
    module, _, b = _first_pair(t)
    key = f"{module}.lora_magnitude_vector"
    return t | {key: torch.ones(t[b].shape[0])}, key


def _overflow(t: Tensors) -> tuple[Tensors, str]:
    """Finite factors whose product overflows: found while fusing, not while reading."""
    _, a, b = _first_pair(t)
    return t | {a: torch.full_like(t[a], 1e20), b: torch.full_like(t[b], 1e20)}, a


KINDS: dict[str, Callable[[Tensors], tuple[Tensors, str | None]]] = {
    "unknown layout": _unknown_layout,
    "unmatched keys": _unmatched,
    "shape": _shape,
    "rank": _rank,
    "non-finite": _non_finite,
    "zero targets": _zero_targets,
    "unsupported variant": _unsupported,
    "overflow at fusion": _overflow,
}
"""Error kind -> the edit of a good file's tensors (returns the edited tensors and the key to name)."""


def write_bad_lora(kind: str, good: Path, path: Path) -> str | None:
    """Write the ``kind`` variant of the LoRA file ``good`` to ``path``; returns the first offending key."""
    from safetensors.torch import load_file, save_file

    tensors, key = KINDS[kind](load_file(str(good)))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return key
