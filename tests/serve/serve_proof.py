"""The serving proof's machinery: a tiny Wan2.2 pipeline with two LoRAs and its diffusers-merged twin, the video
the servers return decoded to frames, and frame distances. The servers themselves (one at a time, loopback,
bounded waits, stopped by process group) and the load-report lines come from
``vllm_diffusion_plugin.testing.servers``, shared with ``benchmarks/bench_serve_startup.py`` and
``vllm-diffusion demo --serve``.

Runs in the ``[omni]`` environment (vLLM 0.30 + vllm-omni 0.30) on the CPU through this package's CPU platform
(``VLLM_DIFFUSION_OMNI_CPU=1``); on a GPU host the same servers run on the GPU when that variable is unset.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_diffusion_plugin.testing.servers import (  # noqa: F401  (the proof's tests use them as sp.*)
    REPORT_PREFIX, VIDEO_FORM, ServerError, ServerRun, ServerSpec, bytes_per_rank, load_reports, refused_start,
    request_image, request_video, serve)

LORA_RANK, LORA_ALPHA = 4, 8.0


# ---- checkpoints ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Checkpoints:
    original: Path
    merged: Path
    """The same pipeline with both LoRAs fused by diffusers (``load_lora_adapter`` + ``fuse_lora``)."""
    lora_high: Path
    """diffusers/PEFT format (written by diffusers' ``save_lora_weights``), for ``transformer``."""
    lora_low: Path
    """Wan/LightX2V original naming (``diffusion_model.*``, lora_down/up, alpha, diff_b), for ``transformer_2``."""


def build_checkpoints(root: Path) -> Checkpoints:
    from vllm_diffusion_plugin.testing.tiny_models import write_tiny_pipeline

    root.mkdir(parents=True, exist_ok=True)
    original = write_tiny_pipeline(root / "original", "wan", runnable=True)
    lora_high = _write_peft_lora(original / "transformer", root / "lora_high")
    lora_low = _write_lightx2v_lora(original / "transformer_2", root / "lora_low.safetensors")
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

    from vllm_diffusion_plugin.engine.lora.wan import diffusers_to_wan_name

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
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    if len(changed) < 8:
        raise ServerError(f"diffusers fused {lora.name} into only {changed}: the reference would prove little")
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    model.save_pretrained(out, max_shard_size=max(sum(sizes) // 4, max(sizes)))


# ---- frames -----------------------------------------------------------------------------------------------
def decode_frames(mp4: bytes):
    """The video's frames as a uint8 array ``(frames, height, width, 3)`` (PyAV, installed with vllm-omni)."""
    import io

    import av
    import numpy as np

    with av.open(io.BytesIO(mp4)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    if not frames:
        raise ServerError("the mp4 holds no video frame")
    return np.stack(frames)


def decode_image(data: bytes):
    """An image (PNG/JPEG/WebP, as ``/v1/images/generations`` returns it) as a uint8 array ``(1, height, width,
    3)``, the shape :func:`decode_frames` gives a video (Pillow, installed with vllm-omni)."""
    import io

    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))[None]


@dataclass(frozen=True)
class Distance:
    """Between two decoded videos or images, in 8-bit levels."""

    mean_abs: float
    max_abs: int
    identical_bytes: bool

    def __str__(self) -> str:
        same = ", identical bytes" if self.identical_bytes else ""
        return f"mean |diff| {self.mean_abs:.3f}, max |diff| {self.max_abs}{same}"


def distance(a: bytes, b: bytes, *, decode=decode_frames) -> Distance:
    """The pixel distance of two answers decoded by ``decode`` (:func:`decode_frames` or :func:`decode_image`)."""
    fa, fb = decode(a), decode(b)
    if fa.shape != fb.shape:
        raise ServerError(f"decoded answers differ in shape: {fa.shape} vs {fb.shape}")
    diff = abs(fa.astype("int16") - fb.astype("int16"))
    return Distance(mean_abs=float(diff.mean()), max_abs=int(diff.max()), identical_bytes=a == b)


def dit_bytes(checkpoint: Path, components: tuple[str, ...] = ("transformer", "transformer_2")) -> int:
    """Tensor bytes of the DiT shards (``components``) in ``checkpoint``: each file's size less its safetensors
    header (what reading every tensor once reads)."""
    total = 0
    for path in (checkpoint / sub / name for sub in components
                 for name in os.listdir(checkpoint / sub) if name.endswith(".safetensors")):
        with open(path, "rb") as f:
            total += path.stat().st_size - 8 - struct.unpack("<Q", f.read(8))[0]
    return total


def write_summary(path: Path, summary: dict) -> None:
    path.write_text(json.dumps(summary, indent=1, default=str) + "\n")
