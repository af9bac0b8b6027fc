"""The serving proof's machinery: a tiny Wan2.2 pipeline with two LoRAs and its diffusers-merged twin
(``vllm_diffusion_plugin.tiny.serve_checkpoints``, shared with ``vllm-diffusion demo --serve``), the video
the servers return decoded to frames, and frame distances; for the image families (``test_serve_images.py``)
one :class:`ImageCase` each, the folder diffusers merged (:func:`merge_with_diffusers`) and :class:`ImageProof`
(checkpoints, servers, distances, bytes per rank, summary). The servers themselves (one at a time, loopback,
bounded waits, stopped by process group) and the load-report lines come from
``vllm_diffusion_plugin.tools.servers``, shared with ``benchmarks/bench_serve_startup.py`` and
``vllm-diffusion demo --serve``.

Runs in an ``[omni]`` environment (vllm-omni 0.30, 0.31rc1 or 0.32rc1, each with its vLLM) on the CPU through this package's CPU platform
(``VLLM_DIFFUSION_OMNI_CPU=1``); on a GPU host the same servers run on the GPU when that variable is unset.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_diffusion_plugin.tools.servers import (  # noqa: F401  (the proof's tests use them as sp.*)
    REPORT_PREFIX, VIDEO_FORM, ServerError, ServerRun, ServerSpec, bytes_per_rank, load_reports, refused_start,
    request_image, request_video, serve)
from vllm_diffusion_plugin.tiny.serve_checkpoints import (  # noqa: F401  (moved there; shared with the demo)
    LORA_ALPHA, LORA_RANK, Checkpoints, build_checkpoints, save_fused_dit)

ENABLED = os.environ.get("VLLM_DIFFUSION_SERVE_PROOF", "").strip().lower() in ("1", "true", "yes", "on")
DEVICE = os.environ.get("VLLM_DIFFUSION_SERVE_PROOF_DEVICE", "auto")  # cpu | gpu | auto (gpu when CUDA works)
CPU = DEVICE == "cpu" or (DEVICE == "auto" and not torch.cuda.is_available())
"""The servers run on this package's CPU platform (``VLLM_DIFFUSION_OMNI_CPU=1``) unless CUDA works."""
READY_TIMEOUT_S = float(os.environ.get("VLLM_DIFFUSION_SERVE_READY_TIMEOUT_S", "600"))

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


# ---- the image families' proof (FLUX.1, Qwen-Image, Z-Image) ------------------------------------------------
@dataclass(frozen=True)
class ImageCase:
    """One image family's serving proof: its tiny folder, the LoRA layout its users download, the request, and
    the 2-rank weight-load strategies served."""

    family: str
    """``write_tiny_pipeline`` kind (``"flux"``, ``"qwen-image"``, ``"z-image"``)."""
    layout: tuple[str, str]
    """``testing.lora_layouts.write_layout``'s ``(family, layout)``."""
    body: dict
    """The ``/v1/images/generations`` request: fixed prompt, seed, size and steps."""
    hsdp: tuple[str, ...] = ()
    """The ``hsdp_weight_load`` strategies served at 2 ranks (``--use-hsdp --hsdp-shard-size 2``)."""
    server_args: tuple[str, ...] = ()
    """Arguments for every server of the case, the reference's included."""
    env: Mapping[str, str] = field(default_factory=dict)
    log_must_match: str = ""
    """A regular expression every server's log must match (e.g. the DiT size actually built)."""

    @property
    def size(self) -> tuple[int, int]:
        width, height = self.body["size"].split("x")
        return int(height), int(width)


def merge_with_diffusers(original: Path, lora: Path, out: Path, *, dit: str = "transformer") -> list[str]:
    """``out``: ``original`` with ``lora`` fused into its DiT by diffusers itself, as a user of the pipeline
    would: ``<Pipeline>.from_pretrained`` -> ``load_lora_weights`` -> ``fuse_lora`` -> ``unload_lora_weights``,
    the DiT saved in 4 shards, every other component copied. Returns the DiT's state-dict keys the LoRA changed."""
    import shutil

    import diffusers

    index = json.loads((original / "model_index.json").read_text())
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(original, torch_dtype=torch.float32)
    model = getattr(pipe, dit)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipe.load_lora_weights(str(lora))
    pipe.fuse_lora(components=[dit], lora_scale=1.0)
    pipe.unload_lora_weights()
    shutil.copytree(original, out, ignore=shutil.ignore_patterns(dit))
    return save_fused_dit(model, before, lora, out / dit)


