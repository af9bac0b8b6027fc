"""The runtime components of a tiny runnable Z-Image pipeline folder (``write_tiny_pipeline(DIR, "z-image",
runnable=True)``), written by transformers/diffusers themselves, no hub.

Sized to the tiny ``ZImageTransformer2DModel`` of ``models.TINY_CONFIGS["z-image"]``: a Qwen3 text encoder
whose hidden size is the DiT's ``cap_feat_dim`` (both ZImage pipelines, diffusers' and vllm-omni's, feed the DiT the
second-to-last hidden state, so two layers), a Qwen2 byte-level BPE tokenizer with Qwen3's chat template
(``tiny_tokenizers.qwen2_tokenizer``), an ``AutoencoderKL`` with ``latent_channels`` == the DiT's ``in_channels``
(8x spatial), and Z-Image-Turbo's
``FlowMatchEulerDiscreteScheduler`` (shift 3, no dynamic shifting). Every parameter is seeded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_diffusion_plugin.tiny.models import seed_parameters
from vllm_diffusion_plugin.tiny.tokenizers import QWEN3_CHAT_TEMPLATE, QWEN3_SPECIAL, qwen2_tokenizer

TINY_Z_IMAGE_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)
"""``Qwen3Config`` of the text encoder (``hidden_size`` == the DiT's ``cap_feat_dim``; tied embeddings like
Qwen3-4B, so the checkpoint holds no ``lm_head``; 1024 positions cover the pipelines' 512-token padding)."""
TINY_Z_IMAGE_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=32, scaling_factor=0.3611,
                        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
"""``AutoencoderKL`` config: Z-Image's FLUX VAE at toy width -- 4 blocks, so 8x spatial like the real one (with the
DiT's patch 2 an image side is a multiple of 16), no quant convs, its scaling and shift factors. Not fewer blocks:
vllm-omni's startup warmup generates 512x512, whose 32x32 patch grid must fit the tiny DiT's rope table
(``axes_lens`` 32)."""
TINY_Z_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def write_runtime_components(root: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Write ``tokenizer/``, ``text_encoder/``, ``vae/`` and ``scheduler/`` of a tiny Z-Image pipeline under
    ``root``; returns their ``model_index.json`` entries."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = Path(root)
    tokenizer = qwen2_tokenizer(special=QWEN3_SPECIAL, chat_template=QWEN3_CHAT_TEMPLATE)
    tokenizer.save_pretrained(root / "tokenizer")

    torch.manual_seed(seed + 100)
    config = Qwen3Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), **TINY_Z_IMAGE_TEXT)
    encoder = Qwen3ForCausalLM(config).eval()
    vae = AutoencoderKL(**TINY_Z_IMAGE_VAE).eval()
    gen = torch.Generator().manual_seed(seed + 200)
    seed_parameters(encoder, gen)
    with torch.no_grad():
        for param in vae.parameters():  # around diffusers' init (norms ~1), so the decoder does not saturate
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    # Saved as the causal LM (keys ``model.*``, as Z-Image-Turbo's text_encoder is): vllm-omni builds
    # ``AutoModelForCausalLM`` from this config, diffusers reads it as the ``Qwen3Model`` of model_index.json.
    encoder.to(dtype).save_pretrained(root / "text_encoder")
    vae.to(dtype).save_pretrained(root / "vae")
    FlowMatchEulerDiscreteScheduler(**TINY_Z_IMAGE_SCHEDULER).save_pretrained(root / "scheduler")
    return {"tokenizer": ["transformers", type(tokenizer).__name__], "text_encoder": ["transformers", "Qwen3Model"],
            "vae": ["diffusers", "AutoencoderKL"], "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
