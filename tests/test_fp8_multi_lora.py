"""Several LoRA files into one pre-quantized FP8 layer: one requantization (issue 37).

Two LoRA files on the same FP8 layers of the tiny Wan2.2 FP8 checkpoints of ``test_prequant_fp8`` (different ranks,
alphas and spec scales; the second targets a subset of the first's layers). Exact fusion sums both files' deltas
in fp32, adds the sum once to the dequantized rows and requantizes once (per channel each row's scale; per tensor
the whole tensor's amax, agreed by the ranks holding its rows). What must hold, on 2 gloo ranks:

- ``broadcast``'s and ``rank_local``'s rows bit-identical to ``full``'s;
- ``full`` bit-identical to the one-requantization reference computed here on the whole tensor (both deltas
  ``addmm_``-ed into fp32 zeros, ``quant_fuse.fuse_fp8_rows`` once);
- every element a correct rounding of the exact (float64) sum: within half an FP8 step of it (plus fp32 noise).
  Requantizing once per file rounds twice; the second rounding lands up to a whole step away.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from test_prequant_fp8 import FP8, _bits, _file_tensors, fp8_linears, local_params, write_fp8_pipeline

LORAS = (  # (seed, rank, alpha, spec scale, targets)
    (4, 4, 8.0, 0.7, ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj")),
    (9, 8, 4.0, 1.3, ("to_q", "to_k", "ffn.net.0.proj")),
)
COMPONENTS = ("transformer", "transformer_2")


@pytest.fixture(scope="module", params=["modelopt-fp8", "modelopt-fp8-per-channel"],
                ids=["per-tensor", "per-channel"])
def two_loras(request, tmp_path_factory) -> tuple[str, list[tuple[str, float]]]:
    from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora

    root = write_fp8_pipeline(tmp_path_factory.mktemp(f"wan-{request.param}"), "wan", request.param)
    files = [(str(write_tiny_lora(root.parent / f"lora{seed}.safetensors", build_tiny_model("wan"), rank=rank,
                                  alpha=alpha, seed=seed, targets=targets)), scale)
             for seed, rank, alpha, scale, targets in LORAS]
    return str(root), files


def two_lora_worker(rank: int, world_size: int, root: str, files: list[tuple[str, float]]) -> dict:
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec
    from vllm_diffusion_plugin.engine.session import load_components
    from vllm_diffusion_plugin.engine.strategies import broadcast

    broadcast.open_channel = lambda options, device: broadcast.BroadcastChannel(  # many small buckets
        timeout_s=options.hsdp_broadcast_timeout_s, bucket_bytes=2048, device=device)
    specs = [LoraSpec(Path(path), scale, component) for component in COMPONENTS for path, scale in files]
    out = {}
    for strategy in ("full", "broadcast", "rank_local"):
        got = load_components(root, options=LoadOptions(hsdp_weight_load=strategy), device=torch.device("cpu"),
                              dtype=torch.bfloat16, hsdp=HSDPConfig(), lora_specs=specs)
        out[strategy] = {"params": local_params(got.modules), "fused": got.report.to_dict()["lora_keys_fused"]}
    return out


def one_requantization(root: Path, files: list[tuple[str, float]]) -> dict[str, tuple]:
    """Per FP8 layer fused by a LoRA: (q', scale', the exact float64 sum) -- both files' deltas summed in fp32
    (``addmm_`` into zeros, as the fusion computes them), added once to the dequantized whole tensor, requantized
    once (``fuse_fp8_rows``, no agreement: one process holds the whole tensor)."""
    from safetensors.torch import load_file

    from vllm_diffusion_plugin.engine.quant.fp8 import dequantize, fuse_fp8_rows

    factors = [(load_file(path), scale) for path, scale in files]
    out = {}
    for component in COMPONENTS:
        stored = _file_tensors(root / component)
        for name in fp8_linears("wan"):
            q, scale = stored[f"{name}.weight"], stored[f"{name}.weight_scale"]
            per_tensor = scale.dim() == 0
            column = scale if per_tensor else scale.reshape(-1, 1)
            total, exact, hits = torch.zeros(q.shape), dequantize(q, column).double(), 0
            for tensors, spec_scale in factors:
                a = tensors.get(f"transformer.{name}.lora_A.weight")
                if a is None:
                    continue
                b, alpha = tensors[f"transformer.{name}.lora_B.weight"], tensors[f"transformer.{name}.alpha"]
                s = spec_scale * float(alpha) / a.shape[0]
                total.addmm_(b.float(), a.float(), alpha=s)
                exact += s * (b.double() @ a.double())
                hits += 1
            if hits:
                new_q, new_scale = fuse_fp8_rows(q, column, total, per_tensor=per_tensor)
                out[f"{component}.{name}"] = (new_q, new_scale.reshape(scale.shape), exact, hits)
    return out


@pytest.mark.multiproc
def test_two_lora_files_into_fp8_layers_are_one_requantization(two_loras):
    from vllm_diffusion_plugin.engine.quant.fp8 import dequantize, fp8_step

    root, files = two_loras
    reference = one_requantization(Path(root), files)
    assert sum(hits == 2 for *_, hits in reference.values()) >= 6, "both files must share layers"
    results = run_distributed(two_lora_worker, 2, args=(root, files), timeout_s=500)
    for rank, result in enumerate(results):
        params = {s: {k: (t.view(FP8) if fp8 else t, start, stop) for k, (t, fp8, start, stop) in
                      result[s]["params"].items()} for s in ("full", "broadcast", "rank_local")}
        full = params["full"]
        for strategy in ("broadcast", "rank_local"):
            different = [k for k, (t, start, stop) in params[strategy].items() if (start, stop) != full[k][1:] or
                         t.dtype != full[k][0].dtype or not torch.equal(_bits(t), _bits(full[k][0]))]
            assert not different, (rank, strategy, different[:6])
        assert result["full"]["fused"] > 0
        off_reference, off_half_step = [], []
        for layer, (new_q, new_scale, exact, hits) in reference.items():
            q, start, stop = full[f"{layer}.weight"]
            scale = full[f"{layer}.weight_scale"][0]
            per_tensor = scale.dim() == 0
            ref_scale = new_scale if per_tensor else new_scale[start:stop]
            if not (torch.equal(_bits(q), _bits(new_q[start:stop])) and torch.equal(_bits(scale), _bits(ref_scale))):
                off_reference.append(layer)
            column = (lambda s: s) if per_tensor else (lambda s: s.reshape(-1, 1))
            ours = dequantize(q, column(scale)).double()
            step = fp8_step(q).double() * column(scale).double()
            error = (ours - exact[start:stop]).abs()
            worst = (error / step).max().item()
            if not bool((error <= 0.5 * step + 1e-6 * exact[start:stop].abs()).all()):
                off_half_step.append(f"{layer} ({hits} files): {worst:.2f} steps")
        print(f"\n[two LoRA files] rank {rank}: {len(reference)} FP8 layers fused, {len(off_reference)} differ from "
              f"the one-requantization reference, {len(off_half_step)} round an element off by more than half a "
              f"step: {off_half_step[:4]}", flush=True)
        assert not off_reference, (rank, off_reference[:6])
        assert not off_half_step, (rank, off_half_step[:6])
