"""LoRA files in the layouts trainers write, for tiny Wan2.2, FLUX, Qwen-Image and Z-Image transformers.

Each layout is written key by key as its trainer writes it -- the inverse of the diffusers converter that reads
it (``diffusers.loaders.lora_conversion_utils``) -- with seeded ``lora_down`` / ``lora_up`` pairs and alphas, so
tests can check that diffusers' own ``lora_state_dict`` reads it back and that our load fuses it equal to
diffusers' ``load_lora_weights`` + ``fuse_lora``. ``LAYOUTS`` maps ``(family, layout)`` to its writer and the
oldest diffusers that converts it. Needs diffusers (the ``cli`` or ``test`` extra).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm_diffusion_plugin.tiny.models import TINY_CONFIGS

__all__ = ["FAMILIES", "FLUX_TOP_LEVEL_DIFFUSERS", "LAYOUTS", "build_model", "write_layout"]

FAMILIES = {  # pipeline, transformer class, tiny config
    "wan": ("WanPipeline", "WanTransformer3DModel", TINY_CONFIGS["wan"]),
    "flux": ("FluxPipeline", "FluxTransformer2DModel", TINY_CONFIGS["flux"]),
    "qwen_image": ("QwenImagePipeline", "QwenImageTransformer2DModel", TINY_CONFIGS["qwen-image"]),
    "z_image": ("ZImagePipeline", "ZImageTransformer2DModel", TINY_CONFIGS["z-image"]),
}
RANK = 4


# ---- the layouts, written as trainers write them -----------------------------------------------------------
class Writer:
    """Seeded ``lora_down`` / ``lora_up`` pairs (and alphas) under any key spelling."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.sd: dict[str, torch.Tensor] = {}

    def rnd(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * 0.3

    def pair(self, base: str, out_f: int, in_f: int, *, down: str = ".lora_down.weight",
             up: str = ".lora_up.weight", alpha: float | None = None) -> None:
        self.sd[base + down] = self.rnd(RANK, in_f)
        self.sd[base + up] = self.rnd(out_f, RANK)
        if alpha is not None:
            self.sd[f"{base}.alpha"] = torch.tensor(alpha)


def linears(family: str, wanted) -> dict[str, tuple[int, int]]:
    """(out, in) of the tiny transformer's linears whose name passes ``wanted``."""
    model = build_model(family, device="meta")
    return {n: tuple(m.weight.shape) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and wanted(n)}


FLUX_ORIGINAL = {  # original FLUX (BFL) module -> (out, in) at the tiny config (inner 32, mlp 128)
    **{f"double_blocks.0.{s}_{m}": shape for s in ("img", "txt") for m, shape in (
        ("attn.qkv", (96, 32)), ("attn.proj", (32, 32)), ("mlp.0", (128, 32)), ("mlp.2", (32, 128)),
        ("mod.lin", (192, 32)))},
    "single_blocks.0.linear2": (32, 160), "single_blocks.0.modulation.lin": (96, 32),
}  # not single_blocks.N.linear1: diffusers splits it at FLUX.1's widths (3072 x 3 + 12288), not the config's
FLUX_TOP_LEVEL = {"img_in": (32, 4), "txt_in": (32, 32), "time_in.in_layer": (32, 256),
                  "time_in.out_layer": (32, 32), "vector_in.in_layer": (32, 32), "vector_in.out_layer": (32, 32),
                  "final_layer.linear": (4, 32), "final_layer.adaLN_modulation.1": (64, 32)}
FLUX_TOP_LEVEL_DIFFUSERS = ("x_embedder", "context_embedder", "time_text_embed.timestep_embedder.linear_1",
                            "time_text_embed.timestep_embedder.linear_2", "time_text_embed.text_embedder.linear_1",
                            "time_text_embed.text_embedder.linear_2", "proj_out", "norm_out.linear")


def flux_kohya(w: Writer) -> None:
    for name, (o, i) in (FLUX_ORIGINAL | FLUX_TOP_LEVEL).items():
        w.pair("lora_unet_" + name.replace(".", "_"), o, i, alpha=2.0)


def flux_comfyui(w: Writer) -> None:
    for name, (o, i) in FLUX_ORIGINAL.items():
        w.pair("diffusion_model." + name, o, i, alpha=8.0)


def flux_xlabs(w: Writer) -> None:
    for proc, (o, i) in {"qkv_lora1": (96, 32), "qkv_lora2": (96, 32), "proj_lora1": (32, 32),
                         "proj_lora2": (32, 32)}.items():
        w.pair(f"double_blocks.0.processor.{proc}", o, i, down=".down.weight", up=".up.weight")
    for proc, (o, i) in {"qkv_lora": (96, 32), "proj_lora": (32, 160)}.items():
        w.pair(f"single_blocks.0.processor.{proc}", o, i, down=".down.weight", up=".up.weight")


def flux_diffusers_alphas(w: Writer) -> None:  # diffusers naming with kohya-style alphas (TheLastBen's files)
    for name, (o, i) in linears("flux", lambda n: "blocks.0." in n and "attn." in n).items():
        w.pair(f"transformer.{name}", o, i, down=".lora_A.weight", up=".lora_B.weight", alpha=2.0)


WAN_ORIGINAL = {**{f"blocks.{b}.{a}.{p}": (24, 24) for b in range(2) for a in ("self_attn", "cross_attn")
                   for p in "qkvo"},
                **{f"blocks.{b}.ffn.{n}": shape for b in range(2) for n, shape in (("0", (32, 24)), ("2", (24, 32)))}}


def wan_lightx2v(w: Writer) -> None:
    for name, (o, i) in WAN_ORIGINAL.items():
        w.pair("diffusion_model." + name, o, i, alpha=8.0)
        w.sd[f"diffusion_model.{name}.diff_b"] = w.rnd(o)
    for name, (o, i) in {"head.head": (16, 24), "text_embedding.0": (24, 16), "text_embedding.2": (24, 24),
                         "time_embedding.0": (24, 32), "time_embedding.2": (24, 24)}.items():
        w.pair("diffusion_model." + name, o, i)
    w.sd["diffusion_model.head.head.diff_b"] = w.rnd(16)


def wan_musubi(w: Writer) -> None:
    for name, (o, i) in WAN_ORIGINAL.items():
        w.pair("lora_unet_" + name.replace(".", "_"), o, i, alpha=2.0)


def qwen_original(w: Writer) -> None:
    for name, (o, i) in linears("qwen_image", lambda n: "norm" not in n).items():
        w.pair("diffusion_model." + name, o, i, alpha=8.0)


def qwen_kohya(w: Writer) -> None:
    for name, (o, i) in linears("qwen_image", lambda n: True).items():
        w.pair("lora_unet_" + name.replace(".", "_"), o, i, alpha=2.0)


def qwen_diffusers_alphas(w: Writer) -> None:  # ai-toolkit: diffusers names, no prefix, with alphas
    for name, (o, i) in linears("qwen_image", lambda n: n.startswith("transformer_blocks.")).items():
        w.pair(name, o, i, down=".lora_A.weight", up=".lora_B.weight", alpha=8.0)


def z_image_original(w: Writer) -> None:
    for name, (o, i) in linears("z_image", lambda n: True).items():
        w.pair("diffusion_model." + name, o, i, alpha=8.0)


def z_image_kohya(w: Writer) -> None:
    for name, (o, i) in linears("z_image", lambda n: True).items():
        w.pair("lora_unet_" + name.replace(".", "_"), o, i, alpha=2.0)


def z_image_fused(w: Writer) -> None:  # Z-Image's original module tree: attention.qkv / attention.out
    for block in ("layers_0", "noise_refiner_0", "context_refiner_0"):
        w.pair(f"lora_unet_{block}_attention_qkv", 192, 64, alpha=2.0)
        w.pair(f"lora_unet_{block}_attention_out", 64, 64, alpha=2.0)
    for name, (o, i) in linears("z_image", lambda n: "feed_forward" in n).items():
        w.pair("lora_unet_" + name.replace(".", "_"), o, i, alpha=2.0)


LAYOUTS = {  # (family, layout) -> (writer, oldest diffusers that converts it)
    ("flux", "kohya"): (flux_kohya, (0, 40)),
    ("flux", "comfyui"): (flux_comfyui, (0, 40)),
    ("flux", "xlabs"): (flux_xlabs, (0, 40)),
    ("flux", "diffusers_alphas"): (flux_diffusers_alphas, (0, 40)),
    ("wan", "lightx2v"): (wan_lightx2v, (0, 40)),
    ("wan", "musubi"): (wan_musubi, (0, 40)),
    ("qwen_image", "original"): (qwen_original, (0, 40)),
    ("qwen_image", "kohya"): (qwen_kohya, (0, 40)),
    ("qwen_image", "diffusers_alphas"): (qwen_diffusers_alphas, (0, 40)),
    ("z_image", "original"): (z_image_original, (0, 40)),
    ("z_image", "kohya"): (z_image_kohya, (0, 40)),
    ("z_image", "fused_qkv"): (z_image_fused, (0, 42)),
}


def write_layout(family: str, layout: str, path: Path) -> dict[str, torch.Tensor]:
    """Write the ``layout`` LoRA file for ``family``'s tiny transformer at ``path``; returns its tensors."""
    w = Writer(seed=sorted(LAYOUTS).index((family, layout)))
    LAYOUTS[family, layout][0](w)
    save_file(w.sd, path)
    return w.sd


def build_model(family: str, *, device: str = "cpu") -> torch.nn.Module:
    """``family``'s tiny diffusers transformer, every parameter seeded random (on ``meta``: the skeleton only)."""
    import diffusers

    _, cls_name, config = FAMILIES[family]
    with torch.device(device):
        model = getattr(diffusers, cls_name)(**config)
    if device == "cpu":
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()
