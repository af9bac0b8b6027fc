"""The serving proof's machinery: a tiny Wan2.2 pipeline with two LoRAs and its diffusers-merged twin, real
``vllm serve DIR --omni`` servers (one at a time, loopback, bounded waits, stopped by process group), the video
they return decoded to frames, frame distances, and the load-report lines of our load path.

Runs in the ``[omni]`` environment (vLLM 0.30 + vllm-omni 0.30) on the CPU through this package's CPU platform
(``VLLM_DIFFUSION_OMNI_CPU=1``); on a GPU host the same servers run on the GPU when that variable is unset.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The same video request for every server: fixed seed, 4 steps so that both experts run (flow shift 5 puts
# timesteps 1000, 937 above the 0.875 boundary -> transformer; 833, 625 below -> transformer_2).
VIDEO_FORM = {"prompt": "a red cat walks on the beach", "width": "32", "height": "32", "num_frames": "5",
              "num_inference_steps": "4", "guidance_scale": "1.0", "guidance_scale_2": "1.0",
              "boundary_ratio": "0.875", "seed": "1234", "fps": "8"}
REPORT_PREFIX = "diffusion-hsdp load report:"
"""The INFO line the vllm-omni door's load path writes per DiT and rank (``engine/report.py``,
``report_line``; tests/serve/test_proof_helpers.py checks the two agree)."""
LORA_RANK, LORA_ALPHA = 4, 8.0


class ServeProofError(RuntimeError):
    """The proof could not be run (a server did not start, a request failed); not a frame mismatch."""


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
        raise ServeProofError(f"diffusers fused {lora.name} into only {changed}: the reference would prove little")
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    model.save_pretrained(out, max_shard_size=max(sum(sizes) // 4, max(sizes)))


# ---- servers ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerSpec:
    name: str
    model: Path
    plugin: bool
    args: tuple[str, ...] = ()


@dataclass
class ServerRun:
    name: str
    command: list[str]
    log: Path
    ready_s: float = float("nan")
    """Launch to the first healthy ``/health``."""
    request_s: list[float] = field(default_factory=list)
    videos: list[bytes] = field(default_factory=list)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(*, plugin: bool, cpu: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION_")}
    repo = str(Path(__file__).resolve().parents[2])  # this checkout's package in every worker process
    env.update({"VLLM_DIFFUSION_PLUGIN": "1" if plugin else "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)})
    if cpu:
        # 2 CPU "devices" for the 2-rank servers even on a 1-core runner (the default is one per core)
        env |= {"VLLM_DIFFUSION_OMNI_CPU": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_DIFFUSION_OMNI_CPU_DEVICES": "2"}
    return env


def server_command(spec: ServerSpec, port: int, *, cpu: bool) -> list[str]:
    vllm = Path(sys.executable).with_name("vllm")
    cmd = [str(vllm), "serve", str(spec.model), "--omni", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--seed", "0"]
    return cmd + list(spec.args)


def _log_tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def stop(proc: subprocess.Popen, *, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``grace_s`` (it was started in its own session)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                proc.poll()
                return
            proc.poll()
            time.sleep(0.5)


def launch(spec: ServerSpec, logdir: Path, *, cpu: bool) -> tuple[subprocess.Popen, ServerRun, int]:
    port = free_port()
    run = ServerRun(name=spec.name, command=server_command(spec, port, cpu=cpu), log=logdir / f"{spec.name}.log")
    with open(run.log, "w") as log_file:
        proc = subprocess.Popen(run.command, env=server_env(plugin=spec.plugin, cpu=cpu), stdout=log_file,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, run, port


def serve(spec: ServerSpec, logdir: Path, *, requests: int = 1, cpu: bool = True, ready_timeout_s: float = 600.0,
          request_timeout_s: float = 300.0) -> ServerRun:
    """Start one server, wait until healthy, request the video ``requests`` times, stop it (always)."""
    proc, run, port = launch(spec, logdir, cpu=cpu)
    t0 = time.monotonic()
    try:
        while not _healthy(port):
            if proc.poll() is not None:
                raise ServeProofError(f"[{spec.name}] exited with status {proc.returncode} before becoming "
                                      f"healthy; log {run.log}:\n{_log_tail(run.log)}")
            if time.monotonic() - t0 > ready_timeout_s:
                raise ServeProofError(f"[{spec.name}] not healthy after {ready_timeout_s:.0f} s; log {run.log}:\n"
                                      f"{_log_tail(run.log)}")
            time.sleep(1.0)
        run.ready_s = time.monotonic() - t0
        for _ in range(requests):
            t1 = time.monotonic()
            run.videos.append(request_video(port, timeout_s=request_timeout_s, log=run.log))
            run.request_s.append(time.monotonic() - t1)
        return run
    finally:
        stop(proc)


def refused_start(spec: ServerSpec, logdir: Path, *, cpu: bool = True, timeout_s: float = 300.0) -> tuple[int, str, float]:
    """Start a server that must refuse to start: ``(exit status, log, seconds)``; raises if it became healthy
    or was still running after ``timeout_s``."""
    proc, run, port = launch(spec, logdir, cpu=cpu)
    t0 = time.monotonic()
    try:
        while proc.poll() is None:
            if _healthy(port):
                raise ServeProofError(f"[{spec.name}] became healthy; it should have refused to start. "
                                      f"Log {run.log}")
            if time.monotonic() - t0 > timeout_s:
                raise ServeProofError(f"[{spec.name}] neither refused nor started within {timeout_s:.0f} s; "
                                      f"log {run.log}:\n{_log_tail(run.log)}")
            time.sleep(1.0)
        return proc.returncode, run.log_text(), time.monotonic() - t0
    finally:
        stop(proc)


def request_video(port: int, *, timeout_s: float, log: Path) -> bytes:
    """``POST /v1/videos/sync`` (multipart form) -> the mp4 bytes."""
    boundary = uuid.uuid4().hex
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
                    for k, v in VIDEO_FORM.items()) + f"--{boundary}--\r\n".encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/videos/sync", data=body, method="POST",
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            data, content_type = resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        raise ServeProofError(f"/v1/videos/sync answered {e.code}: {e.read()[:2000]!r}\n{_log_tail(log)}") from e
    if "video/mp4" not in content_type or len(data) < 100:
        raise ServeProofError(f"/v1/videos/sync returned {content_type!r}, {len(data)} bytes")
    return data


# ---- frames -----------------------------------------------------------------------------------------------
def decode_frames(mp4: bytes):
    """The video's frames as a uint8 array ``(frames, height, width, 3)`` (PyAV, installed with vllm-omni)."""
    import io

    import av
    import numpy as np

    with av.open(io.BytesIO(mp4)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    if not frames:
        raise ServeProofError("the mp4 holds no video frame")
    return np.stack(frames)


@dataclass(frozen=True)
class Distance:
    """Between two decoded videos, in 8-bit levels."""

    mean_abs: float
    max_abs: int
    identical_bytes: bool

    def __str__(self) -> str:
        same = ", identical mp4 bytes" if self.identical_bytes else ""
        return f"mean |diff| {self.mean_abs:.3f}, max |diff| {self.max_abs}{same}"


def distance(a: bytes, b: bytes) -> Distance:
    fa, fb = decode_frames(a), decode_frames(b)
    if fa.shape != fb.shape:
        raise ServeProofError(f"decoded videos differ in shape: {fa.shape} vs {fb.shape}")
    diff = abs(fa.astype("int16") - fb.astype("int16"))
    return Distance(mean_abs=float(diff.mean()), max_abs=int(diff.max()), identical_bytes=a == b)


# ---- our load path's report lines -------------------------------------------------------------------------
_FIELD = re.compile(r"(\w+)=(\S+)")


def load_reports(log_text: str) -> list[dict[str, str]]:
    """Every ``diffusion-hsdp load report: key=value ...`` line of a server log, as a dict per line (the line is
    written by ``vllm_diffusion_plugin.engine.report.report_line``)."""
    reports = []
    for line in log_text.splitlines():
        _, sep, rest = line.partition(REPORT_PREFIX)
        if sep:
            reports.append(dict(_FIELD.findall(rest)))
    return reports


def bytes_per_rank(reports: list[dict[str, str]]) -> dict[int, int]:
    """DiT bytes read from the checkpoint by each rank, all components together."""
    per_rank: dict[int, int] = {}
    for report in reports:
        rank = int(report.get("rank", 0))
        per_rank[rank] = per_rank.get(rank, 0) + int(report.get("bytes_read", 0))
    return dict(sorted(per_rank.items()))


def dit_bytes(checkpoint: Path) -> int:
    """Tensor bytes of the DiT shards (transformer + transformer_2) in ``checkpoint``: each file's size less its
    safetensors header (what reading every tensor once reads)."""
    total = 0
    for path in (checkpoint / sub / name for sub in ("transformer", "transformer_2")
                 for name in os.listdir(checkpoint / sub) if name.endswith(".safetensors")):
        with open(path, "rb") as f:
            total += path.stat().st_size - 8 - struct.unpack("<Q", f.read(8))[0]
    return total


def write_summary(path: Path, summary: dict) -> None:
    path.write_text(json.dumps(summary, indent=1, default=str) + "\n")
