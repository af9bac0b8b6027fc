"""The tiny runnable Wan2.2 pipeline the serving proof and ``vllm-diffusion demo --serve`` serve: written by
diffusers/transformers themselves (``models.write_tiny_pipeline(runnable=True)``), one LoRA per transformer
in two formats (diffusers/PEFT for ``transformer``, Wan/LightX2V naming for ``transformer_2``), and for the proof
the same pipeline with both LoRAs fused by diffusers (``load_lora_adapter`` + ``fuse_lora``). Needs diffusers
and peft.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_diffusion_plugin.engine.lora.wan import diffusers_to_wan_name
from vllm_diffusion_plugin.tiny.models import write_tiny_pipeline

LORA_RANK, LORA_ALPHA = 4, 8.0


# ---- checkpoints ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoints:
    original: Path
    merged: Path | None
    """The same pipeline with both LoRAs fused by diffusers (``load_lora_adapter`` + ``fuse_lora``)."""
    lora_high: Path
    """diffusers/PEFT format (written by diffusers' ``save_lora_weights``), for ``transformer``."""
    lora_low: Path
    """Wan/LightX2V original naming (``diffusion_model.*``, lora_down/up, alpha, diff_b), for ``transformer_2``."""


def build_checkpoints(root: Path, *, merged: bool = True) -> Checkpoints:
    """The tiny runnable Wan2.2 pipeline under ``root/original``, its two LoRAs, and (``merged=True``) the
    diffusers-merged twin under ``root/merged`` (``merged=False``: that field is None)."""
    root.mkdir(parents=True, exist_ok=True)
    original = write_tiny_pipeline(root / "original", "wan", runnable=True)
    lora_high = _write_peft_lora(original / "transformer", root / "lora_high")
    lora_low = _write_lightx2v_lora(original / "transformer_2", root / "lora_low.safetensors")
    if not merged:
        return Checkpoints(original=original, merged=None, lora_high=lora_high, lora_low=lora_low)
    merged = root / "merged"
    shutil.copytree(original, merged, ignore=shutil.ignore_patterns("transformer", "transformer_2"))
    _save_fused(original / "transformer", lora_high, merged / "transformer")
    _save_fused(original / "transformer_2", lora_low, merged / "transformer_2")
    return Checkpoints(original=original, merged=merged, lora_high=lora_high, lora_low=lora_low)


def _load_dit(folder: Path):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.float32).eval()


def _write_peft_lora(transformer: Path, out: Path) -> Path:
    from diffusers import WanPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = _load_dit(transformer)
    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, init_lora_weights=False,
                        target_modules=["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"])
    model.add_adapter(config)
    gen = torch.Generator().manual_seed(21)
    layers = {k: torch.randn(v.shape, generator=gen) * 0.3 for k, v in get_peft_model_state_dict(model).items()}
    WanPipeline.save_lora_weights(out, transformer_lora_layers=layers, transformer_lora_adapter_metadata=config.to_dict())
    return out / "pytorch_lora_weights.safetensors"


def _write_lightx2v_lora(transformer: Path, out: Path) -> Path:
    """Keys in original Wan naming for every attention/FFN linear and the head (with a bias delta)."""
    from safetensors.torch import save_file

    model = _load_dit(transformer)
    gen = torch.Generator().manual_seed(22)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if not (name.startswith("blocks.") and ".attn" in name or ".ffn." in name or name == "proj_out"):
            continue
        base = f"diffusion_model.{diffusers_to_wan_name(name)}"
        tensors[f"{base}.lora_down.weight"] = torch.randn(LORA_RANK, module.in_features, generator=gen) * 0.3
        tensors[f"{base}.lora_up.weight"] = torch.randn(module.out_features, LORA_RANK, generator=gen) * 0.3
        if name == "proj_out":  # diffusers' converter reads no alpha for the head: scale 1 there
            tensors[f"{base}.diff_b"] = torch.randn(module.out_features, generator=gen) * 0.1
        else:
            tensors[f"{base}.alpha"] = torch.tensor(LORA_ALPHA)
    save_file(tensors, str(out))
    return out


def _save_fused(transformer: Path, lora: Path, out: Path) -> None:
    """diffusers' own path: pipeline-level ``lora_state_dict`` (converts the Wan naming) ->
    ``load_lora_adapter`` -> ``fuse_lora`` -> ``unload_lora`` -> ``save_pretrained`` in several shards."""
    from diffusers import WanPipeline

    model = _load_dit(transformer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_dict, metadata = WanPipeline.lora_state_dict(str(lora), return_lora_metadata=True)
    model.load_lora_adapter(state_dict, prefix="transformer", metadata=metadata)
    model.fuse_lora(lora_scale=1.0)
    model.unload_lora()
    save_fused_dit(model, before, lora, out)


def save_fused_dit(model: torch.nn.Module, before: dict[str, torch.Tensor], lora: Path, out: Path) -> list[str]:
    """Save ``model`` (a DiT diffusers fused ``lora`` into; ``before``: its state dict before) to ``out`` in 4
    shards; returns the state-dict keys the LoRA changed, refusing fewer than 8 (a reference that proves little)."""
    state = model.state_dict()
    changed = sorted(k for k, v in state.items() if not torch.equal(v, before[k]))
    if len(changed) < 8:
        raise RuntimeError(f"diffusers fused {lora.name} into only {changed}: the reference would prove little")
    sizes = [t.numel() * t.element_size() for t in state.values()]
    model.save_pretrained(out, max_shard_size=max(sum(sizes) // 4, max(sizes)))
    return changed
