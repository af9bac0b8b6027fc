"""LyCORIS adapters that are not ``B @ A`` -- LoKr and LoHa -- fused exactly as full deltas kept factored.

Key grammar (the module path in front is resolved by ``normal``: kohya ``lora_unet_<module>``, PEFT
``base_model.model.<module>``, ``transformer.<module>``, ...; ``<module>.alpha`` is shared with plain LoRA):

- LoKr: ``lokr_w1`` or ``lokr_w1_a`` + ``lokr_w1_b``, and ``lokr_w2`` or ``lokr_w2_a`` + ``lokr_w2_b``:
  ``delta = s * kron(w1, w2)`` with ``w1 = w1_a @ w1_b`` (a x b), ``w2 = w2_a @ w2_b`` (c x d); weight (a*c, b*d);
- LoHa: ``hada_w1_a`` (out x r), ``hada_w1_b`` (r x in), ``hada_w2_a``, ``hada_w2_b``:
  ``delta = s * (w1_a @ w1_b) * (w2_a @ w2_b)``.

Scale ``s`` (LyCORIS's and PEFT's rule), times the caller's scale: with an ``alpha`` entry ``alpha / rank``, the
rank being the factorization's (rows of ``lokr_w1_b`` / ``lokr_w2_b``, of ``hada_w1_b``); a LoKr whose ``w1`` and
``w2`` are both stored whole has no rank and ``s = 1`` (LyCORIS stores ``alpha = dim`` there). Without an
``alpha`` entry: a PEFT LoKr / LoHa adapter config's ``alpha / r``, else 1.

Refused, naming the key: Tucker / CP forms (``lokr_t2``, ``hada_t1``, ``hada_t2``) and conv (4-D) factors.

Memory. A LoKr for a 40-block A14B DiT has ~400 targets of 5120x5120: their full deltas would hold ~40 GB. A
``FactoredDelta`` keeps the factors; ``rows_on(device, dtype)`` materializes row ranges where the fusion runs
(``weight.fuse_factored_``), chunk by chunk, and ``delta[a:b]`` is a row slice, still factored (``rank_local``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from vllm_diffusion_plugin.engine.lora.types import (
    LoraFormatError,
    LoraRankError,
    LoraShapeError,
    UnsupportedLoraError,
)

__all__ = ["KINDS", "FactoredDelta", "HadamardDelta", "KronDelta", "RowStack", "factored_delta", "split_key",
           "stack_rows"]

_LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
_LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
_TUCKER = ("lokr_t2", "hada_t1", "hada_t2")
KINDS = frozenset((*_LOKR, *_LOHA, *_TUCKER))
"""The key kinds of this module (``split_key``'s second value)."""
_SUFFIX = re.compile(r"\.(lokr_(?:w[12](?:_[ab])?|t2)|hada_(?:w[12]_[ab]|t[12]))(?:\.weight)?$")
_ALSO = ("alpha", "diff_b")  # kinds of ``normal`` that may share a LoKr / LoHa target


def split_key(key: str) -> tuple[str, str] | None:
    """``(module path, kind)`` of a LoKr / LoHa key, else None."""
    m = _SUFFIX.search(key)
    return (key[: m.start()], m.group(1)) if m else None


RowsFn = Callable[[int, int], torch.Tensor]


@dataclass(frozen=True, eq=False, kw_only=True)
class FactoredDelta:
    """A full delta ``(rows, cols)`` kept as factors (already multiplied by its scale); ``delta[a:b]`` is its rows
    ``a:b``, still factored. ``rows_on(device, dtype)`` returns ``rows(r0, r1)``, those rows materialized there."""

    scale: float
    total_rows: int
    cols: int
    start: int = 0
    stop: int | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self._stop - self.start, self.cols))

    @property
    def _stop(self) -> int:
        return self.total_rows if self.stop is None else self.stop

    def __getitem__(self, rows: slice) -> FactoredDelta:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"a factored LoRA delta is sliced by contiguous rows only, got {rows!r}")
        lo, hi, _ = rows.indices(self.shape[0])
        return dataclasses.replace(self, start=self.start + lo, stop=self.start + max(lo, hi))

    def rows_on(self, device: torch.device | str, dtype: torch.dtype) -> RowsFn:
        make = self._global_rows(torch.device(device), dtype)
        return lambda r0, r1: make(self.start + r0, self.start + r1)

    def materialize(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole (sliced) delta as one tensor (tests, small targets)."""
        return self.rows_on(device, dtype)(0, self.shape[0])

    def factors(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _global_rows(self, device: torch.device, dtype: torch.dtype) -> RowsFn:
        raise NotImplementedError


def _product(parts: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    tensors = [t.to(device=device, dtype=dtype) for t in parts]
    return tensors[0] if len(tensors) == 1 else tensors[0] @ tensors[1]


@dataclass(frozen=True, eq=False, kw_only=True)
class KronDelta(FactoredDelta):
    """LoKr: ``scale * kron(w1, w2)``; ``w1`` / ``w2`` are one whole factor or an ``(a, b)`` pair (``a @ b``)."""

    w1: tuple[torch.Tensor, ...]
    w2: tuple[torch.Tensor, ...]

    def factors(self) -> tuple[torch.Tensor, ...]:
        return (*self.w1, *self.w2)

    def _global_rows(self, device: torch.device, dtype: torch.dtype) -> RowsFn:
        w1, w2 = _product(self.w1, device, dtype), _product(self.w2, device, dtype)
        c = w2.shape[0]

        def rows(g0: int, g1: int) -> torch.Tensor:
            # row p*c + q of kron(w1, w2) is kron(w1[p], w2[q]): a partial block, whole blocks, a partial block
            pieces, g = [], g0
            while g < g1:
                p, q = divmod(g, c)
                if q == 0 and g + c <= g1:
                    n = (g1 - g) // c
                    pieces.append(torch.kron(w1[p:p + n], w2))
                    g += n * c
                else:
                    q1 = min(c, q + g1 - g)
                    pieces.append(torch.kron(w1[p:p + 1], w2[q:q1]))
                    g += q1 - q
            out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            return out.mul_(self.scale) if out.numel() else out

        return rows


@dataclass(frozen=True, eq=False, kw_only=True)
class HadamardDelta(FactoredDelta):
    """LoHa: ``scale * (w1_a @ w1_b) * (w2_a @ w2_b)``."""

    w1: tuple[torch.Tensor, torch.Tensor]
    w2: tuple[torch.Tensor, torch.Tensor]

    def factors(self) -> tuple[torch.Tensor, ...]:
        return (*self.w1, *self.w2)

    def _global_rows(self, device: torch.device, dtype: torch.dtype) -> RowsFn:
        (w1a, w1b), (w2a, w2b) = ([t.to(device=device, dtype=dtype) for t in pair] for pair in (self.w1, self.w2))
        return lambda g0, g1: ((w1a[g0:g1] @ w1b) * (w2a[g0:g1] @ w2b)).mul_(self.scale)


@dataclass(frozen=True, eq=False, kw_only=True)
class RowStack(FactoredDelta):
    """Full deltas of the slices of a packed target stacked by rows (``None``: zero rows); ``scale`` is 1."""

    parts: tuple[tuple[int, torch.Tensor | FactoredDelta | None], ...]

    def factors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for _, p in self.parts if p is not None
                     for t in ((p,) if isinstance(p, torch.Tensor) else p.factors()))

    def _global_rows(self, device: torch.device, dtype: torch.dtype) -> RowsFn:
        spans, offset = [], 0
        for n, part in self.parts:
            if isinstance(part, FactoredDelta):
                part = part.rows_on(device, dtype)
            spans.append((offset, n, part))
            offset += n

        def rows(g0: int, g1: int) -> torch.Tensor:
            out = []
            for first, n, part in spans:
                lo, hi = max(g0, first), min(g1, first + n)
                if lo >= hi:
                    continue
                if part is None:
                    out.append(torch.zeros(hi - lo, self.cols, device=device, dtype=dtype))
                elif isinstance(part, torch.Tensor):
                    out.append(part[lo - first:hi - first].to(device=device, dtype=dtype))
                else:
                    out.append(part(lo - first, hi - first))
            return out[0] if len(out) == 1 else torch.cat(out)

        return rows


def stack_rows(parts: Sequence[torch.Tensor | FactoredDelta | None], rows: Sequence[int]) -> RowStack:
    """The full deltas of a packed target's slices (``rows[i]`` rows each), stacked, nothing materialized."""
    cols = next(p.shape[1] for p in parts if p is not None)
    return RowStack(scale=1.0, total_rows=sum(rows), cols=cols, parts=tuple(zip(rows, parts)))


# ---- the key grammar -> one FactoredDelta per target -----------------------------------------------------
def factored_delta(name: str, parts: Mapping[str, tuple[str, torch.Tensor]], *, scale: float,
                   config: Mapping | None = None) -> FactoredDelta:
    """The LoKr / LoHa delta of target ``name`` from its keys (``parts``: kind -> (key, tensor), finite), scaled
    (module doc). Raises naming the key for a Tucker / conv form, a missing or extra factor, a rank mismatch."""
    keys = [key for key, _ in parts.values()]
    tucker = [parts[k][0] for k in _TUCKER if k in parts]
    if tucker:
        raise UnsupportedLoraError(f"{tucker[0]}: the LyCORIS Tucker/CP form ({', '.join(tucker)}) is not fused, "
                                   f"only linear LoKr / LoHa (w1, w2 factors)")
    for kind, (key, tensor) in parts.items():
        if kind in KINDS and tensor.dim() != 2:
            raise UnsupportedLoraError(f"{key} is {tuple(tensor.shape)}: conv LoKr / LoHa factors are not fused, "
                                       f"only 2-D (linear) ones")
    lokr, loha = [k for k in parts if k in _LOKR], [k for k in parts if k in _LOHA]
    foreign = [parts[k][0] for k in parts if k not in KINDS and k not in _ALSO]
    if (lokr and loha) or foreign:
        raise LoraFormatError(f"LoRA keys for {name} mix adapter kinds ({', '.join(keys[:6])}); one of LoKr, "
                              f"LoHa or lora_A/lora_B per module")
    if lokr:
        (w1, r1), (w2, r2) = (_lokr_factor(name, parts, i) for i in (1, 2))
        rank = _one_rank(name, parts, r1, r2, ("lokr_w1_b", "lokr_w2_b"))
        rows, cols = w1[0].shape[0] * w2[0].shape[0], w1[-1].shape[1] * w2[-1].shape[1]
        return KronDelta(scale=scale * _scale(name, parts, rank, config), total_rows=rows, cols=cols, w1=w1, w2=w2)
    missing = [k for k in _LOHA if k not in parts]
    if missing:
        raise LoraFormatError(f"LoHa for {name} ({', '.join(keys[:4])}) lacks {', '.join(missing)}")
    pairs = [(parts[f"hada_w{i}_a"], parts[f"hada_w{i}_b"]) for i in (1, 2)]
    ranks = [_pair_rank(name, a, b) for a, b in pairs]
    rank = _one_rank(name, parts, *ranks, ("hada_w1_b", "hada_w2_b"))
    (k1, w1a), (k2, w2a) = pairs[0][0], pairs[1][0]
    if w1a.shape[0] != w2a.shape[0] or pairs[0][1][1].shape[1] != pairs[1][1][1].shape[1]:
        raise LoraShapeError(f"LoHa for {name}: w1 is ({w1a.shape[0]}, {pairs[0][1][1].shape[1]}) but w2 is "
                             f"({w2a.shape[0]}, {pairs[1][1][1].shape[1]}) ({k1}, {k2})")
    return HadamardDelta(scale=scale * _scale(name, parts, rank, config), total_rows=int(w1a.shape[0]),
                         cols=int(pairs[0][1][1].shape[1]), w1=(w1a, pairs[0][1][1]), w2=(w2a, pairs[1][1][1]))


def _lokr_factor(name: str, parts: Mapping, i: int) -> tuple[tuple[torch.Tensor, ...], int | None]:
    """``((whole,), None)`` or ``((a, b), rank)`` for LoKr factor ``w{i}``."""
    whole, a, b = (parts.get(f"lokr_w{i}{suffix}") for suffix in ("", "_a", "_b"))
    if whole is not None and (a or b):
        raise LoraFormatError(f"LoKr for {name} gives w{i} both whole ({whole[0]}) and factorized "
                              f"({(a or b)[0]})")
    if whole is not None:
        return (whole[1],), None
    if a is None or b is None:
        have = [p[0] for p in (a, b) if p is not None]
        raise LoraFormatError(f"LoKr for {name} lacks lokr_w{i} (or both lokr_w{i}_a and lokr_w{i}_b)"
                              f"{'; it has ' + ', '.join(have) if have else ''}")
    return (a[1], b[1]), _pair_rank(name, a, b)


def _pair_rank(name: str, a: tuple[str, torch.Tensor], b: tuple[str, torch.Tensor]) -> int:
    (ka, ta), (kb, tb) = a, b
    if ta.shape[1] != tb.shape[0]:
        raise LoraRankError(f"rank mismatch for {name}: {ka} is {tuple(ta.shape)} and {kb} is {tuple(tb.shape)} "
                            f"(need a: n x r, b: r x m)")
    return int(tb.shape[0])


def _one_rank(name: str, parts: Mapping, r1: int | None, r2: int | None, which: tuple[str, str]) -> int | None:
    if r1 is not None and r2 is not None and r1 != r2:
        raise LoraRankError(f"rank mismatch for {name}: {parts[which[0]][0]} has rank {r1} but "
                            f"{parts[which[1]][0]} has rank {r2}; alpha / rank would be ambiguous")
    return r2 if r2 is not None else r1


def _scale(name: str, parts: Mapping, rank: int | None, config: Mapping | None) -> float:
    if "alpha" in parts:
        key, alpha = parts["alpha"]
        if alpha.numel() != 1:
            raise LoraShapeError(f"{key} must hold one number, got shape {tuple(alpha.shape)}")
        return 1.0 if rank is None else float(alpha.item()) / rank
    if not config or str(config.get("peft_type", "")).upper() not in ("LOKR", "LOHA"):
        return 1.0
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise UnsupportedLoraError(f"the {config['peft_type']} adapter config for {name} has rank_pattern / "
                                   f"alpha_pattern, which are not read for LoKr / LoHa; give alpha entries")
    r = int(config.get("r", rank or 1))
    if rank is not None and r != rank:
        raise LoraRankError(f"adapter config says r={r} for {name} but {next(iter(parts.values()))[0]} has "
                            f"rank {rank}")
    return float(config.get("alpha", r)) / r
