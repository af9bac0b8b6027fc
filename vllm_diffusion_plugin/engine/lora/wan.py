"""Wan / LightX2V LoRA names: ``diffusion_model.*`` keys in original Wan naming (``blocks.N.self_attn.q``,
``ffn.0``, ``head.head``, ...), with ``lora_down/lora_up`` or ``lora_A/lora_B``, ``.alpha``, ``.diff_b`` (bias
deltas) and ``.diff`` (full deltas), renamed to diffusers ``WanTransformer3DModel`` names.

With diffusers installed, the ``B @ A`` part of these files is converted by diffusers' own
``WanLoraLoaderMixin.lora_state_dict`` (``diffusers_layouts``); this table renames what that converter drops
(``.diff`` keys, norm deltas) or never sees (every ``.diff`` / ``.diff_b`` key stays ours), and is the whole path
without diffusers. It is checked against diffusers' ``convert_wan_transformer_to_diffusers`` in tests. A leaf:
it imports nothing of this package.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_WAN_HINT = re.compile(  # tokens only original Wan naming has (dotted, or underscored as in kohya keys)
    r"blocks[._]\d+[._](self_attn|cross_attn)[._](q|k|v|o|k_img|v_img|norm_q|norm_k)([._]|$)"
    r"|blocks[._]\d+[._]ffn[._][02]([._]|$)|(^|[._])head[._]head([._]|$)"
    r"|(^|[._])(text_embedding|time_embedding)[._][02]([._]|$)|(^|[._])time_projection[._]1([._]|$)")


def _wan_table() -> list[tuple[str, str]]:
    """(original Wan name, diffusers WanTransformer3DModel name); ``{i}`` is a block index."""
    table = [("blocks.{i}.ffn.0", "blocks.{i}.ffn.net.0.proj"), ("blocks.{i}.ffn.2", "blocks.{i}.ffn.net.2"),
             ("blocks.{i}.norm3", "blocks.{i}.norm2"), ("blocks.{i}.norm2", "blocks.{i}.norm3"),
             ("blocks.{i}.modulation", "blocks.{i}.scale_shift_table"),
             ("blocks.{i}.cross_attn.k_img", "blocks.{i}.attn2.add_k_proj"),
             ("blocks.{i}.cross_attn.v_img", "blocks.{i}.attn2.add_v_proj"),
             ("blocks.{i}.cross_attn.norm_k_img", "blocks.{i}.attn2.norm_added_k"),
             ("head.head", "proj_out"), ("head.modulation", "scale_shift_table"),
             ("time_projection.1", "condition_embedder.time_proj"),
             ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
             ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
             ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
             ("img_emb.proj.4", "condition_embedder.image_embedder.norm2")]
    for ours, theirs in (("self_attn", "attn1"), ("cross_attn", "attn2")):
        for o, d in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"), ("norm_q", "norm_q"),
                     ("norm_k", "norm_k")):
            table.append((f"blocks.{{i}}.{ours}.{o}", f"blocks.{{i}}.{theirs}.{d}"))
    for ours, theirs in (("text_embedding", "text_embedder"), ("time_embedding", "time_embedder")):
        for n, d in (("0", "linear_1"), ("2", "linear_2")):
            table.append((f"{ours}.{n}", f"condition_embedder.{theirs}.{d}"))
    return table


def _compile(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)"))


_WAN_FORWARD = [(_compile(w), d) for w, d in _wan_table()]
_WAN_BACKWARD = [(_compile(d), w) for w, d in _wan_table()]


def _rename(name: str, rules: list[tuple[re.Pattern, str]]) -> str:
    for pattern, template in rules:
        m = pattern.fullmatch(name)
        if m:
            return template.replace("{i}", m.group("i")) if "{i}" in template else template
    return name


def wan_to_diffusers_name(name: str) -> str:
    """Original Wan module/parameter path -> diffusers ``WanTransformer3DModel`` path (identity if unknown)."""
    return _rename(name, _WAN_FORWARD)


def diffusers_to_wan_name(name: str) -> str:
    """Inverse of ``wan_to_diffusers_name``."""
    return _rename(name, _WAN_BACKWARD)


def uses_wan_naming(paths: Iterable[str]) -> bool:
    """Whether any module path (prefixes already stripped) carries a token only original Wan naming has."""
    return any(_WAN_HINT.search(path) for path in paths)
