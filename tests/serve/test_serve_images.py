"""Proof in real servers for the image families -- FLUX.1, Qwen-Image, Z-Image: ``vllm serve DIR --omni
--load-format diffusion-hsdp`` with a LoRA in a layout that family's users download serves, on
``POST /v1/images/generations``, the image vllm-omni itself serves (plugin off) from the folder diffusers merged.

Skipped unless ``VLLM_DIFFUSION_SERVE_PROOF=1`` (run by ``.ci/omni-serve.sh`` with the Wan2.2 proof). Checkpoints,
logs and ``summary-<family>.json`` under ``$VLLM_DIFFUSION_SERVE_PROOF_DIR/<family>/`` (or a tmp dir).

Each folder is ``write_tiny_pipeline(DIR, family, runnable=True)``, written by diffusers and transformers (the DiT
in >= 3 shards + index, text encoders, tokenizers trained offline, VAE, scheduler), and served by vllm-omni's own
pipeline class with its own ``load_weights`` (q/k/v stacked into ``to_qkv`` / ``add_kv_proj``):

- FLUX.1: ComfyUI's layout (BFL names ``double_blocks`` / ``single_blocks``, fused ``qkv`` and the single block's
  ``linear1`` / ``linear2``, alphas). ``FluxPipeline`` reads its T5 encoder through the DiT loader (a second
  weight source vllm-omni does not shard): under ``rank_local`` each rank reads its rows of the DiT and the T5
  source whole (``doors/omni/rank_local.split_sources``).
- Qwen-Image: the kohya layout (``lora_unet_*``, every linear of both streams). ``QwenImagePipeline``'s
  dual-stream blocks stack q/k/v of the image stream and of the text stream (``add_kv_proj``): ``rank_local``
  traces each row of both back to its checkpoint tensor.
- Z-Image: the kohya layout (what ai-toolkit / musubi write for Z-Image). vllm-omni 0.30's ``ZImagePipeline``
  builds its DiT at Z-Image-Turbo's full size whatever the folder says, so every Z-Image server -- the reference
  and the control too -- runs ``z_image_pipeline.ConfigSizedZImagePipeline`` (vllm-omni's class, DiT sized from
  ``transformer/config.json``) through ``--custom-pipeline-args``; each log must show the tiny DiT being built.

Servers per family, one at a time: reference (merged folder, plugin off, two requests), control (original folder,
plugin off), ours (original folder + the LoRA through our door, 1 rank), and ours at 2 ranks (``--use-hsdp
--hsdp-shard-size 2``) with ``hsdp_weight_load=rank_local`` (each rank reads only its own rows of the DiT; the
Wan2.2 proof serves all three strategies at 2 ranks).

Tolerance (8-bit levels of the decoded PNG): ``MAX_MEAN_ABS`` 0.5 on the mean and ``MAX_ABS`` 4 on the largest
pixel difference. Why: our fusion and diffusers' are the same fp32 math up to summation order (relative weight
differences ~1e-7; tests/test_lora_oracle.py holds them to 1e-5); three or four steps of a one-block DiT and a
small VAE keep that far below half a level, and PNG is lossless (no codec to amplify a rounding flip), so only a
pixel sitting on a level boundary can move, by one level; 4 leaves room for a few such flips on another CPU's
kernels, and is still 1/30 of what a missing LoRA moves. The control (no LoRA) must be at least
``CONTROL_FACTOR`` times the mean tolerance away, so the comparison cannot pass by accident. Measured on a
2-core CPU host (2026-12-03): every reference vs itself, and ours vs the reference at 1 rank and at 2 ranks
``rank_local``, identical PNG bytes (distance 0) for all three families; the control 14.2 mean / 91 max levels
away (FLUX.1), 22.6 / 170 (Qwen-Image), 39.1 / 227 (Z-Image). Every run prints them (``omni-serve: [family]
distance ...``) and writes them to the summaries.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import serve_proof as sp

MAX_MEAN_ABS, MAX_ABS, CONTROL_FACTOR = 0.5, 4, 10.0
_PROMPT = "a red cat walks on the beach"
CASES = {
    "flux": sp.ImageCase(
        "flux", ("flux", "comfyui"), hsdp=("rank_local",),
        body={"prompt": _PROMPT, "size": "32x32", "n": 1, "num_inference_steps": 4, "guidance_scale": 3.5,
              "seed": 1234}),  # size: a multiple of 4 (the tiny VAE's 2x times FLUX's 2x2 packing)
    "qwen-image": sp.ImageCase(
        "qwen-image", ("qwen_image", "kohya"), hsdp=("rank_local",),
        body={"prompt": _PROMPT, "size": "64x64", "n": 1, "num_inference_steps": 3, "guidance_scale": 1.0,
              "seed": 1234}),  # no negative prompt: no true CFG, one DiT pass per step
    "z-image": sp.ImageCase(
        "z-image", ("z_image", "kohya"), hsdp=("rank_local",),
        body={"prompt": _PROMPT, "size": "64x64", "n": 1, "num_inference_steps": 3, "guidance_scale": 0.0,
              "seed": 1234},  # a multiple of 16 (VAE 8x, patch 2); Z-Image-Turbo's guidance 0 (no CFG)
        server_args=("--custom-pipeline-args",
                     json.dumps({"pipeline_class": "z_image_pipeline.ConfigSizedZImagePipeline"})),
        env={"PYTHONPATH": os.pathsep.join(p for p in (  # our package first, then this folder for the class
            str(Path(sp.__file__).resolve().parents[2]), str(Path(sp.__file__).parent),
            os.environ.get("PYTHONPATH")) if p)},
        log_must_match=r"Z-Image init: dim=64 "),
}
TWO_RANKS = [(family, strategy) for family, case in CASES.items() for strategy in case.hsdp]

pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(not sp.ENABLED, reason="set VLLM_DIFFUSION_SERVE_PROOF=1 to start real vllm-omni servers"),
    pytest.mark.timeout(1800),
]


@pytest.fixture(scope="module")
def proofs(tmp_path_factory):
    """``proofs(family)``: that family's proof, its checkpoints built on first use; summaries written at the end."""
    base = os.environ.get("VLLM_DIFFUSION_SERVE_PROOF_DIR")
    built: dict[str, sp.ImageProof] = {}

    def get(family: str) -> sp.ImageProof:
        if family not in built:
            root = Path(base) / family if base else tmp_path_factory.mktemp(f"serve-{family}")
            built[family] = sp.ImageProof(CASES[family], root)
            built[family].summary["tolerance"] = {"mean_abs": MAX_MEAN_ABS, "max_abs": MAX_ABS}
        return built[family]

    with sp.unwind_on_sigterm():  # a stage timeout stops the running server's process group
        yield get
        for proof in built.values():
            proof.finish()


