"""Every LoRA layout diffusers reads for Wan2.2, Qwen-Image, FLUX and Z-Image, fused by our load equal to
diffusers' own ``pipe.load_lora_weights(file)`` + ``pipe.fuse_lora()`` on the same tiny pipeline.

Each file is written key by key in a trainer's layout (the inverse of the diffusers converter that reads it)
and first checked to load back through diffusers' pipeline-level ``lora_state_dict``. Ours is the engine call
the CLI makes (``load_components`` with a ``LoraSpec``, reading a checkpoint diffusers saved); the oracle is the
diffusers pipeline built around the same transformer, fp32. Per tensor: ``max |ours - theirs| <= 1e-6 *
max |theirs|``, and the same set of changed tensors -- except kohya FLUX files' top-level modules, which
diffusers' converter emits without the ``transformer.`` prefix so that its own load skips them: ours fuses
them, and they equal diffusers' load of its converted dict with the prefix restored.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from safetensors.torch import save_file

from vllm_diffusion_plugin.testing.tiny_models import TINY_CONFIGS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

FAMILIES = {  # pipeline, transformer class, tiny config
    "wan": ("WanPipeline", "WanTransformer3DModel", TINY_CONFIGS["wan"]),
    "flux": ("FluxPipeline", "FluxTransformer2DModel", TINY_CONFIGS["flux"]),
    "qwen_image": ("QwenImagePipeline", "QwenImageTransformer2DModel", dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6))),
    "z_image": ("ZImagePipeline", "ZImageTransformer2DModel", dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=64, n_layers=1, n_refiner_layers=1, n_heads=2,
        n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 12, 12], axes_lens=[64, 32, 32])),
}
SCALE = 0.8
RANK = 4


def diffusers_version() -> tuple[int, ...]:
    import diffusers

    return tuple(int(p) for p in diffusers.__version__.split(".")[:2])


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


def write_layout(family: str, layout: str, path) -> dict[str, torch.Tensor]:
    w = Writer(seed=sorted(LAYOUTS).index((family, layout)))
    LAYOUTS[family, layout][0](w)
    save_file(w.sd, path)
    return w.sd


# ---- the tiny pipelines ---------------------------------------------------------------------------------------
def build_model(family: str, *, device: str = "cpu") -> torch.nn.Module:
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


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One checkpoint per family, saved by diffusers (built on first use)."""
    root, made = tmp_path_factory.mktemp("layouts"), {}

    def get(family: str):
        if family not in made:
            pipeline, cls_name, _ = FAMILIES[family]
            build_model(family).save_pretrained(root / family / "transformer", max_shard_size="200KB")
            index = {"_class_name": pipeline, "transformer": ["diffusers", cls_name]}
            (root / family / "model_index.json").write_text(json.dumps(index))
            made[family] = root / family
        return made[family]

    return get


def diffusers_pipeline(family: str, checkpoint):
    import diffusers

    pipeline_cls = getattr(diffusers, FAMILIES[family][0])
    transformer = getattr(diffusers, FAMILIES[family][1]).from_pretrained(checkpoint / "transformer")
    others = {n: None for n, p in inspect.signature(pipeline_cls.__init__).parameters.items()
              if n not in ("self", "transformer") and p.default is inspect.Parameter.empty}
    return pipeline_cls(transformer=transformer, **others)


def diffusers_fused(family: str, checkpoint, lora) -> dict[str, torch.Tensor]:
    """diffusers' own path: ``pipe.load_lora_weights`` + ``pipe.fuse_lora`` (then the LoRA layers unloaded)."""
    pipe = diffusers_pipeline(family, checkpoint)
    pipe.load_lora_weights(lora)
    pipe.fuse_lora(components=["transformer"], lora_scale=SCALE)
    pipe.unload_lora_weights()
    return {k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()}


def ours_fused(checkpoint, lora) -> dict[str, torch.Tensor]:
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.pipeline import LoraSpec, load_components

    loaded = load_components(checkpoint, options=LoadOptions(), components=["transformer"],
                             device=torch.device("cpu"), dtype=torch.float32, lora_specs=[LoraSpec(lora, SCALE)])
    return loaded.modules["transformer"].state_dict()


def changed(state: dict, base: dict) -> set[str]:
    return {k for k in base if not torch.equal(state[k], base[k])}


def assert_close_per_tensor(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for key, want in theirs.items():
        err = (ours[key].float() - want.float()).abs().max().item()
        assert err <= 1e-6 * want.float().abs().max().item(), (key, err)


# ---- the tests --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("family", "layout"), sorted(LAYOUTS))
def test_layout_fuses_equal_to_diffusers(family, layout, checkpoints, tmp_path):
    if diffusers_version() < LAYOUTS[family, layout][1]:
        pytest.skip(f"diffusers < {LAYOUTS[family, layout][1]} does not convert {family} {layout} LoRAs")
    lora = tmp_path / f"{family}_{layout}.safetensors"
    written = write_layout(family, layout, lora)
    pipeline_cls = type(diffusers_pipeline(family, checkpoints(family)))
    converted = pipeline_cls.lora_state_dict(str(lora))  # loads back through diffusers' own converter
    converted = converted[0] if isinstance(converted, tuple) else converted
    modules = dict(build_model(family, device="meta").named_modules())
    stems = {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in converted if ".lora_" in k}
    assert stems and stems <= set(modules), sorted(stems - set(modules))
    downs = sum(k.endswith(("down.weight", "lora_A.weight")) for k in written)
    assert sum(k.endswith("lora_A.weight") for k in converted) >= downs

    base = {k: v.clone() for k, v in build_model(family).state_dict().items()}
    ours, theirs = ours_fused(checkpoints(family), lora), diffusers_fused(family, checkpoints(family), str(lora))
    assert changed(theirs, base), "the oracle fused nothing"
    if (family, layout) != ("flux", "kohya"):
        assert changed(ours, base) == changed(theirs, base)
        assert_close_per_tensor(ours, theirs)
        return
    # kohya FLUX: diffusers' load skips the top-level modules its converter leaves unprefixed; ours fuses them
    top = {f"{m}.{p}" for m in FLUX_TOP_LEVEL_DIFFUSERS for p in ("weight", "bias")} & set(base)
    assert changed(ours, base) - changed(theirs, base) == {k for k in top if k.endswith(".weight")}
    assert not top & changed(theirs, base)
    prefixed = {k if k.startswith("transformer.") else f"transformer.{k}": v for k, v in converted.items()}
    assert_close_per_tensor(ours, diffusers_fused(family, checkpoints(family), prefixed))
