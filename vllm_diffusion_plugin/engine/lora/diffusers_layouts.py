"""LoRA layouts diffusers converts: through the ``lora_state_dict`` of the target's own diffusers LoRA mixin.

diffusers keeps one converter per trainer layout (``diffusers.loaders.lora_conversion_utils``: kohya / ComfyUI /
XLabs FLUX, original Wan / LightX2V and musubi-tuner, Qwen-Image and Z-Image original naming, ...), chosen by
each pipeline's LoRA mixin (``FluxLoraLoaderMixin.lora_state_dict`` ...). ``lora_mixin`` finds that mixin from
the target module's class, ``convert`` runs it on a file's tensors and returns diffusers/PEFT keys
(``transformer.<module>.lora_A.weight`` / ``lora_B.weight`` / ``lora_B.bias``, and ``.alpha`` entries where the
converter returns them apart instead of baking them into ``A`` and ``B``), which ``normal``'s grammar reads.

diffusers is imported lazily (the ``cli``, ``test`` and ``omni`` extras install it); without it ``lora_mixin``
returns None and the dispatch reads the file with its own grammar. A leaf: it imports only ``types``.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Mapping

import torch

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.lora.types import LoraConversionError

logger = init_logger(__name__)

__all__ = ["INSTALL_HINT", "convert", "diffusers_available", "lora_mixin"]

INSTALL_HINT = 'pip install "vllm-diffusion-plugin[cli]"'
_CLASS_STEM = re.compile(r"(?P<stem>[A-Za-z0-9]+?)Transformer(?:\d+D)?(?:Model)?")
_CAMEL_WORD = re.compile(r"[A-Z][a-z]*\d*|[a-z]+\d*|\d+")
_DOWN = re.compile(r"(?:lora_A|lora_down|[._]down)\.weight$")  # the rank-side factor, in every layout diffusers reads


def _lora_pipeline():
    """diffusers' ``loaders.lora_pipeline`` (the LoRA mixins), or None without diffusers."""
    try:
        return importlib.import_module("diffusers.loaders.lora_pipeline")
    except ImportError:
        return None


def diffusers_available() -> bool:
    """Whether diffusers' LoRA loaders import (they carry the converters)."""
    return _lora_pipeline() is not None


def lora_mixin(module_class: type) -> type | None:
    """The diffusers LoRA loader mixin whose ``lora_state_dict`` reads LoRAs for ``module_class``, or None.

    diffusers names each mixin after the transformer it loads into: ``<Stem>Transformer<N>DModel`` (Flux,
    Wan, QwenImage, ZImage, HunyuanVideo, ...) -> ``<Stem>LoraLoaderMixin``; a variant class shares its base
    family's mixin (``WanVACETransformer3DModel`` -> ``WanLoraLoaderMixin``), so the longest leading run of the
    stem's CamelCase words that names a mixin wins. None without diffusers or for a class no mixin serves.
    """
    found = _CLASS_STEM.fullmatch(module_class.__name__)
    if found is None:
        return None
    lora_pipeline = _lora_pipeline()
    if lora_pipeline is None:
        return None
    words = _CAMEL_WORD.findall(found["stem"])
    for n in range(len(words), 0, -1):
        mixin = getattr(lora_pipeline, "".join(words[:n]) + "LoraLoaderMixin", None)
        if isinstance(mixin, type) and issubclass(mixin, lora_pipeline.LoraBaseMixin):
            return mixin
    return None


def convert(state_dict: Mapping[str, torch.Tensor], mixin: type) -> dict[str, torch.Tensor]:
    """``state_dict`` in diffusers/PEFT keys, as ``mixin.lora_state_dict`` converts it (a copy; input untouched).

    Alphas the mixin returns apart (FLUX files in diffusers naming) come back as ``<module>.alpha`` keys, so
    ``scale = alpha / rank`` applies exactly as in diffusers' own load; converters that bake ``alpha / rank`` into
    ``A`` and ``B`` leave none. A refusal, or a result with fewer rank-side factors than the input had (a
    converter that dropped a layout it does not read), is a ``LoraConversionError`` naming the first keys.
    """
    import diffusers

    where = f"diffusers {diffusers.__version__} {mixin.__name__}.lora_state_dict"
    keys = list(state_dict)
    listing = ", ".join(keys[:5]) + (f" (and {len(keys) - 5} more)" if len(keys) > 5 else "")
    kwargs = {"return_alphas": True} if "return_alphas" in inspect.signature(mixin.lora_state_dict).parameters else {}
    try:
        out = mixin.lora_state_dict(dict(state_dict), **kwargs)
    except Exception as exc:  # the converters raise ValueError, KeyError, IndexError ... on layouts they do not read
        said = " ".join(str(exc).split())  # one line, however diffusers formats it
        said = said if len(said) <= 300 else said[:300] + " ..."
        raise LoraConversionError(f"{where} cannot convert these keys ({type(exc).__name__}: {said}); "
                                  f"first keys: {listing}") from exc
    converted, alphas = (out[0], out[1] if kwargs else None) if isinstance(out, tuple) else (out, None)
    converted = dict(converted) | {key: torch.as_tensor(value) for key, value in (alphas or {}).items()}
    before = sum(1 for k in keys if _DOWN.search(k))
    after = sum(1 for k in converted if _DOWN.search(k))
    if after < before:
        raise LoraConversionError(f"{where} kept {after} of the {before} lora_down/lora_A "
                                  f"factors (it drops a layout it does not convert); first keys: {listing}")
    logger.debug("%s converted %d LoRA keys into %d", where, len(keys), len(converted))
    return converted