class ImageProof:
    """One family's checkpoints (original folder, LoRA, diffusers-merged folder), its server runs so far, and the
    summary written at the end (``summary-<family>.json``)."""

    DIT = ("transformer",)

    def __init__(self, case: ImageCase, root: Path) -> None:
        from vllm_diffusion_plugin.testing.lora_layouts import write_layout
        from vllm_diffusion_plugin.tiny.models import write_tiny_pipeline

        self.t0 = time.monotonic()
        self.case, self.root = case, root
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        checkpoints = root / "checkpoints"
        self.original = write_tiny_pipeline(checkpoints / "original", case.family, runnable=True)
        self.lora = checkpoints / f"lora-{case.layout[1]}.safetensors"
        write_layout(*case.layout, self.lora)
        self.merged = checkpoints / "merged"
        self.changed = merge_with_diffusers(self.original, self.lora, self.merged)
        self.summary: dict = {"family": case.family, "lora_layout": case.layout[1], "request": case.body,
                              "build_s": round(time.monotonic() - self.t0, 1), "servers": {}, "distances": {},
                              "bytes_per_rank": {}, "dit_bytes": dit_bytes(self.original, self.DIT),
                              "fused_by_diffusers": len(self.changed)}
        self.runs: dict[str, ServerRun] = {}

    def serve(self, name: str, folder: Path, *, plugin: bool, args: tuple[str, ...] = (),
              requests: int = 1) -> ServerRun:
        if name not in self.runs:
            spec = ServerSpec(f"{self.case.family}-{name}", folder, plugin=plugin, env=self.case.env,
                              args=(*self.case.server_args, *args))
            run = serve(spec, self.logs, request=functools.partial(request_image, body=self.case.body),
                        requests=requests, cpu=CPU, ready_timeout_s=READY_TIMEOUT_S)
            self.runs[name] = run
            self.summary["servers"][name] = {"ready_s": round(run.ready_s, 1),
                                             "request_s": [round(s, 2) for s in run.request_s]}
            print(f"\n[{self.case.family} {name}] ready after {run.ready_s:.1f} s; requests {run.request_s}",
                  flush=True)
            if self.case.log_must_match and not re.search(self.case.log_must_match, run.log_text()):
                raise AssertionError(f"{run.log} does not match {self.case.log_must_match!r}")
        return self.runs[name]

    def reference(self) -> ServerRun:
        """vllm-omni's own load (plugin off) of the diffusers-merged folder; two requests."""
        return self.serve("reference", self.merged, plugin=False, requests=2)

    def ours(self, name: str, *extra: str, **options) -> ServerRun:
        """Our door on the original folder with the LoRA file (``options``: more ``diffusion_hsdp`` keys)."""
        config = {"diffusion_hsdp": {"lora_path": [f"transformer={self.lora}"], **options}}
        return self.serve(name, self.original, plugin=True, args=(
            "--load-format", "diffusion-hsdp", *extra, "--additional-config", json.dumps(config)))

    def distance(self, name: str, a: bytes, b: bytes) -> Distance:
        dist = distance(a, b, decode=decode_image)
        self.summary["distances"][name] = {"mean_abs": dist.mean_abs, "max_abs": dist.max_abs,
                                           "identical_bytes": dist.identical_bytes}
        print(f"\n[{self.case.family} distance] {name}: {dist}", flush=True)
        return dist

    def dit_reports(self, run: ServerRun, key: str) -> list[dict[str, str]]:
        """Our load reports of the DiT in ``run``'s log; bytes per rank recorded under ``key`` (the DiT's, and
        every weight source's we read, e.g. FLUX.1's T5 encoder under ``rank_local``)."""
        reports = load_reports(run.log_text())
        dits = [r for r in reports if r.get("component") in self.DIT]
        self.summary["bytes_per_rank"][key] = {"transformer": bytes_per_rank(dits),
                                               "all_sources": bytes_per_rank(reports)}
        print(f"\n[{self.case.family} bytes] {key}: {self.summary['bytes_per_rank'][key]} (DiT tensors "
              f"{self.summary['dit_bytes']} bytes)", flush=True)
        return dits

    def finish(self) -> Path:
        self.summary["stage_s"] = round(time.monotonic() - self.t0, 1)
        path = self.root / f"summary-{self.case.family}.json"
        write_summary(path, self.summary)
        print(f"\n[{self.case.family} summary] {path}\n{json.dumps(self.summary, indent=1)}", flush=True)
        return path


@contextlib.contextmanager
def unwind_on_sigterm():
    """Within: SIGTERM (a stage timeout) raises ``SystemExit``, so the running server's ``finally`` stops its
    process group instead of leaving it behind."""
    def _exit(signum, frame):
        raise SystemExit(f"terminated by signal {signum}")

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
