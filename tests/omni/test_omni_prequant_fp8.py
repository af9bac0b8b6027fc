"""Pre-quantized ModelOpt FP8 checkpoints under ``--load-format diffusion-hsdp`` in vllm-omni (issue 37, part 2).

vllm-omni validates ModelOpt FP8 DiTs (Qwen-Image, Z-Image, FLUX.2): it builds its DiT with ModelOpt's FP8 layers
(an FP8 ``weight``, one ``weight_scale`` / ``input_scale`` per q/k/v part of a stacked ``to_qkv``) and reads the
checkpoint through its ``ModelOptFp8CheckpointAdapter``. Our door now reads the same checkpoint through our reader
(strict manifests, bytes per rank) and vllm-omni's adapter into the same layers, and fuses a LoRA exactly
(dequantize, add the deltas in fp32, requantize with a scale recomputed from the fused tensor); vllm-omni's own
distill fusion adds the delta to the FP8 parameter with no scale (``params.add_(delta.to(params.dtype))``), which
torch refuses: the load fails with "add_stub" not implemented for 'Float8_e4m3fn'.

A tiny runnable Qwen-Image pipeline written by diffusers, its transformer quantized as ModelOpt writes it
(``tests/test_prequant_fp8.quantize_folder``), loaded in-process by vllm-omni's ``DiffusersPipelineLoader`` on our
CPU platform. vLLM's ModelOpt post-processing (its requantization to one scale per stacked layer, its FP8 GEMM
layout) has no CPU kernel, so both loads are compared as ``load_weights`` leaves them: the loader's
``_process_weights_after_loading`` is skipped in both -- everything before it is vllm-omni's and ours, for real.

Before this change every ModelOpt FP8 checkpoint was refused at the worker ("is not carried").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from omni_support import import_omni, tensor_bytes

import_omni()  # skips this module where vllm-omni is not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_prequant_fp8 as fp8_files  # noqa: E402

from vllm_diffusion_plugin.tiny.fp8 import fused_fp8_copy  # noqa: E402

FP8 = torch.float8_e4m3fn
FORMATS = ("modelopt-fp8", "modelopt-fp8-per-channel")


def _quantize(root: Path, fmt: str, linears: set[str] | None = None) -> Path:
    """``root``'s transformer as ModelOpt writes it, every block linear FP8 (vllm-omni's Qwen-Image builds every
    block linear as FP8: the exclusion case is its own test)."""
    from vllm_diffusion_plugin.tiny.models import build_tiny_model

    folder = root / "transformer"
    every = {n for n, m in build_tiny_model("qwen-image").named_modules()
             if isinstance(m, torch.nn.Linear) and "blocks." in n}
    fp8_files.quantize_folder(folder, "qwen-image", fmt, every if linears is None else linears)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].pop("exclude_modules", None)
    (folder / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module", params=FORMATS)
def qwen_fp8(request, tmp_path_factory):
    from vllm_diffusion_plugin.tiny.models import write_tiny_pipeline

    base = tmp_path_factory.mktemp(request.param)
    root = _quantize(write_tiny_pipeline(base / "qwen-image", "qwen-image", runnable=True), request.param)
    lora = fp8_files.write_lora(base / "lora.safetensors", "qwen-image")
    second = fp8_files.write_lora(base / "lora2.safetensors", "qwen-image")
    return request.param, root, lora, second


def _load(folder: Path, config, *, ours: bool, options: dict | None = None, **stage):
    """vllm-omni's loader on ``folder`` as a diffusion worker runs it (ours: ``--load-format diffusion-hsdp``),
    its ``_process_weights_after_loading`` skipped (see the module docstring); returns (model, loader)."""
    from vllm.config.load import LoadConfig
    from vllm_omni.config.omni_config import extract_diffusion_stage_config_kwargs
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    fields = dict(model=str(folder), model_class_name="QwenImagePipeline", dtype="float32", **stage)
    if ours:
        fields.update(load_format="diffusion-hsdp", additional_config={"diffusion_hsdp": options or {}})
    od_config = OmniDiffusionConfig(**extract_diffusion_stage_config_kwargs(fields, stage_id=0))
    od_config.enrich_config()
    loader = DiffusersPipelineLoader(LoadConfig(), od_config=od_config)
    with set_forward_context(vllm_config=config, omni_diffusion_config=od_config):
        model = loader.load_model(load_device="cpu", load_format="default", device=torch.device("cpu"))
    return model, loader


@pytest.fixture
def no_post_processing(omni, monkeypatch):
    monkeypatch.setattr(omni.Loader, "_process_weights_after_loading", lambda self, model, device: None)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.transformer.named_parameters()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return fp8_files._bits(t)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert sorted(a) == sorted(b)
    return [n for n in a if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape
            or not torch.equal(_bits(a[n]), _bits(b[n]))]


def test_the_fp8_checkpoint_loads_as_vllm_omnis_own_load_does(omni_world, qwen_fp8, no_post_processing):
    _, root, _, _ = qwen_fp8
    theirs, _ = _load(root, omni_world, ours=False)
    mine, loader = _load(root, omni_world, ours=True)
    methods = {type(m.quant_method).__name__ for m in mine.transformer.modules()
               if getattr(m, "weight", None) is not None and m.weight.dtype == FP8}
    assert len(methods) == 1 and "ModelOpt" in next(iter(methods)) and "Cpu" not in next(iter(methods)), methods
    theirs, mine = _params(theirs), _params(mine)
    assert not _same(theirs, mine)
    assert sum(t.dtype == FP8 for t in mine.values()) >= 8
    report = loader._diffusion_hsdp_state["report"].components[0]
    assert report.bytes_read == tensor_bytes(root / "transformer")  # every tensor once, through our reader


def test_a_lora_is_fused_exactly_where_vllm_omnis_own_fusion_fails(omni_world, qwen_fp8, no_post_processing,
                                                                   tmp_path):
    """Two LoRA files on the same FP8 layers: ours equals vllm-omni's load of a checkpoint fused in one process on
    the whole tensors (both deltas summed in fp32, one requantization), bit for bit -- weights and scales; vllm-omni's
    own distill fusion of a LoRA into the same file fails."""
    fmt, root, lora, second = qwen_fp8
    reference = fused_fp8_copy(root, tmp_path / "reference", [lora, second])
    expected, _ = _load(reference, omni_world, ours=False)
    mine, loader = _load(root, omni_world, ours=True,
                         options={"lora_path": [f"transformer={lora}", f"transformer={second}"]})
    expected, mine = _params(expected), _params(mine)
    fused = [n for n in mine if n.endswith(".weight") and mine[n].dtype == FP8
             and not torch.equal(_bits(mine[n]), _bits(_params_of(root, omni_world)[n]))]
    assert fused, "no FP8 weight changed: the LoRA was not fused"
    assert not _same(expected, mine)
    report = loader._diffusion_hsdp_state["report"].components[0]
    rereads = _scale_bytes(root / "transformer", fp8_files.LORA_TARGETS["qwen-image"])
    print(f"\n[{fmt}] {report.lora_keys_fused} LoRA targets fused, {report.bytes_read} bytes read "
          f"({rereads} of them the targeted layers' scales, read first)")
    assert report.bytes_read == tensor_bytes(root / "transformer") + rereads

    # vllm-omni's own fusion (--lora-backend distill) of a LoRA on the same file: `params.add_(delta.to(fp8))`
    # (diffusion/lora/loader.py) -- torch has no FP8 add, so the load fails (the scale would be ignored anyway)
    from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora

    distill = write_tiny_lora(tmp_path / "distill.safetensors", build_tiny_model("qwen-image"), alpha=None, seed=7)
    with pytest.raises(NotImplementedError, match="not implemented for 'Float8_e4m3fn'"):
        _load(root, omni_world, ours=False, lora_backend="distill", lora_path=str(distill))


def _scale_bytes(folder: Path, targets) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys()
                         if k.endswith(".weight_scale") and k.removesuffix(".weight_scale").endswith(tuple(targets)))
    return total


_BASE: dict[Path, dict[str, torch.Tensor]] = {}


def _params_of(root: Path, config) -> dict[str, torch.Tensor]:
    if root not in _BASE:
        _BASE[root] = _params(_load(root, config, ours=False)[0])
    return _BASE[root]


def test_a_layer_the_checkpoint_keeps_unquantized_but_vllm_omni_builds_as_fp8_is_named(omni_world, no_post_processing,
                                                                                       tmp_path):
    """ModelOpt's ``exclude_modules`` keeps ``img_mlp.net.2`` in the load dtype; vllm-omni's Qwen-Image builds it as
    an FP8 layer anyway (the names it matches the exclusion against are not the checkpoint's): its own load casts
    the unquantized weight to FP8 and leaves the scale at its sentinel. Ours names the layers instead."""
    from vllm_diffusion_plugin.engine.errors import WeightLoadError
    from vllm_diffusion_plugin.tiny.models import write_tiny_pipeline

    root = write_tiny_pipeline(tmp_path / "qwen-image", "qwen-image", runnable=True)
    fp8_files.quantize_folder(root / "transformer", "qwen-image", "modelopt-fp8")  # with exclude_modules
    theirs, _ = _load(root, omni_world, ours=False)
    stale = {n: p for n, p in theirs.transformer.named_parameters() if n.endswith("img_mlp.net.2.weight_scale")}
    if not stale or not all(bool((p == torch.finfo(torch.float32).min).all()) for p in stale.values()):
        pytest.skip("this vllm-omni honours the exclusion: nothing to name")
    with pytest.raises(WeightLoadError, match=r"FP8 layer\(s\) of QwenImagePipeline got no weight_scale from the "
                                              r"checkpoint: transformer\.transformer_blocks\.0\.img_mlp\.net\.2"):
        _load(root, omni_world, ours=True)
