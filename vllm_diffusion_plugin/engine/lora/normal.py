"""LoRA files in every supported layout -> one normalized, validated form: a ``LoraDelta`` per target.

Layouts (detected per key, mixed files allowed), one module per family:

- diffusers / PEFT (``peft``): ``[prefix.]<module>.lora_A.weight`` / ``lora_B.weight``, ``.alpha``,
  ``lora_B.bias``; files and adapter configs are read there (``load_lora``);
- kohya (``kohya``): ``lora_unet_<module_with_underscores>.lora_down.weight`` / ``lora_up.weight`` / ``.alpha``;
- Wan / LightX2V (``wan``): ``diffusion_model.*`` keys in original Wan naming, ``.diff_b`` / ``.diff`` deltas;
- LyCORIS LoKr / LoHa (``lycoris``): ``<module>.lokr_w1`` ... / ``hada_w1_a`` ..., kept factored as a full delta
  (``lycoris.FactoredDelta``) that the fusion materializes row chunk by row chunk;
- packed targets (``packed_modules={"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``, here): per-slice deltas are
  stacked exactly: ``A = cat(A_i)`` along dim 0 and ``B`` block-diagonal, so ``B @ A = cat(B_i @ A_i)``.

Refused, naming the keys (``UnsupportedLoraError``): DoRA (``lora_magnitude_vector`` / ``dora_scale``: the fused
weight ``m * (W + s*B@A) / ||W + s*B@A||`` is no delta -- it depends on the base weight and on every file fused
before it, cannot be unfused by subtraction, and LyCORIS's input-axis norm needs whole columns, which
``rank_local`` rows do not hold), ``lora_mid`` / Tucker forms, embedding LoRAs, OFT.

Scale convention: with an ``.alpha`` entry, ``scale = alpha / rank``; else the adapter config's
``lora_alpha / r`` (PEFT ``rank_pattern``/``alpha_pattern``/``use_rslora`` honoured); else 1.0 -- always
times the caller's ``scale``. ``.diff``/``.diff_b`` are multiplied by the caller's ``scale`` only.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.lora.wan import uses_wan_naming, wan_to_diffusers_name

logger = init_logger(__name__)

__all__ = [
    "LoraDelta", "LoraFile", "LoraFormatError", "LoraRankError", "LoraShapeError", "NonFiniteLoraError",
    "PartialPackedLoraError", "UnmatchedLoraKeysError", "UnsupportedLoraError", "normalize_lora",
]


class LoraFormatError(ValueError):
    """A LoRA file that cannot be mapped onto the module; raised before any weight is touched."""


class UnmatchedLoraKeysError(LoraFormatError):
    """Keys that match no module of the target (strict mode)."""


class LoraShapeError(LoraFormatError):
    """A LoRA tensor whose shape does not fit the target weight or bias."""


class LoraRankError(LoraFormatError):
    """``lora_A`` and ``lora_B`` (or the adapter config) disagree on the rank."""


class NonFiniteLoraError(LoraFormatError):
    """A LoRA tensor or alpha holding NaN or inf."""


class PartialPackedLoraError(LoraFormatError):
    """Some, not all, slices of a packed (fused q/k/v or gate/up) target carry a delta."""


class UnsupportedLoraError(LoraFormatError):
    """A LoRA variant that cannot be fused as ``W + s * B @ A`` (DoRA, LoHa, LoKr, ...)."""


@dataclass(frozen=True, eq=False)
class LoraDelta:
    """The update of one target: ``W += scale * B @ A``; ``bias += bias_delta``; ``W += full_delta``.

    ``A`` is ``(rank, in_features)``, ``B`` is ``(out_features, rank)``, both None for a target with only
    full/bias deltas. ``scale`` multiplies ``B @ A`` only; ``bias_delta`` and ``full_delta`` are final
    (already multiplied by their scale); ``full_delta`` is a tensor or, for LoKr / LoHa, a
    ``lycoris.FactoredDelta`` (materialized only while it is fused). ``source_keys`` are the file keys it came
    from and ``origin`` the file and component (``LoRA file PATH for COMPONENT``, set by ``prepare_lora_files``),
    for messages.
    """

    A: torch.Tensor | None
    B: torch.Tensor | None
    scale: float
    bias_delta: torch.Tensor | None = None
    full_delta: torch.Tensor | None = None
    source_keys: tuple[str, ...] = ()
    origin: str = ""

    @property
    def rank(self) -> int:
        return 0 if self.A is None else int(self.A.shape[0])


@dataclass(frozen=True)
class LoraFile:
    """A loaded LoRA: its tensors and, when the file carries one, its PEFT adapter config."""

    path: Path
    state_dict: dict[str, torch.Tensor]
    adapter_config: dict | None


# ---- key grammar (shared by every family) -----------------------------------------------------------
_KIND_SUFFIXES = (  # (regex on the key's tail, kind); the module path is what precedes the match
    (re.compile(r"\.(?:lora_A|lora_down)(?:\.[A-Za-z0-9_]+)?\.weight$"), "A"),
    (re.compile(r"\.(?:lora_B|lora_up)(?:\.[A-Za-z0-9_]+)?\.weight$"), "B"),
    (re.compile(r"\.lora_B(?:\.[A-Za-z0-9_]+)?\.bias$"), "lora_bias"),
    (re.compile(r"\.alpha$"), "alpha"),
    (re.compile(r"\.diff_b$"), "diff_b"),
    (re.compile(r"\.diff$"), "diff"),
)
_UNSUPPORTED = (  # (pattern, variant): refused, see the module doc
    (re.compile(r"dora_scale|lora_magnitude_vector"), "DoRA (the fused weight m * (W + s*B@A) / ||W + s*B@A|| "
                                                       "is no delta: merge it into the checkpoint instead)"),
    (re.compile(r"lora_mid"), "LoCon Tucker (lora_mid)"),
    (re.compile(r"lora_embedding_"), "embedding LoRA"),
    (re.compile(r"\.oft_"), "OFT"),
)
_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "unet.")

def _split_key(key: str) -> tuple[str, str] | None:
    from vllm_diffusion_plugin.engine.lora.lycoris import split_key  # lycoris imports this module's types

    for pattern, kind in _KIND_SUFFIXES:
        m = pattern.search(key)
        if m:
            return key[: m.start()], kind
    return split_key(key)


def _strip_prefixes(path: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if path.startswith(prefix):
                path, changed = path[len(prefix):], True
    return path


class _Targets:
    """Maps a key's module path onto the module: ``(target name, packed slice index | None)`` or None."""

    def __init__(self, module: nn.Module, packed: Mapping[str, Sequence[str]], wan: bool) -> None:
        from vllm_diffusion_plugin.engine.lora.kohya import KohyaNames  # kohya imports this module's errors

        self.modules = dict(module.named_modules())
        self.params = dict(module.named_parameters())
        self.wan = wan
        self.slices: dict[str, tuple[str, int]] = {}  # virtual slice name -> (packed module, index)
        for name in self.modules:
            parent, _, leaf = name.rpartition(".")
            for i, sub in enumerate(packed.get(leaf, ())):
                self.slices[f"{parent}.{sub}" if parent else sub] = (name, i)
        self.kohya = KohyaNames((*self.modules, *self.params, *self.slices), wan=wan)

    def resolve(self, path: str) -> tuple[str, int | None] | None:
        if self.kohya.claims(path):
            found = self.kohya.lookup(path)
            if found is None:
                return None
            path = found
        path = _strip_prefixes(path)
        for name in ((wan_to_diffusers_name(path), path) if self.wan else (path,)):
            if name in self.modules or name in self.params:
                return name, None
            if name in self.slices:
                return self.slices[name]
        return None


