"""Proof in real servers: ``vllm serve DIR --omni --load-format diffusion-hsdp`` with two LoRAs serves the video
of the pipeline diffusers merged, at 1 rank and under ``--use-hsdp`` at 2 ranks with every weight-load strategy.

Skipped unless ``VLLM_DIFFUSION_SERVE_PROOF=1`` (run by ``.ci/omni-serve.sh`` in the ``[omni]`` environment).
On a CPU-only host the servers run on this package's CPU platform (``VLLM_DIFFUSION_OMNI_CPU=1``); where CUDA
works they run on vllm-omni's own GPU platform (``VLLM_DIFFUSION_SERVE_PROOF_DEVICE=cpu|gpu`` forces one).

Servers start one at a time, in this order (each stopped before the next starts):

1. reference: the diffusers-merged folder, plugin off -- two requests (its distance to itself);
2. negative control: the original folder, plugin off -- must be far from the reference;
3. ours: the original folder, plugin on, ``--load-format diffusion-hsdp``, both LoRAs in ``--additional-config``;
4. ours at 2 ranks (``--use-hsdp --hsdp-shard-size 2``) once per ``hsdp_weight_load``: ``full`` (each rank reads
   every DiT byte), ``broadcast`` (rank 0 reads, rank 1 reads nothing), ``rank_local`` (each rank reads only its
   own rows, q/k/v stacked by vllm-omni included: the two ranks' bytes add up to the DiT bytes once);
5. a bad ``diffusion_hsdp`` key: the server must exit non-zero, naming the key -- given on the command line, and
   in a ``--config`` YAML file together with ``load-format: diffusion-hsdp``.

Tolerance (in 8-bit levels of the decoded frames): ``MAX_MEAN_ABS`` on the mean and ``MAX_ABS`` on the largest
pixel difference. Why these: our fusion and diffusers' are the same fp32 math up to summation order (relative
differences ~1e-7 in the weights; tests/test_lora_oracle.py holds them to 1e-5), four denoising steps of a tiny
DiT keep that far below one 8-bit level, and the h264 encoder is deterministic (the reference's two requests
give the same bytes). A rounding flip near a level boundary, amplified by the codec's prediction, can move a few
pixels by a few levels, hence a max allowance of 8 and a mean of 0.5. The negative control (the LoRAs missing) must
be at least ``CONTROL_FACTOR`` times the mean tolerance away, so the comparison cannot pass by accident. All
distances are printed and written to the summary. Measured on a 2-core CPU host (2026-12-02): reference vs
itself 0 (identical mp4 bytes); ours vs reference 0 (identical bytes) at 1 rank and at 2 ranks with ``full`` and
``broadcast``; the control 7.56 mean, 67 max -- 15x the mean tolerance.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import serve_proof as sp

from vllm_diffusion_plugin.testing import omni_facts

CPU, READY_TIMEOUT_S = sp.CPU, sp.READY_TIMEOUT_S
MAX_MEAN_ABS, MAX_ABS, CONTROL_FACTOR = 0.5, 8, 10.0
STRATEGIES = ("full", "broadcast", "rank_local")
CARRIED = "carried to vllm-omni's diffusion workers"
"""The weight-load strategies, each served at 2 ranks."""

pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(not sp.ENABLED, reason="set VLLM_DIFFUSION_SERVE_PROOF=1 to start real vllm-omni servers"),
    pytest.mark.timeout(1800),
]


class Proof:
    """The checkpoints, the server runs so far, and the summary written at the end."""

    def __init__(self, root: Path) -> None:
        self.t0 = time.monotonic()
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        t = time.monotonic()
        self.ckpt = sp.build_checkpoints(root / "checkpoints")
        self.summary: dict = {"build_s": round(time.monotonic() - t, 1), "servers": {}, "distances": {},
                              "bytes_per_rank": {}, "dit_bytes": sp.dit_bytes(self.ckpt.original),
                              "tolerance": {"mean_abs": MAX_MEAN_ABS, "max_abs": MAX_ABS}}
        self.runs: dict[str, sp.ServerRun] = {}

    def serve(self, spec: sp.ServerSpec, *, requests: int = 1) -> sp.ServerRun:
        if spec.name not in self.runs:
            run = sp.serve(spec, self.logs, requests=requests, cpu=CPU, ready_timeout_s=READY_TIMEOUT_S)
            self.runs[spec.name] = run
            self.summary["servers"][spec.name] = {"ready_s": round(run.ready_s, 1),
                                                  "request_s": [round(s, 2) for s in run.request_s]}
            print(f"\n[{spec.name}] ready after {run.ready_s:.1f} s; requests {run.request_s}", flush=True)
        return self.runs[spec.name]

    def record(self, name: str, dist: sp.Distance) -> sp.Distance:
        self.summary["distances"][name] = {"mean_abs": dist.mean_abs, "max_abs": dist.max_abs,
                                           "identical_bytes": dist.identical_bytes}
        print(f"\n[distance] {name}: {dist}", flush=True)
        return dist

    def reference(self) -> sp.ServerRun:
        return self.serve(sp.ServerSpec("reference", self.ckpt.merged, plugin=False), requests=2)

    def ours_config(self, **extra) -> str:
        lora = [f"transformer={self.ckpt.lora_high}", f"transformer_2={self.ckpt.lora_low}"]
        return json.dumps({"diffusion_hsdp": {"lora_path": lora, **extra}})


@pytest.fixture(scope="module")
def proof(tmp_path_factory) -> Proof:
    root = Path(os.environ.get("VLLM_DIFFUSION_SERVE_PROOF_DIR") or tmp_path_factory.mktemp("serve-proof"))
    with sp.unwind_on_sigterm():  # a stage timeout stops the running server's process group
        proof = Proof(root)
        yield proof
    proof.summary["stage_s"] = round(time.monotonic() - proof.t0, 1)
    sp.write_summary(root / "summary.json", proof.summary)
    print(f"\n[summary] {root / 'summary.json'}\n{json.dumps(proof.summary, indent=1)}", flush=True)


def assert_close_to_reference(proof: Proof, name: str, video: bytes) -> None:
    dist = proof.record(f"{name} vs reference", sp.distance(video, proof.reference().videos[0]))
    assert dist.mean_abs <= MAX_MEAN_ABS and dist.max_abs <= MAX_ABS, (
        f"{name} is {dist} from the diffusers-merged reference (tolerance mean {MAX_MEAN_ABS}, max {MAX_ABS}); "
        f"log {proof.runs[name].log}")


def test_reference_repeats_itself(proof):
    ref = proof.reference()
    dist = proof.record("reference vs itself", sp.distance(ref.videos[0], ref.videos[1]))
    assert dist.mean_abs <= MAX_MEAN_ABS / 10 and dist.max_abs <= 1, dist
    assert sp.decode_frames(ref.videos[0]).shape == (5, 32, 32, 3)


def test_negative_control_differs_clearly(proof):
    control = proof.serve(sp.ServerSpec("control", proof.ckpt.original, plugin=False))
    dist = proof.record("control (no LoRA) vs reference", sp.distance(control.videos[0], proof.reference().videos[0]))
    assert dist.mean_abs >= CONTROL_FACTOR * MAX_MEAN_ABS, (
        f"the LoRAs move the video by only {dist}: the comparison with the reference would prove nothing")


def test_ours_serves_the_merged_video(proof):
    run = proof.serve(sp.ServerSpec("ours", proof.ckpt.original, plugin=True, args=(
        "--load-format", "diffusion-hsdp", "--additional-config", proof.ours_config())))
    reports = sp.load_reports(run.log_text())
    proof.summary["bytes_per_rank"]["1 rank"] = sp.bytes_per_rank(reports)
    assert {r.get("component") for r in reports} >= {"transformer", "transformer_2"}, (
        f"no load report of our load path for both DiTs in {run.log}: the flag did not reach our loader")
    assert_carried_line(run)
    assert_close_to_reference(proof, "ours", run.videos[0])


def assert_carried_line(run: sp.ServerRun) -> None:
    """The API server's INFO line saying the flag went to the workers: printed whatever the host configured
    (vllm-omni 0.31rc1's API server configures no logging)."""
    assert CARRIED in run.log_text(), f"no '{CARRIED}' line of the API server in {run.log}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ours_two_ranks_hsdp(proof, strategy):
    name = f"ours-hsdp2-{strategy}"
    run = proof.serve(sp.ServerSpec(name, proof.ckpt.original, plugin=True, args=(
        "--load-format", "diffusion-hsdp", "--use-hsdp", "--hsdp-shard-size", "2",
        "--additional-config", proof.ours_config(hsdp_weight_load=strategy))))
    reports = sp.load_reports(run.log_text())
    per_rank = sp.bytes_per_rank(reports)
    proof.summary["bytes_per_rank"][strategy] = per_rank
    print(f"\n[bytes] {strategy}: {per_rank} (DiT tensors {proof.summary['dit_bytes']} bytes)", flush=True)
    assert sorted(per_rank) == [0, 1], f"load reports of ranks {sorted(per_rank)} in {run.log}, wanted 0 and 1"
    assert {r.get("strategy") for r in reports} == {strategy}, reports
    assert_carried_line(run)
    total = proof.summary["dit_bytes"]  # tensor bytes of both DiTs
    if strategy == "full":
        assert per_rank == {0: total, 1: total}, per_rank
    elif strategy == "broadcast":
        assert per_rank == {0: total, 1: 0}, per_rank
    else:  # each rank its own rows (~1/2), every row read once in all
        assert sum(per_rank.values()) == total and max(per_rank.values()) <= 0.6 * total, per_rank
    assert_close_to_reference(proof, name, run.videos[0])


def test_bad_option_key_refuses_to_start(proof):
    bad = json.dumps({"diffusion_hsdp": {"lora_pathz": [str(proof.ckpt.lora_high)]}})
    status, log, seconds = sp.refused_start(sp.ServerSpec("bad-key", proof.ckpt.original, plugin=True, args=(
        "--load-format", "diffusion-hsdp", "--additional-config", bad)), proof.logs, cpu=CPU)
    proof.summary["servers"]["bad-key"] = {"exit_status": status, "refused_after_s": round(seconds, 1)}
    print(f"\n[bad-key] exit status {status} after {seconds:.1f} s", flush=True)
    assert status != 0
    assert "lora_pathz" in log, f"the refusal does not name the bad key; log {proof.logs / 'bad-key.log'}"


@pytest.mark.skipif(not omni_facts.has_pre_sharded(), reason="vllm-omni 0.30 has no --hsdp-weight-load-strategy")
def test_broadcast_with_upstreams_pre_sharded_refuses_to_start(proof):
    """Our ``broadcast`` with vllm-omni's ``--hsdp-weight-load-strategy pre_sharded`` (0.31+) would hand the load
    to upstream's pre-sharded path (no LoRA, no stacked q/k/v): the server stops at startup, naming both."""
    status, log, seconds = sp.refused_start(sp.ServerSpec("broadcast-pre-sharded", proof.ckpt.original, plugin=True,
                                                          args=("--load-format", "diffusion-hsdp", "--use-hsdp",
                                                                "--hsdp-shard-size", "2", "--hsdp-weight-load-strategy",
                                                                "pre_sharded", "--additional-config",
                                                                proof.ours_config(hsdp_weight_load="broadcast"))),
                                            proof.logs, cpu=CPU)
    proof.summary["servers"]["broadcast-pre-sharded"] = {"exit_status": status, "refused_after_s": round(seconds, 1)}
    assert status != 0
    assert "hsdp_weight_load='broadcast' together with vllm-omni's --hsdp-weight-load-strategy pre_sharded" in log, \
        f"the refusal does not name both options; log {proof.logs / 'broadcast-pre-sharded.log'}"


def test_the_flag_in_a_config_file_is_honoured_too(proof):
    """``vllm serve DIR --omni --config FILE`` with ``load-format: diffusion-hsdp`` in the YAML file: our door is
    on (a bad ``diffusion_hsdp`` key there stops the server naming it, as on the command line)."""
    config = proof.root / "serve-config.yaml"
    bad = json.dumps({"diffusion_hsdp": {"lora_pathz": [str(proof.ckpt.lora_high)]}})
    config.write_text(f"load-format: diffusion-hsdp\nadditional-config: '{bad}'\n")
    status, log, seconds = sp.refused_start(sp.ServerSpec("config-file", proof.ckpt.original, plugin=True, args=(
        "--config", str(config))), proof.logs, cpu=CPU)
    proof.summary["servers"]["config-file"] = {"exit_status": status, "refused_after_s": round(seconds, 1)}
    assert status != 0
    assert "Unknown key(s) 'lora_pathz'" in log, f"the YAML's load format did not reach the door; log " \
                                                  f"{proof.logs / 'config-file.log'}"
