"""LoRA files in every supported layout -> one normalized, validated form: a ``LoraDelta`` per target.

The dispatch. Layouts, one leaf module each (they import only ``types``):

- diffusers' own converters (``diffusers_layouts``): for a target whose diffusers class has a LoRA mixin
  (FLUX, Wan, Qwen-Image, Z-Image, ...), every key but ``.diff`` / ``.diff_b`` of a file not already in
  diffusers / PEFT naming goes through that mixin's ``lora_state_dict`` first (kohya / ComfyUI / XLabs FLUX, original Wan / LightX2V, musubi-tuner, Qwen-Image and
  Z-Image original naming, ...); what it returns is read by the grammar below;
- diffusers / PEFT (``peft``): ``[prefix.]<module>.lora_A.weight`` / ``lora_B.weight``, ``.alpha``,
  ``lora_B.bias``; files and adapter configs are read there (``load_lora``);
- kohya (``kohya``): ``lora_unet_<module_with_underscores>.lora_down.weight`` / ``lora_up.weight`` / ``.alpha``;
- Wan / LightX2V (``wan``): ``diffusion_model.*`` keys in original Wan naming, ``.diff_b`` / ``.diff`` deltas;
- LyCORIS LoKr / LoHa (``lycoris``): ``<module>.lokr_w1`` ... / ``hada_w1_a`` ..., kept factored as a full delta
  (``lycoris.FactoredDelta``) that the fusion materializes row chunk by row chunk;
- packed targets (``packed_modules={"qkv_proj": ["q_proj", "k_proj", "v_proj"]}``, here): per-slice deltas are
  stacked exactly: ``A = cat(A_i)`` along dim 0 and ``B`` block-diagonal, so ``B @ A = cat(B_i @ A_i)``.

Keys of adapters that are not ``B @ A`` never reach a diffusers converter (diffusers' drop DoRA scales with a
warning): LoKr / LoHa keys (and their modules' ``.alpha``) are read by the ``lycoris`` leaf; refused, naming the
keys (``UnsupportedLoraError``): DoRA (``lora_magnitude_vector`` / ``dora_scale``: the fused weight
``m * (W + s*B@A) / ||W + s*B@A||`` is no delta -- it depends on the base weight and on every file fused before it,
cannot be unfused by subtraction, and LyCORIS's input-axis norm needs whole columns, which ``rank_local`` rows do
not hold), ``lora_mid`` / Tucker forms, embedding LoRAs, OFT.

Scale convention: with an ``.alpha`` entry, ``scale = alpha / rank``; else the adapter config's
``lora_alpha / r`` (PEFT ``rank_pattern``/``alpha_pattern``/``use_rslora`` honoured); else 1.0 -- always
times the caller's ``scale``. Converters that bake ``alpha / rank`` into ``A`` and ``B`` leave no ``.alpha``.
``.diff``/``.diff_b`` are multiplied by the caller's ``scale`` only.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.lora import diffusers_layouts, lycoris
from vllm_diffusion_plugin.engine.lora.kohya import KohyaNames
from vllm_diffusion_plugin.engine.lora.peft import config_scale
from vllm_diffusion_plugin.engine.lora.types import (
    LoraConversionError,
    LoraDelta,
    LoraFile,
    LoraFormatError,
    LoraRankError,
    LoraShapeError,
    NonFiniteLoraError,
    PartialPackedLoraError,
    UnmatchedLoraKeysError,
    UnsupportedLoraError,
)
from vllm_diffusion_plugin.engine.lora.wan import diffusers_to_wan_name, uses_wan_naming, wan_to_diffusers_name

logger = init_logger(__name__)

__all__ = [  # the types are re-exported: ``from ...lora.normal import LoraDelta`` keeps working
    "LoraConversionError", "LoraDelta", "LoraFile", "LoraFormatError", "LoraRankError", "LoraShapeError",
    "NonFiniteLoraError", "PartialPackedLoraError", "UnmatchedLoraKeysError", "UnsupportedLoraError",
    "normalize_lora",
]


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
_FULL_DELTAS = re.compile(r"\.diff(?:_b)?$")  # ours in every layout: converters drop them (norms) or never read them
_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "unet.")


def _split_key(key: str) -> tuple[str, str] | None:
    for pattern, kind in _KIND_SUFFIXES:
        m = pattern.search(key)
        if m:
            return key[: m.start()], kind
    return lycoris.split_key(key)


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

    def __init__(self, module: nn.Module, packed: Mapping[str, Sequence[str]]) -> None:
        self.modules = dict(module.named_modules())
        self.params = dict(module.named_parameters())
        self.slices: dict[str, tuple[str, int]] = {}  # virtual slice name -> (packed module, index)
        for name in self.modules:
            parent, _, leaf = name.rpartition(".")
            for i, sub in enumerate(packed.get(leaf, ())):
                self.slices[f"{parent}.{sub}" if parent else sub] = (name, i)
        names = (*self.modules, *self.params, *self.slices)
        self.kohya = {False: KohyaNames(names), True: KohyaNames(names, alias=diffusers_to_wan_name)}

    def resolve(self, path: str, *, wan: bool) -> tuple[str, int | None] | None:
        """``wan``: the path may be in original Wan naming (tried first, then as is)."""
        if KohyaNames.claims(path):
            found = self.kohya[wan].lookup(path)
            if found is None:
                return None
            path = found
        path = _strip_prefixes(path)
        for name in ((wan_to_diffusers_name(path), path) if wan else (path,)):
            if name in self.modules or name in self.params:
                return name, None
            if name in self.slices:
                return self.slices[name]
        return None


def _finite(key: str, t: torch.Tensor) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise NonFiniteLoraError(f"LoRA tensor {key} {tuple(t.shape)} holds NaN or inf")


def _refuse_unsupported(state_dict: Mapping[str, torch.Tensor]) -> None:
    for pattern, variant in _UNSUPPORTED:
        found = [k for k in state_dict if pattern.search(k)]
        if found:
            raise UnsupportedLoraError(f"{variant} is not fused; {len(found)} such key(s): {', '.join(found[:5])}")


def _ours(state_dict: Mapping[str, torch.Tensor]) -> set[str]:
    """Keys no diffusers converter gets: ``.diff`` / ``.diff_b`` (converters drop them, or never read them) and
    every key of a LoKr / LoHa module (its ``.alpha`` too), which the ``lycoris`` leaf reads."""
    lycoris_modules = {found[0] for found in map(lycoris.split_key, state_dict) if found}
    return {k for k in state_dict
            if _FULL_DELTAS.search(k) or (lycoris_modules and k.rpartition(".")[0] in lycoris_modules)}


def _native(state_dict: Mapping[str, torch.Tensor], targets: _Targets) -> bool:
    """Whether every key is already a diffusers / PEFT key of a module of the target (``lora_A`` / ``lora_B`` /
    ``lora_B.bias`` / ``.alpha``): no converter has anything to add (diffusers 0.40's Qwen-Image one drops the
    alphas of such files)."""
    for key in state_dict:
        split = _split_key(key)
        if split is None or KohyaNames.claims(split[0]) or targets.resolve(split[0], wan=False) is None:
            return False
        if split[1] in ("A", "B") and ".lora_A" not in key and ".lora_B" not in key:
            return False
    return True


def _layout_entries(state_dict: dict[str, torch.Tensor], module: nn.Module, targets: _Targets, wan: bool,
                    ) -> tuple[list[tuple[str, torch.Tensor, bool]], str, LoraConversionError | None]:
    """``(key, tensor, may be Wan naming)`` to resolve, where they come from (for messages), and diffusers'
    refusal if its converter could not read the file (then the keys are read as they are)."""
    as_is = [(k, v, wan) for k, v in state_dict.items()]
    mixin = diffusers_layouts.lora_mixin(type(module))
    ours = _ours(state_dict)
    convertible = {k: v for k, v in state_dict.items() if k not in ours}
    if mixin is None or not convertible or _native(convertible, targets):
        return as_is, "", None
    try:
        converted = diffusers_layouts.convert(convertible, mixin)
    except LoraConversionError as exc:
        return as_is, "", exc
    kept = [(k, v, wan) for k, v in state_dict.items() if k not in convertible]
    return [(k, v, False) for k, v in converted.items()] + kept, f" (as diffusers' {mixin.__name__} converts them)", None


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
    if not math.isfinite(scale):
        raise NonFiniteLoraError(f"LoRA scale {scale} is not finite")
    state_dict = dict(state_dict)
    _refuse_unsupported(state_dict)
    packed = dict(packed_modules or {})
    wan = uses_wan_naming(_strip_prefixes(k) for k in state_dict)
    targets = _Targets(module, packed)
    entries, via, refusal = _layout_entries(state_dict, module, targets, wan)
    groups: dict[tuple[str, int | None], dict[str, tuple[str, torch.Tensor]]] = defaultdict(dict)
    unmatched = []
    for key, tensor, maybe_wan in entries:
        split = _split_key(key)
        found = targets.resolve(split[0], wan=maybe_wan) if split else None
        if found is None:
            unmatched.append(key)
            continue
        if split[1] in groups[found]:
            raise LoraFormatError(f"LoRA keys {groups[found][split[1]][0]!r} and {key!r} both give the "
                                  f"{split[1]} of {found[0]}")
        groups[found][split[1]] = (key, tensor)
    if unmatched:
        _unmatched(unmatched, len(entries), module, via=via, refusal=refusal, strict=strict)
    elif refusal is not None:
        logger.info("Read the LoRA keys with our own grammar: %s", refusal)

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
    logger.info("Normalized %d LoRA keys into %d targets of %s (scale %s, wan naming: %s)%s",
                len(entries) - len(unmatched), len(deltas), type(module).__name__, scale, wan, via)
    return deltas


def _unmatched(keys: Sequence[str], total: int, module: nn.Module, *, via: str, refusal: str | None,
               strict: bool) -> None:
    """LoRA ``keys`` that match no module: an error naming them (strict), else a warning."""
    listing = ", ".join(keys[:20]) + (f" (and {len(keys) - 20} more)" if len(keys) > 20 else "")
    message = f"{len(keys)} of {total} LoRA keys{via} match no module of {type(module).__name__}: {listing}"
    if refusal is not None:
        message += f"; {refusal}"
    elif not diffusers_layouts.diffusers_available():
        message += (f"; diffusers, not installed here, converts more layouts (kohya / ComfyUI / XLabs FLUX, "
                    f"Z-Image and Qwen-Image original naming, ...): {diffusers_layouts.INSTALL_HINT}")
    if strict:
        raise UnmatchedLoraKeysError(message)
    logger.warning("%s; skipping them (strict=False)", message)


def _slice_delta(name: str, parts: dict, scale: float, config: Mapping | None) -> tuple:
    for kind, (key, tensor) in parts.items():
        _finite(key, tensor)
    keys = tuple(key for key, _ in parts.values())
    if any(kind.startswith(("lokr_", "hada_")) for kind in parts):
        bias = _scaled(parts["diff_b"][1], scale) if "diff_b" in parts else None
        return None, None, scale, bias, lycoris.factored_delta(name, parts, scale=scale, config=config), keys
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
            return lycoris.stack_rows(parts, outs)  # a LoKr / LoHa slice: kept factored
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
                                 f"({', '.join(delta.source_keys)})")
        if delta.B.shape[0] != shape[0] or delta.A.shape[1] != shape[1]:
            raise LoraShapeError(f"shape mismatch for {name}: B @ A is ({delta.B.shape[0]}, {delta.A.shape[1]}) "
                                 f"(A {tuple(delta.A.shape)}, B {tuple(delta.B.shape)}) but the weight is {shape} "
                                 f"({', '.join(delta.source_keys)})")
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
