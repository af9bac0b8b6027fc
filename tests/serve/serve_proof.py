"""The serving proof's machinery: a tiny Wan2.2 pipeline with two LoRAs and its diffusers-merged twin
(``vllm_diffusion_plugin.testing.serve_checkpoints``, shared with ``vllm-diffusion demo --serve``), the video
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
import struct
from dataclasses import dataclass
from pathlib import Path

from vllm_diffusion_plugin.testing.servers import (  # noqa: F401  (the proof's tests use them as sp.*)
    REPORT_PREFIX, VIDEO_FORM, ServerError, ServerRun, ServerSpec, bytes_per_rank, load_reports, refused_start,
    request_image, request_video, serve)
from vllm_diffusion_plugin.testing.serve_checkpoints import (  # noqa: F401  (moved there; shared with the demo)
    LORA_ALPHA, LORA_RANK, Checkpoints, build_checkpoints)

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
