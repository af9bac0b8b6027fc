"""The other components of a runnable tiny Qwen-Image pipeline (``write_tiny_pipeline(DIR, "qwen-image",
runnable=True)``), written by transformers'/diffusers' own classes with ``save_pretrained``.

What vllm-omni 0.30's ``QwenImagePipeline`` (and diffusers' own) loads from the folder: ``text_encoder/`` a
``Qwen2_5_VLForConditionalGeneration`` (vllm-omni drops its vision tower after loading), ``tokenizer/`` a
``Qwen2Tokenizer``, ``vae/`` an ``AutoencoderKLQwenImage`` (``vae_scale_factor`` = 2 ** len(temperal_downsample)
= 8: images are multiples of 16), ``scheduler/`` a ``FlowMatchEulerDiscreteScheduler``. Sizes follow the tiny DiT
of ``models.TINY_CONFIGS["qwen-image"]``: the encoder's hidden size is its ``joint_attention_dim`` (32),
the VAE's ``z_dim`` (4) times the 2x2 packing is its ``in_channels`` (16). The pipelines drop the first
``prompt_template_encode_start_idx`` (34) tokens of the prompt template; the tiny tokenizer makes the template's
system part exactly 34 tokens, as Qwen's does, so the prompt's own tokens reach the DiT.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_diffusion_plugin.tiny.models import seed_parameters
from vllm_diffusion_plugin.tiny.tokenizers import qwen2_tokenizer

TINY_QWEN_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=512, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
"""Qwen2.5-VL text config (head_dim 16: ``mrope_section`` sums to 8 = head_dim / 2)."""
TINY_QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                        fullatt_block_indexes=[0], window_size=112)
"""Qwen2.5-VL vision tower (unused for text-to-image; vllm-omni deletes it, diffusers keeps it)."""
TINY_QWEN_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                     temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
TINY_QWEN_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
                           num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, time_shift_type="exponential",
                           use_dynamic_shifting=True)
"""Qwen-Image's own scheduler config (the released checkpoint's ``scheduler/scheduler_config.json``)."""


def write_runtime_components(root: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Write ``text_encoder/``, ``tokenizer/``, ``vae/`` and ``scheduler/`` of a tiny Qwen-Image pipeline under
    ``root``; returns their ``model_index.json`` entries. Every parameter is seeded random."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    root = Path(root)
    tokenizer = qwen2_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    ids = tokenizer.convert_tokens_to_ids
    text = TINY_QWEN_TEXT | dict(vocab_size=len(tokenizer), bos_token_id=ids("<|endoftext|>"),
                                 eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"))
    config = Qwen2_5_VLConfig(text_config=text, vision_config=TINY_QWEN_VISION,
                              image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                              vision_start_token_id=ids("<|vision_start|>"),
                              vision_end_token_id=ids("<|vision_end|>"))
    torch.manual_seed(seed + 100)
    encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    seed_parameters(encoder, torch.Generator().manual_seed(seed + 200))
    encoder.to(dtype).save_pretrained(root / "text_encoder")
    vae = AutoencoderKLQwenImage(**TINY_QWEN_VAE).eval()
    seed_parameters(vae, torch.Generator().manual_seed(seed + 300), std=0.3)
    vae.to(dtype).save_pretrained(root / "vae")
    FlowMatchEulerDiscreteScheduler(**TINY_QWEN_SCHEDULER).save_pretrained(root / "scheduler")
    return {"tokenizer": ["transformers", "Qwen2Tokenizer"],
            "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
            "vae": ["diffusers", "AutoencoderKLQwenImage"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
