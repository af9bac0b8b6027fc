"""Proof in real servers for Z-Image: ``vllm serve DIR --omni --load-format diffusion-hsdp`` with a kohya-layout
LoRA (what Z-Image trainers such as ai-toolkit/musubi write: ``lora_unet_<module>`` keys, lora_down/up, alpha)
serves, on ``POST /v1/images/generations``, the image vllm-omni serves from the folder diffusers merged.

Skipped unless ``VLLM_DIFFUSION_SERVE_PROOF=1`` (run by ``.ci/omni-serve.sh`` in the ``[omni]`` environment), like
``test_serve_proof.py``. Servers start one at a time (each stopped before the next starts):

1. reference: the diffusers-merged folder (``ZImagePipeline.lora_state_dict`` -> ``load_lora_adapter`` ->
   ``fuse_lora`` -> ``save_pretrained`` in 4 shards), plugin off -- two requests (its distance to itself);
2. negative control: the original folder, plugin off -- must be far from the reference;
3. ours: the original folder, plugin on, ``--load-format diffusion-hsdp``, the LoRA in ``--additional-config``;
   our ``diffusion-hsdp load report:`` line must be in the log for the DiT (``transformer``), having read every
   DiT tensor byte once and fused the LoRA into the 29 linears diffusers fused.

The pipeline class. vllm-omni 0.30's own ``ZImagePipeline`` builds its DiT at Z-Image-Turbo's full size whatever
the folder says (``vllm_omni/diffusion/models/z_image/pipeline_z_image.py:228``), so a tiny folder cannot be
served by it as is. All three servers run ``z_image_pipeline.ConfigSizedZImagePipeline`` instead (vllm-omni's own
class, DiT sized from ``transformer/config.json``, nothing else changed) through vllm-omni's
``--custom-pipeline-args '{"pipeline_class": ...}'``. That is a fair proof of our door: the reference and ours
run the same class, the same text encoder, VAE, scheduler and ``load_weights`` (q/k/v and w1/w3 stacking); the
only difference is the load path -- vllm-omni's loader reading the diffusers-merged folder vs our load path
reading the original folder and fusing the LoRA file. Each log must show the tiny DiT being built (``dim=64``).

Tolerance (8-bit levels of the decoded PNG): ``MAX_MEAN_ABS`` 0.5 on the mean and ``MAX_ABS`` 8 on the largest
pixel difference, as the Wan2.2 proof. Why: our fusion and diffusers' are the same fp32 math up to summation order
(relative differences ~1e-7 in the weights; tests/test_lora_oracle.py holds them to 1e-5), three denoising steps
of a tiny DiT keep that far below one 8-bit level, and PNG is lossless (no codec amplification; the reference's
two requests give the same bytes). A rounding flip near a level boundary, amplified by the VAE decoder, may move a
few pixels by a few levels, hence a max of 8. The control (LoRA missing) must be at least ``CONTROL_FACTOR`` times
the mean tolerance away. Measured on a 2-core CPU host (2026-12-03): reference vs itself 0 (identical PNG bytes);
ours vs reference 0 (identical PNG bytes); control vs reference 39.1 mean, 227 max -- 78x the mean tolerance.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import serve_proof as sp
import torch

import vllm_diffusion_plugin

ENABLED = os.environ.get("VLLM_DIFFUSION_SERVE_PROOF", "").strip().lower() in ("1", "true", "yes", "on")
DEVICE = os.environ.get("VLLM_DIFFUSION_SERVE_PROOF_DEVICE", "auto")  # cpu | gpu | auto (gpu when CUDA works)
CPU = DEVICE == "cpu" or (DEVICE == "auto" and not torch.cuda.is_available())
READY_TIMEOUT_S = float(os.environ.get("VLLM_DIFFUSION_SERVE_READY_TIMEOUT_S", "600"))
MAX_MEAN_ABS, MAX_ABS, CONTROL_FACTOR = 0.5, 8, 10.0
FAMILY, LAYOUT = "z-image", "kohya"
PIPELINE_CLASS = "z_image_pipeline.ConfigSizedZImagePipeline"
IMAGE_BODY = {"prompt": "a red cat walks on the beach", "size": "64x64", "n": 1, "num_inference_steps": 3,
              "guidance_scale": 0.0, "seed": 1234}
"""Fixed seed and size (a multiple of 16: VAE 8x, DiT patch 2); Z-Image-Turbo's guidance 0 (no CFG)."""
TINY_DIT_LINE = re.compile(r"Z-Image init: dim=64 ")

pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(not ENABLED, reason="set VLLM_DIFFUSION_SERVE_PROOF=1 to start real vllm-omni servers"),
    pytest.mark.timeout(1200),
]


def build_checkpoints(root: Path) -> dict:
    """The tiny runnable Z-Image folder, the kohya LoRA for its DiT, and the folder with the LoRA merged by
    diffusers itself."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel

    from vllm_diffusion_plugin.testing.lora_layouts import write_layout
    from vllm_diffusion_plugin.testing.tiny_models import write_tiny_pipeline

    root.mkdir(parents=True, exist_ok=True)
    original = write_tiny_pipeline(root / "original", FAMILY, runnable=True)
    lora = root / f"lora-{LAYOUT}.safetensors"
    write_layout("z_image", LAYOUT, lora)
    merged = root / "merged"
    shutil.copytree(original, merged, ignore=shutil.ignore_patterns("transformer"))
    model = ZImageTransformer2DModel.from_pretrained(original / "transformer", torch_dtype=torch.float32).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_dict, metadata = ZImagePipeline.lora_state_dict(str(lora), return_lora_metadata=True)
    model.load_lora_adapter(state_dict, prefix="transformer", metadata=metadata)
    model.fuse_lora(lora_scale=1.0)
    model.unload_lora()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    if len(changed) < 20:
        raise sp.ServerError(f"diffusers fused {lora.name} into only {changed}: the reference would prove little")
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    model.save_pretrained(merged / "transformer", max_shard_size=max(sum(sizes) // 4, max(sizes)))
    return {"original": original, "merged": merged, "lora": lora, "fused_linears": len(changed)}


class Proof:
    def __init__(self, root: Path) -> None:
        self.t0 = time.monotonic()
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        t = time.monotonic()
        self.ckpt = build_checkpoints(root / "checkpoints")
        self.summary: dict = {"family": FAMILY, "lora_layout": LAYOUT, "request": IMAGE_BODY,
                              "build_s": round(time.monotonic() - t, 1), "servers": {}, "distances": {},
                              "bytes_per_rank": {}, "dit_bytes": sp.dit_bytes(self.ckpt["original"], ("transformer",)),
                              "tolerance": {"mean_abs": MAX_MEAN_ABS, "max_abs": MAX_ABS}}
        self.runs: dict[str, sp.ServerRun] = {}
        package_root = Path(vllm_diffusion_plugin.__file__).resolve().parents[1]  # as servers.server_env
        self.env = {"PYTHONPATH": os.pathsep.join(p for p in (str(package_root), str(Path(sp.__file__).parent),
                                                                 os.environ.get("PYTHONPATH")) if p)}
        """The workers import the test-only pipeline class from tests/serve (our package stays first)."""

    def serve(self, name: str, folder: Path, *, plugin: bool, args: tuple[str, ...] = (),
              requests: int = 1) -> sp.ServerRun:
        if name not in self.runs:
            spec = sp.ServerSpec(name, folder, plugin=plugin, env=self.env, args=(
                "--custom-pipeline-args", json.dumps({"pipeline_class": PIPELINE_CLASS}), *args))
            run = sp.serve(spec, self.logs, request=functools.partial(sp.request_image, body=IMAGE_BODY),
                           requests=requests, cpu=CPU, ready_timeout_s=READY_TIMEOUT_S)
            self.runs[name] = run
            self.summary["servers"][name] = {"ready_s": round(run.ready_s, 1),
                                             "request_s": [round(s, 2) for s in run.request_s]}
            print(f"\n[{name}] ready after {run.ready_s:.1f} s; requests {run.request_s}", flush=True)
            assert TINY_DIT_LINE.search(run.log_text()), f"{run.log} does not show the config-sized DiT being built"
        return self.runs[name]

    def record(self, name: str, dist: sp.Distance) -> sp.Distance:
        self.summary["distances"][name] = {"mean_abs": dist.mean_abs, "max_abs": dist.max_abs,
                                           "identical_bytes": dist.identical_bytes}
        print(f"\n[distance] {name}: {dist}", flush=True)
        return dist

    def reference(self) -> sp.ServerRun:
        return self.serve("reference", self.ckpt["merged"], plugin=False, requests=2)


@pytest.fixture(scope="module")
def proof(tmp_path_factory) -> Proof:
    base = os.environ.get("VLLM_DIFFUSION_SERVE_PROOF_DIR")
    root = Path(base) / FAMILY if base else tmp_path_factory.mktemp(f"serve-{FAMILY}")
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # unwind so the running server is stopped
    proof = Proof(root)
    yield proof
    signal.signal(signal.SIGTERM, previous)
    proof.summary["stage_s"] = round(time.monotonic() - proof.t0, 1)
    sp.write_summary(root / f"summary-{FAMILY}.json", proof.summary)
    print(f"\n[summary] {root / f'summary-{FAMILY}.json'}\n{json.dumps(proof.summary, indent=1)}", flush=True)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(f"terminated by signal {signum}")


def test_reference_repeats_itself(proof):
    ref = proof.reference()
    dist = proof.record("reference vs itself", sp.distance(ref.answers[0], ref.answers[1], decode=sp.decode_image))
    assert dist.mean_abs <= MAX_MEAN_ABS / 10 and dist.max_abs <= 1, dist
    assert sp.decode_image(ref.answers[0]).shape == (1, 64, 64, 3)


def test_negative_control_differs_clearly(proof):
    control = proof.serve("control", proof.ckpt["original"], plugin=False)
    dist = proof.record("control (no LoRA) vs reference",
                        sp.distance(control.answers[0], proof.reference().answers[0], decode=sp.decode_image))
    assert dist.mean_abs >= CONTROL_FACTOR * MAX_MEAN_ABS, (
        f"the LoRA moves the image by only {dist}: the comparison with the reference would prove nothing")


def test_ours_serves_the_merged_image(proof):
    lora = json.dumps({"diffusion_hsdp": {"lora_path": [f"transformer={proof.ckpt['lora']}"]}})
    run = proof.serve("ours", proof.ckpt["original"], plugin=True, args=(
        "--load-format", "diffusion-hsdp", "--additional-config", lora))
    reports = sp.load_reports(run.log_text())
    dit = [r for r in reports if r.get("component") == "transformer"]
    proof.summary["bytes_per_rank"]["1 rank"] = {"transformer": sp.bytes_per_rank(dit),
                                                 "all components": sp.bytes_per_rank(reports)}
    proof.summary["load_reports"] = reports
    assert len(dit) == 1, f"no load report of our load path for the DiT in {run.log}: the flag did not reach it"
    assert int(dit[0]["bytes_read"]) == proof.summary["dit_bytes"], dit
    assert int(dit[0]["lora_targets"]) == proof.ckpt["fused_linears"], (dit, proof.ckpt["fused_linears"])
    dist = proof.record("ours vs reference",
                        sp.distance(run.answers[0], proof.reference().answers[0], decode=sp.decode_image))
    assert dist.mean_abs <= MAX_MEAN_ABS and dist.max_abs <= MAX_ABS, (
        f"ours is {dist} from the diffusers-merged reference (tolerance mean {MAX_MEAN_ABS}, max {MAX_ABS}); "
        f"log {run.log}")
