"""Tiny diffusers checkpoints written by diffusers itself, and LoRA files for them (no hub access); and the
tiny transformers Llama with its peft LoRA that the vLLM-loader tests and the serving e2e proof use.

Used by ``vllm-diffusion demo`` and by the tests. Every parameter is drawn from a seeded normal
distribution (none left at the default init's 0/1), so a weight a loader forgets is visible in a comparison.
Needs diffusers (the ``cli`` or ``test`` extra).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from vllm_diffusion_plugin.tiny.tokenizers import t5_tokenizer

TINY_CONFIGS: dict[str, dict] = {
    "wan": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
    "flux": dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
    "z-image": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=64, n_layers=1, n_refiner_layers=1,
                    n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 12, 12], axes_lens=[64, 32, 32]),
    "qwen-image": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
                       num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
}
PIPELINES = {
    "wan": ("WanPipeline", "WanTransformer3DModel", ("transformer", "transformer_2")),
    "flux": ("FluxPipeline", "FluxTransformer2DModel", ("transformer",)),
    "z-image": ("ZImagePipeline", "ZImageTransformer2DModel", ("transformer",)),
    "qwen-image": ("QwenImagePipeline", "QwenImageTransformer2DModel", ("transformer",)),
}
RUNTIME_WRITERS: dict[str, str] = {
    "wan": f"{__name__}:write_wan_runtime_components",
    "flux": "vllm_diffusion_plugin.tiny.flux:write_runtime_components",
    "z-image": "vllm_diffusion_plugin.tiny.z_image:write_runtime_components",
    "qwen-image": "vllm_diffusion_plugin.tiny.qwen_image:write_runtime_components",
}
"""``kind`` -> ``"module:function"`` writing the pipeline's other components (text encoders, tokenizers, VAE,
scheduler) under a folder, called as ``function(root, seed=, dtype=)``; returns their ``model_index.json``
entries. Imported only for ``runnable=True``."""


def build_tiny_model(kind: str, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny diffusers DiT of ``kind`` ("wan" or "flux") with seeded random parameters, in eval mode."""
    import diffusers

    cls = getattr(diffusers, PIPELINES[kind][1])
    torch.manual_seed(seed)
    model = cls(**TINY_CONFIGS[kind])
    seed_parameters(model, torch.Generator().manual_seed(1000 + seed))
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def seed_parameters(module: torch.nn.Module, gen: torch.Generator, std: float = 0.2) -> torch.nn.Module:
    """Every parameter of ``module`` drawn from ``N(0, std)`` by ``gen``, in ``parameters()`` order (the tiny
    models' init: a weight a loader forgets shows in the output); returns ``module``."""
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * std)
    return module


