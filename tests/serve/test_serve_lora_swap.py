"""Proof in real servers: the runtime LoRA update (``POST /v1/diffusion_hsdp/loras``) of a 2-rank
``vllm serve DIR --omni --load-format diffusion-hsdp`` server (``hsdp_weight_load=rank_local``, the tiny Wan2.2
pipeline) serves, after one swap, the same video bytes as a fresh server started with the new set.

Two servers, one at a time (each 60-90 s to ready on a 2-core host):

1. started with one LoRA (``transformer``'s) and ``lora_update_dirs`` = the folder of both LoRAs: a video; ``GET`` the
   set; a path outside that folder is refused (403), a LoRA of NaNs inside it too (400, by the engine, before any
   weight changed) and the server still serves the first video's bytes; the swap to both LoRAs (``transformer``'s at
   0.5, ``transformer_2``'s) answers 200 naming the new set; ``GET`` says so; a video;
2. started with the new set and no ``lora_update_dirs``: the route does not exist (404); a video.

The swapped server's second video must be byte-identical to the fresh server's, and differ from its own first one
(the swap changed what it serves). Skipped unless ``VLLM_DIFFUSION_SERVE_PROOF=1``; the figures (ready seconds, swap
seconds) go to ``summary-lora-swap.json`` under ``$VLLM_DIFFUSION_SERVE_PROOF_DIR/lora-swap/`` (or a tmp dir).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import serve_proof as sp
import torch
from safetensors.torch import load_file, save_file

CPU, READY_TIMEOUT_S = sp.CPU, sp.READY_TIMEOUT_S
ROUTE = "/v1/diffusion_hsdp/loras"

pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(not sp.ENABLED, reason="set VLLM_DIFFUSION_SERVE_PROOF=1 to start real vllm-omni servers"),
    pytest.mark.timeout(1200),
]


def call(port: int, method: str, body: dict | None = None, *, timeout_s: float = 300.0) -> tuple[int, dict]:
    """``method ROUTE`` on the server: (HTTP status, JSON answer), 4xx/5xx included."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{ROUTE}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def server_args(lora_path: list[str], **extra) -> tuple[str, ...]:
    config = {"diffusion_hsdp": {"lora_path": lora_path, "hsdp_weight_load": "rank_local", **extra}}
    return ("--load-format", "diffusion-hsdp", "--use-hsdp", "--hsdp-shard-size", "2",
            "--additional-config", json.dumps(config))


def test_a_swap_serves_the_bytes_of_a_fresh_server_with_the_new_set(tmp_path):
    base = os.environ.get("VLLM_DIFFUSION_SERVE_PROOF_DIR")
    root = Path(base) / "lora-swap" if base else tmp_path
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ckpt = sp.build_checkpoints(tmp_path / "ckpt", merged=False)
    build_s = time.monotonic() - t0
    folder = ckpt.lora_low.parent  # both LoRAs live under it
    old = [f"transformer={ckpt.lora_high}"]
    new = [f"transformer={ckpt.lora_high}@0.5", f"transformer_2={ckpt.lora_low}"]
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(ckpt.lora_low.read_bytes())
    tensors = load_file(ckpt.lora_low)
    nan = folder / "nan.safetensors"  # inside the allowed folder: refused by the engine, before any weight changes
    save_file({k: torch.full_like(v, float("nan")) for k, v in tensors.items()}, nan)
    seen: dict = {}

    def swap_between_videos(port: int, timeout_s: float, log: Path) -> bytes:
        seen["before"] = sp.request_video(port, timeout_s, log)
        seen["get_before"] = call(port, "GET")
        seen["outside"] = call(port, "POST", {"lora_path": [str(outside)]})
        seen["nan"] = call(port, "POST", {"lora_path": [f"transformer_2={nan}"]})
        seen["after_refusals"] = sp.request_video(port, timeout_s, log)
        t0 = time.monotonic()
        seen["swap"] = call(port, "POST", {"lora_path": new})
        seen["swap_wall_s"] = time.monotonic() - t0
        seen["get_after"] = call(port, "GET")
        return sp.request_video(port, timeout_s, log)

    def off_then_video(port: int, timeout_s: float, log: Path) -> bytes:
        seen["fresh_get"] = call(port, "GET")
        return sp.request_video(port, timeout_s, log)

    with sp.unwind_on_sigterm():  # a stage timeout stops the running server's process group
        swapped = sp.serve(sp.ServerSpec("lora-swap", ckpt.original, plugin=True,
                                         args=server_args(old, lora_update_dirs=[str(folder)])),
                           logs, request=swap_between_videos, cpu=CPU, ready_timeout_s=READY_TIMEOUT_S)
        fresh = sp.serve(sp.ServerSpec("lora-swap-fresh", ckpt.original, plugin=True, args=server_args(new)), logs,
                         request=off_then_video, cpu=CPU, ready_timeout_s=READY_TIMEOUT_S)

    status, current = seen["get_before"]
    assert status == 200 and [(x["component"], x["scale"]) for x in current["loras"]] == [("transformer", 1.0)], current
    status, refused = seen["outside"]
    assert status == 403 and "lora_update_dirs" in refused["error"]["message"], refused
    status, refused = seen["nan"]
    assert status == 400 and "nan.safetensors" in refused["error"]["message"], refused
    assert seen["after_refusals"] == seen["before"], "a refused update changed what the server serves"
    status, swap = seen["swap"]
    assert status == 200, swap
    described = sorted((x["component"], Path(x["path"]).name, x["scale"], len(x["sha256"])) for x in swap["loras"])
    assert described == [("transformer", ckpt.lora_high.name, 0.5, 64), ("transformer_2", ckpt.lora_low.name, 1.0, 64)]
    assert seen["get_after"] == (200, {"loras": swap["loras"]})
    assert seen["fresh_get"][0] == 404  # no lora_update_dirs: no route
    sp.write_summary(root / "summary-lora-swap.json", {  # .ci/omni-serve.sh prints every summary*.json
        "build_s": round(build_s, 1), "stage_s": round(time.monotonic() - t0, 1),
        "servers": {"lora-swap": {"ready_s": round(swapped.ready_s, 1), "swap_s": round(swap["seconds"], 3),
                                  "swap_wall_s": round(seen["swap_wall_s"], 3)},
                    "lora-swap-fresh": {"ready_s": round(fresh.ready_s, 1)}},
        "report": swap["report"]})
    print(f"lora swap: ready {swapped.ready_s:.1f} s / fresh {fresh.ready_s:.1f} s; swap {swap['seconds']:.2f} s on "
          f"rank 0 ({seen['swap_wall_s']:.2f} s wall); report {swap['report']}")
    assert swapped.videos[0] != seen["before"], "the swap changed nothing the server serves"
    assert swapped.videos[0] == fresh.videos[0], \
        f"after the swap the server serves other bytes than a fresh server with the new set: " \
        f"{sp.distance(swapped.videos[0], fresh.videos[0])}"
