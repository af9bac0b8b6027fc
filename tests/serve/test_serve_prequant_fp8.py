"""A pre-quantized ModelOpt FP8 Qwen-Image with a LoRA in real servers (issue 37): ``vllm serve DIR --omni
--load-format diffusion-hsdp`` on the FP8 folder with a diffusers LoRA serves, on ``POST /v1/images/generations``,
the image vllm-omni itself serves (plugin off) from the same FP8 folder with the LoRA fused into it in one process
(every targeted FP8 weight dequantized, the delta added in fp32, requantized with a scale from the fused tensor:
``tiny.fp8.fused_fp8_copy``) -- the exact fusion, done at load, each rank reading the checkpoint once.

vLLM's ModelOpt FP8 kernels need a GPU: on our CPU platform every server process (ours, the reference and the
control alike) serves ModelOpt FP8 with the pure-torch stand-in the ``diffusion_cpu_fp8`` plugin registers through
vLLM's ``register_quantization_config`` (``testing/cpu_modelopt.py``: vLLM's parameters and post-processing
arithmetic, weights dequantized in the forward), and its log says so. The control (the FP8 folder, no LoRA) must
differ clearly, or the comparison would prove nothing.

Skipped unless ``VLLM_DIFFUSION_SERVE_PROOF=1`` (``.ci/omni-serve.sh``); the CPU platform only.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import serve_proof as sp

pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(not sp.ENABLED, reason="set VLLM_DIFFUSION_SERVE_PROOF=1 to start real vllm-omni servers"),
    pytest.mark.skipif(not sp.CPU, reason="the CPU platform's ModelOpt stand-in; a GPU serves vLLM's ModelOpt"),
    pytest.mark.timeout(1200),
]
BODY = {"prompt": "a red cat walks on the beach", "size": "64x64", "n": 1, "num_inference_steps": 3,
        "guidance_scale": 1.0, "seed": 1234}
MAX_MEAN_ABS, MAX_ABS, CONTROL_FACTOR = 0.5, 4, 10.0  # test_serve_images.py's tolerance and control rule
STAND_IN = "pre-quantized ModelOpt FP8 checkpoints (quantization 'modelopt') served by a pure-torch stand-in"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the ModelOpt FP8 Qwen-Image folder, its LoRA, the reference with the LoRA fused in one process)."""
    import torch

    from vllm_diffusion_plugin.tiny.fp8 import fused_fp8_copy
    from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora, write_tiny_pipeline

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_prequant_fp8 import quantize_folder

    root = tmp_path_factory.mktemp("serve-fp8-checkpoint")
    original = write_tiny_pipeline(root / "original", "qwen-image", runnable=True)
    model = build_tiny_model("qwen-image")
    every = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "blocks." in n}
    quantize_folder(original / "transformer", "qwen-image", "modelopt-fp8", every)  # per tensor, static input scales
    config_path = original / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"].pop("exclude_modules", None)  # every block linear is FP8
    config_path.write_text(json.dumps(config))
    lora = write_tiny_lora(root / "lora.safetensors", model, seed=11, alpha=32.0,
                           targets=("to_q", "to_k", "to_v", "add_k_proj", "img_mlp.net.0.proj", "txt_mlp.net.2"))
    return original, lora, fused_fp8_copy(original, root / "reference", [lora])


def _serve(name: str, folder: Path, logs: Path, *, plugin: bool, args: tuple[str, ...] = ()) -> sp.ServerRun:
    run = sp.serve(sp.ServerSpec(f"modelopt-fp8-{name}", folder, plugin=plugin, args=args), logs,
                   request=functools.partial(sp.request_image, body=BODY), cpu=True,
                   ready_timeout_s=sp.READY_TIMEOUT_S)
    print(f"\n[modelopt-fp8 {name}] ready after {run.ready_s:.1f} s", flush=True)
    assert STAND_IN in run.log_text(), f"{run.log}: the CPU stand-in for ModelOpt FP8 was not registered"
    return run


def test_ours_serves_the_image_of_the_fp8_checkpoint_fused_in_one_process(folders, tmp_path):
    original, lora, reference = folders
    logs = tmp_path / "logs"
    expected = _serve("reference", reference, logs, plugin=False)
    config = {"diffusion_hsdp": {"lora_path": [f"transformer={lora}"]}}
    ours = _serve("ours", original, logs, plugin=True, args=(
        "--load-format", "diffusion-hsdp", "--additional-config", json.dumps(config)))
    control = _serve("control", original, logs, plugin=False)
    (report,) = [r for r in sp.load_reports(ours.log_text()) if r.get("component") == "transformer"]
    dist = sp.distance(ours.answers[0], expected.answers[0], decode=sp.decode_image)
    away = sp.distance(control.answers[0], expected.answers[0], decode=sp.decode_image)
    print(f"\n[modelopt-fp8] ours vs the one-process fusion: {dist}; control (no LoRA) vs it: {away}; ours read "
          f"{report['bytes_read']} bytes of {sp.dit_bytes(original, ('transformer',))}, fused "
          f"{report['lora_targets']} targets", flush=True)
    assert int(report["lora_targets"]) == 6, report
    # the DiT's bytes once, and the 6 targeted layers' 0-dim scales read first (4 bytes each)
    assert int(report["bytes_read"]) == sp.dit_bytes(original, ("transformer",)) + 6 * 4, report
    assert dist.mean_abs <= MAX_MEAN_ABS and dist.max_abs <= MAX_ABS, dist
    assert away.mean_abs >= CONTROL_FACTOR * MAX_MEAN_ABS, f"the LoRA moves the image by only {away}"