@pytest.fixture
def proof(proofs, family) -> sp.ImageProof:
    return proofs(family)


def assert_close_to_reference(proof: sp.ImageProof, name: str) -> None:
    dist = proof.distance(f"{name} vs reference", proof.runs[name].answers[0], proof.reference().answers[0])
    assert dist.mean_abs <= MAX_MEAN_ABS and dist.max_abs <= MAX_ABS, (
        f"{proof.case.family} {name} is {dist} from the diffusers-merged reference (tolerance mean {MAX_MEAN_ABS}, "
        f"max {MAX_ABS}); log {proof.runs[name].log}")


FAMILIES = pytest.mark.parametrize("family", sorted(CASES))


@FAMILIES
def test_reference_repeats_itself(proof):
    ref = proof.reference()
    dist = proof.distance("reference vs itself", ref.answers[0], ref.answers[1])
    assert dist.mean_abs <= MAX_MEAN_ABS / 10 and dist.max_abs <= 1, dist
    assert sp.decode_image(ref.answers[0]).shape == (1, *proof.case.size, 3)


@FAMILIES
def test_negative_control_differs_clearly(proof):
    control = proof.serve("control", proof.original, plugin=False)
    dist = proof.distance("control (no LoRA) vs reference", control.answers[0], proof.reference().answers[0])
    assert dist.mean_abs >= CONTROL_FACTOR * MAX_MEAN_ABS, (
        f"the LoRA moves the {proof.case.family} image by only {dist}: the comparison would prove nothing")


@FAMILIES
def test_ours_serves_the_merged_image(proof):
    run = proof.ours("ours")
    dits = proof.dit_reports(run, "1 rank")
    assert len(dits) == 1, f"no load report of our load path for the DiT in {run.log}: the flag did not reach it"
    (dit,) = dits
    assert int(dit["bytes_read"]) == proof.summary["dit_bytes"], dit
    assert dit["lora_files"] == "1" and int(dit["lora_targets"]) == len(proof.changed), (
        f"we fused {dit['lora_targets']} targets, diffusers changed {len(proof.changed)} tensors: {dit}")
    assert_close_to_reference(proof, "ours")


@pytest.mark.parametrize("family, strategy", TWO_RANKS)
def test_ours_two_ranks_hsdp(proof, strategy):
    name = f"ours-hsdp2-{strategy}"
    run = proof.ours(name, "--use-hsdp", "--hsdp-shard-size", "2", hsdp_weight_load=strategy)
    dits = proof.dit_reports(run, strategy)
    per_rank, total = sp.bytes_per_rank(dits), proof.summary["dit_bytes"]
    assert sorted(per_rank) == [0, 1], f"load reports of ranks {sorted(per_rank)} in {run.log}, wanted 0 and 1"
    assert {r.get("strategy") for r in dits} == {strategy}, dits
    if strategy == "full":
        assert per_rank == {0: total, 1: total}, per_rank
    else:  # rank_local: each rank its own rows of the DiT (~1/2), every row read once in all
        assert sum(per_rank.values()) == total and max(per_rank.values()) <= 0.6 * total, per_rank
    assert_close_to_reference(proof, name)