def write_tiny_pipeline(root: Path, kind: str, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                        safe_serialization: bool = True, min_shards: int = 3, runnable: bool = False) -> Path:
    """Write a pipeline folder (``model_index.json`` + transformer folders saved by diffusers'
    ``save_pretrained(max_shard_size=...)``, so each has an index and >= ``min_shards`` shards).

    ``runnable=True`` also writes the pipeline's other components (``RUNTIME_WRITERS``), so diffusers' pipeline
    class and vllm-omni's can run the folder."""
    import diffusers

    pipeline_class, model_class, components = PIPELINES[kind]
    index = {"_class_name": pipeline_class, "_diffusers_version": diffusers.__version__,
             "scheduler": [None, None], "text_encoder": [None, None], "tokenizer": [None, None],
             "vae": [None, None]}
    if kind == "wan":
        index["boundary_ratio"] = 0.875
    if runnable:
        if kind not in RUNTIME_WRITERS:
            raise ValueError(f"runnable=True builds {sorted(RUNTIME_WRITERS)} pipelines, not {kind!r}")
        module, _, function = RUNTIME_WRITERS[kind].partition(":")
        index |= getattr(importlib.import_module(module), function)(Path(root), seed=seed, dtype=dtype)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for offset, name in enumerate(components):
        model = build_tiny_model(kind, seed=seed + offset, dtype=dtype)
        sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
        model.save_pretrained(root / name, max_shard_size=max(sum(sizes) // (min_shards + 1), max(sizes)),
                              safe_serialization=safe_serialization)
        n_shards = len(list((root / name).glob("*.safetensors" if safe_serialization else "*.bin")))
        if n_shards < min_shards:
            raise AssertionError(f"tiny {kind} checkpoint has only {n_shards} shards, wanted {min_shards}")
        index[name] = ["diffusers", model_class]
    (root / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return root


TINY_WAN_TEXT = dict(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, relative_attention_num_buckets=8,
                     relative_attention_max_distance=16)
"""UMT5 encoder config of the runnable tiny Wan2.2 pipeline (``d_model`` == the transformers' ``text_dim``)."""
TINY_WAN_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                    temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
"""AutoencoderKLWan config (``z_dim`` == the transformers' ``in_channels``; 4x temporal, 8x spatial)."""
_TINY_WORDS = ("a", "cat", "dog", "tiny", "video", "of", "the", "on", "in", "red", "blue", "walks", "runs",
               "beach", "street", "sky", "with", "and", "slow", "motion")


def write_wan_runtime_components(root: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                                 text_dim: int | None = None, z_dim: int | None = None) -> dict:
    """Write ``vae/``, ``text_encoder/``, ``tokenizer/`` and ``scheduler/`` of a tiny Wan2.2 text-to-video
    pipeline under ``root`` with diffusers'/transformers' own classes (an ``AutoencoderKLWan``, a
    ``UMT5EncoderModel``, a T5 tokenizer built offline from a word list, a flow-matching
    ``UniPCMultistepScheduler``); returns their ``model_index.json`` entries. ``text_dim`` / ``z_dim``: the
    encoder's width and the VAE's latent channels for wider transformers (default: ``TINY_WAN_TEXT`` /
    ``TINY_WAN_VAE``'s, which match ``TINY_CONFIGS["wan"]``)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    root = Path(root)
    tokenizer = t5_tokenizer(_TINY_WORDS)
    tokenizer.save_pretrained(root / "tokenizer")

    torch.manual_seed(seed + 100)
    text = TINY_WAN_TEXT | ({"d_model": text_dim} if text_dim else {})
    vae_config = TINY_WAN_VAE | ({"z_dim": z_dim, "latents_mean": [0.0] * z_dim, "latents_std": [1.0] * z_dim}
                                 if z_dim else {})
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **text)).eval()
    vae = AutoencoderKLWan(**vae_config).eval()
    seed_parameters(encoder, torch.Generator().manual_seed(seed + 200))
    encoder.to(dtype).save_pretrained(root / "text_encoder")
    vae.to(dtype).save_pretrained(root / "vae")
    UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0,
                            num_train_timesteps=1000).save_pretrained(root / "scheduler")
    return {"tokenizer": ["transformers", type(tokenizer).__name__],
            "text_encoder": ["transformers", "UMT5EncoderModel"],
            "vae": ["diffusers", "AutoencoderKLWan"], "scheduler": ["diffusers", "UniPCMultistepScheduler"]}


def write_tiny_lora(path: Path, model: torch.nn.Module, *, rank: int = 4, alpha: float | None = 8.0,
                    seed: int = 0, targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0"),
                    prefix: str = "transformer.") -> Path:
    """A diffusers-format LoRA (``<prefix><module>.lora_A.weight`` / ``lora_B.weight`` / ``.alpha``) for every
    ``nn.Linear`` of ``model`` whose name ends with one of ``targets``; written with safetensors."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(targets):
            tensors[f"{prefix}{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen) * 0.1
            tensors[f"{prefix}{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=gen) * 0.1
            if alpha is not None:
                tensors[f"{prefix}{name}.alpha"] = torch.tensor(float(alpha))
    if not tensors:
        raise ValueError(f"no nn.Linear of {type(model).__name__} ends with {targets}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


TINY_LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, tie_word_embeddings=False)
"""The tiny ``LlamaConfig`` (GQA 2q/1kv heads, head_dim 64: shapes vLLM's kernels accept); callers add vocab
size, positions and special tokens."""
TINY_CAUSAL_LMS = {"llama": ("LlamaConfig", "LlamaForCausalLM", TINY_LLAMA),
                   "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", TINY_LLAMA)}
"""Tiny causal LMs for the vLLM door: family -> (transformers config class, model class, config). Qwen2 has
biases on q/k/v, which vLLM packs into ``qkv_proj`` with the weights."""
LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_tiny_causal_lm(*, seed: int = 0, family: str = "llama", **config) -> torch.nn.Module:
    """A tiny transformers causal LM of ``family`` (``TINY_CAUSAL_LMS``; its config updated by ``config``),
    float32, eval mode, initialized by transformers after ``torch.manual_seed(seed)``. Needs transformers."""
    import transformers

    config_class, model_class, tiny = TINY_CAUSAL_LMS[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**(tiny | config)))
    return model.to(torch.float32).eval()


def add_tiny_causal_lm_lora(model: torch.nn.Module, *, seed: int, b_std: float) -> torch.nn.Module:
    """``model`` wrapped by peft with a rank-8 LoRA (``lora_alpha`` 16) on every ``LLAMA_LORA_TARGETS``
    projection, in eval mode. peft starts ``lora_B`` at zero (no effect); here B is drawn from a normal of
    std ``b_std`` seeded with ``seed``. Save it with ``save_pretrained``; ``merge_and_unload()`` gives the
    merged reference. Needs peft."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(LLAMA_LORA_TARGETS))
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * b_std)
    return peft_model.eval()
