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

from vllm_diffusion_plugin.engine.lora import UnmatchedLoraKeysError
from vllm_diffusion_plugin.testing.lora_layouts import (
    FAMILIES,
    FLUX_TOP_LEVEL_DIFFUSERS,
    LAYOUTS,
    build_model,
    write_layout,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
SCALE = 0.8


def diffusers_version() -> tuple[int, ...]:
    import diffusers

    return tuple(int(p) for p in diffusers.__version__.split(".")[:2])


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
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec
    from vllm_diffusion_plugin.engine.session import load_components

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
    if (family, layout) == ("qwen_image", "diffusers_alphas") and diffusers_version() < (0, 42):
        pytest.skip("diffusers 0.40's Qwen-Image converter drops the alphas of diffusers-named files (0.42 bakes "
                    "them in); ours applies alpha / rank (tests/omni/test_omni_serve_door.py's families test)")
    lora = tmp_path / f"{family}_{layout}.safetensors"
    written = write_layout(family, layout, lora)
    if diffusers_version() < LAYOUTS[family, layout][1]:  # its converter cannot read the layout: refused, saying so
        with pytest.raises(UnmatchedLoraKeysError, match=r"match no module of .*; diffusers [\d.]+ \w+LoraLoaderMixin"):
            ours_fused(checkpoints(family), lora)
        return
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