def _finite(key: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise NonFiniteLoraError(f"LoRA tensor {key} {tuple(t.shape)} holds NaN or inf")


def normalize_lora(
    state_dict: Mapping[str, torch.Tensor],
    module: nn.Module,
    *,
    scale: float = 1.0,
    strict: bool = True,
    adapter_config: Mapping | None = None,
    packed_modules: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, LoraDelta]:
    """Map every key of ``state_dict`` onto ``module`` and validate it; nothing in ``module`` is touched.

    Returns deltas keyed by target name: the owning module's name in ``module.named_modules()`` (or a
    parameter's name in ``named_parameters()`` for a full delta of a bare parameter). ``strict``: a key
    that matches no module is an error (else a warning, and it is skipped). Shapes, ranks and finiteness
    are always checked; unsupported LoRA variants and partial packed slices are always errors.
    """
    from vllm_diffusion_plugin.engine.lora.kohya import maybe_convert_kohya_flux

    if not math.isfinite(scale):
        raise NonFiniteLoraError(f"LoRA scale {scale} is not finite")
    state_dict = maybe_convert_kohya_flux(dict(state_dict))
    for pattern, variant in _UNSUPPORTED:
        unsupported = [k for k in state_dict if pattern.search(k)]
        if unsupported:
            raise UnsupportedLoraError(f"{variant} is not fused; {len(unsupported)} such key(s): "
                                       f"{', '.join(unsupported[:5])}")
    packed = dict(packed_modules or {})
    wan = uses_wan_naming(_strip_prefixes(k) for k in state_dict)
    targets = _Targets(module, packed, wan)
    groups: dict[tuple[str, int | None], dict[str, tuple[str, torch.Tensor]]] = defaultdict(dict)
    unmatched = []
    for key, tensor in state_dict.items():
        split = _split_key(key)
        found = targets.resolve(split[0]) if split else None
        if found is None:
            unmatched.append(key)
            continue
        if split[1] in groups[found]:
            raise LoraFormatError(f"LoRA keys {groups[found][split[1]][0]!r} and {key!r} both give the "
                                  f"{split[1]} of {found[0]}")
        groups[found][split[1]] = (key, tensor)
    if unmatched:
        listing = ", ".join(unmatched[:20]) + (f" (and {len(unmatched) - 20} more)" if len(unmatched) > 20 else "")
        message = (f"{len(unmatched)} of {len(state_dict)} LoRA keys match no module of "
                   f"{type(module).__name__}: {listing}")
        if strict:
            raise UnmatchedLoraKeysError(message)
        logger.warning("%s; skipping them (strict=False)", message)

    per_target: dict[str, dict[int | None, tuple[torch.Tensor | None, ...]]] = defaultdict(dict)
    for (name, index), parts in groups.items():
        per_target[name][index] = _slice_delta(name, parts, scale, adapter_config)
    deltas = {}
    for name, slices in per_target.items():
        if None in slices:
            A, B, s, bias, full, keys = slices[None]
            deltas[name] = _checked(LoraDelta(A, B, s, bias, full, keys), name, targets)
        else:
            deltas[name] = _checked(_pack(name, slices, packed, targets), name, targets)
    logger.info("Normalized %d LoRA keys into %d targets of %s (scale %s, wan naming: %s)",
                len(state_dict) - len(unmatched), len(deltas), type(module).__name__, scale, wan)
    return deltas


def _slice_delta(name: str, parts: dict, scale: float, config: Mapping | None) -> tuple:
    for kind, (key, tensor) in parts.items():
        _finite(key, tensor)
    keys = tuple(key for key, _ in parts.values())
    if any(kind.startswith(("lokr_", "hada_")) for kind in parts):
        from vllm_diffusion_plugin.engine.lora.lycoris import factored_delta  # lycoris imports this module's types

        bias = _scaled(parts["diff_b"][1], scale) if "diff_b" in parts else None
        return None, None, scale, bias, factored_delta(name, parts, scale=scale, config=config), keys
    A, B = parts.get("A"), parts.get("B")
    if (A is None) != (B is None):
        have, miss = ("lora_A/lora_down", "lora_B/lora_up") if B is None else ("lora_B/lora_up", "lora_A/lora_down")
        raise LoraFormatError(f"{(A or B)[0]} has {have} but no {miss} for {name}")
    if "alpha" in parts and A is None:
        raise LoraFormatError(f"{parts['alpha'][0]} gives an alpha for {name} but there is no lora_A/lora_B")
    ab_scale = scale
    if A is not None:
        (ka, a), (kb, b) = A, B
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraRankError(f"rank mismatch for {name}: {ka} is {tuple(a.shape)} and {kb} is "
                                f"{tuple(b.shape)} (need A: r x in, B: out x r)")
        rank = int(a.shape[0])
        if "alpha" in parts:
            ka, alpha = parts["alpha"]
            if alpha.numel() != 1:
                raise LoraShapeError(f"{ka} must hold one number, got shape {tuple(alpha.shape)}")
            ab_scale = scale * float(alpha.item()) / rank
        elif config:
            from vllm_diffusion_plugin.engine.lora.peft import config_scale  # peft imports this module's types

            ab_scale = scale * config_scale(config, [name, _strip_prefixes(_split_key(kb)[0])], rank, keys)
    bias = None
    if "lora_bias" in parts:
        bias = _scaled(parts["lora_bias"][1], ab_scale)
    if "diff_b" in parts:
        bias = _scaled(parts["diff_b"][1], scale) if bias is None else bias + _scaled(parts["diff_b"][1], scale)
    full = _scaled(parts["diff"][1], scale) if "diff" in parts else None
    return (None if A is None else A[1], None if B is None else B[1], ab_scale, bias, full, keys)


def _scaled(t: torch.Tensor, s: float) -> torch.Tensor:
    return t if s == 1.0 else t.float() * s


def _pack(name: str, slices: dict, packed: Mapping[str, Sequence[str]], targets: _Targets) -> LoraDelta:
    """Stack per-slice deltas of a packed target: ``A = cat(A_i)``, ``B`` block-diagonal (exact)."""
    sub_names = list(packed[name.rpartition(".")[2]])
    missing = [sub_names[i] for i in range(len(sub_names)) if i not in slices]
    if missing:
        present = [sub_names[i] for i in sorted(slices)]
        raise PartialPackedLoraError(f"packed module {name} has LoRA deltas for slices {present} but not for "
                                     f"{missing}; all slices or none")
    weight = targets.modules[name].weight
    outs = []
    for i in range(len(sub_names)):
        A, B, s, bias, full, keys = slices[i]
        sizes = {t.shape[0] for t in (B, bias, full) if t is not None}
        if len(sizes) != 1:
            raise LoraShapeError(f"slice {sub_names[i]} of {name}: lora_B, bias and full deltas disagree on the "
                                 f"output size ({sorted(sizes)}) in {keys}")
        outs.append(sizes.pop())
    if sum(outs) != weight.shape[0]:
        raise LoraShapeError(f"slices {dict(zip(sub_names, outs))} of {name} sum to {sum(outs)} rows but its "
                             f"weight is {tuple(weight.shape)}")
    with_ab = [slices[i] for i in range(len(sub_names)) if slices[i][0] is not None]
    A = B = None
    common = 1.0
    if with_ab:
        slice_scales = [s for _, _, s, *_ in with_ab]
        uniform = len(set(slice_scales)) == 1
        common = slice_scales[0] if uniform else 1.0  # unequal scales are folded into B (in fp32)
        dtype = torch.promote_types(with_ab[0][0].dtype, with_ab[0][1].dtype)
        for a, b, *_ in with_ab:
            dtype = torch.promote_types(dtype, torch.promote_types(a.dtype, b.dtype))
        if not uniform:
            dtype = torch.promote_types(dtype, torch.float32)
        A = torch.cat([a.to(dtype) for a, *_ in with_ab], dim=0)
        B = torch.zeros(weight.shape[0], A.shape[0], dtype=dtype)
        row = col = 0
        for i in range(len(sub_names)):
            a, b, s = slices[i][:3]
            if a is not None:
                r = a.shape[0]
                B[row:row + outs[i], col:col + r] = b if uniform else b.float() * s
                col += r
            row += outs[i]

    def stacked(index: int) -> torch.Tensor | None:
        parts = [slices[i][index] for i in range(len(sub_names))]
        if all(p is None for p in parts):
            return None
        if any(p is not None and not isinstance(p, torch.Tensor) for p in parts):
            from vllm_diffusion_plugin.engine.lora.lycoris import stack_rows  # a LoKr / LoHa slice: kept factored

            return stack_rows(parts, outs)
        like = next(p for p in parts if p is not None)
        return torch.cat([p if p is not None else like.new_zeros((o, *like.shape[1:])) for p, o in zip(parts, outs)])

    keys = tuple(k for i in range(len(sub_names)) for k in slices[i][5])
    return LoraDelta(A, B, common, stacked(3), stacked(4), keys)


def _checked(delta: LoraDelta, name: str, targets: _Targets) -> LoraDelta:
    """Check a delta against its target's weight/bias shapes."""
    owner = targets.modules.get(name)
    param = targets.params.get(name) if owner is None else getattr(owner, "weight", None)
    if not isinstance(param, torch.Tensor):
        raise LoraShapeError(f"LoRA target {name} ({type(owner).__name__}) has no weight ({delta.source_keys[:3]})")
    shape = tuple(param.shape)
    if delta.A is not None:
        if len(shape) != 2:
            raise LoraShapeError(f"LoRA A/B for {name} need a 2-D (linear) weight; {name}.weight is {shape} "
                                 f"({delta.source_keys[:2]})")
        if delta.B.shape[0] != shape[0] or delta.A.shape[1] != shape[1]:
            raise LoraShapeError(f"shape mismatch for {name}: B @ A is ({delta.B.shape[0]}, {delta.A.shape[1]}) "
                                 f"(A {tuple(delta.A.shape)}, B {tuple(delta.B.shape)}) but the weight is {shape} "
                                 f"({delta.source_keys[:2]})")
    if delta.full_delta is not None and tuple(delta.full_delta.shape) != shape:
        raise LoraShapeError(f"full delta for {name} is {tuple(delta.full_delta.shape)} but the weight is {shape} "
                             f"({delta.source_keys})")
    if delta.bias_delta is not None:
        bias = getattr(owner, "bias", None) if owner is not None else None
        if not isinstance(bias, torch.Tensor):
            raise LoraShapeError(f"LoRA bias delta for {name} but that module has no bias ({delta.source_keys})")
        if tuple(delta.bias_delta.shape) != tuple(bias.shape):
            raise LoraShapeError(f"bias delta for {name} is {tuple(delta.bias_delta.shape)} but the bias is "
                                 f"{tuple(bias.shape)} ({delta.source_keys})")
    return delta
