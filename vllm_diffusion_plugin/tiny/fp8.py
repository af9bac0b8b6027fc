"""Tiny pre-quantized FP8 checkpoints for tests and proofs: the one-process reference of a LoRA fused into them."""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_diffusion_plugin.engine.quant.fp8 import fuse_fp8_rows

FP8 = torch.float8_e4m3fn


def fused_fp8_copy(root: Path, out: Path, loras: list[Path], *, component: str = "transformer") -> Path:
    """A copy of pipeline folder ``root`` at ``out`` whose ``component`` (a pre-quantized FP8 DiT) holds every FP8 layer
    the diffusers LoRA files ``loras`` target fused in one process on the whole tensor: every file's delta summed in
    fp32, added to the dequantized weight, requantized once with a scale from the fused tensor
    (``quant.fp8.fuse_fp8_rows``) -- the reference an exact fusion at load must equal."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shutil.copytree(root, out)
    deltas: dict[str, torch.Tensor] = {}
    for path in loras:
        factors = load_file(str(path))
        for key in [k for k in factors if k.endswith(".lora_A.weight")]:
            name = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
            a, b = factors[key].float(), factors[f"transformer.{name}.lora_B.weight"].float()
            alpha = factors.get(f"transformer.{name}.alpha")
            deltas[name] = deltas.get(name, 0) + (b @ a) * (float(alpha) / a.shape[0] if alpha is not None else 1.0)
    shards = {}
    for shard in sorted((out / component).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            shards[shard] = {k: f.get_tensor(k) for k in f.keys()}
    where = {key: shard for shard, tensors in shards.items() for key in tensors}
    for name, delta in deltas.items():
        weight, scale_key = f"{name}.weight", f"{name}.weight_scale"
        q, scale = shards[where[weight]][weight], shards[where[scale_key]][scale_key]
        if q.dtype != FP8:
            continue
        per_tensor = scale.dim() == 0
        new_q, new_scale = fuse_fp8_rows(q, scale if per_tensor else scale.reshape(-1, 1), delta,
                                         per_tensor=per_tensor)
        shards[where[weight]][weight], shards[where[scale_key]][scale_key] = new_q, new_scale.reshape(scale.shape)
    for shard, tensors in shards.items():
        save_file(tensors, str(shard), metadata={"format": "pt"})
    return out
