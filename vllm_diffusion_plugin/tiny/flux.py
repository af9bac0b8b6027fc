"""The runtime components of a tiny FLUX.1 text-to-image pipeline, written by transformers/diffusers themselves.

``write_tiny_pipeline(DIR, "flux", runnable=True)`` calls :func:`write_runtime_components` beside the DiT it
writes (``TINY_CONFIGS["flux"]``: inner width 32, ``pooled_projection_dim`` 32, ``joint_attention_dim`` 32,
``in_channels`` 4 = one latent channel packed 2x2). FLUX.1 reads two text encoders: CLIP (its pooled output
feeds ``pooled_projection_dim``) and T5 (its hidden states feed ``joint_attention_dim``); both tokenizers are
built offline (``tiny_tokenizers.clip_tokenizer`` / ``t5_tokenizer``, no hub). Every parameter is drawn from a
seeded normal, as ``models.build_tiny_model`` does, so a weight a loader forgets shows in the image.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_diffusion_plugin.tiny.models import seed_parameters
from vllm_diffusion_plugin.tiny.tokenizers import clip_tokenizer, t5_tokenizer

TINY_CLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 max_position_embeddings=77, projection_dim=32)
"""CLIPTextModel config (``hidden_size`` == the DiT's ``pooled_projection_dim``; 77 positions, as FLUX.1 pads)."""
TINY_T5 = dict(d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2, relative_attention_num_buckets=8,
               relative_attention_max_distance=16, feed_forward_proj="gated-gelu", is_encoder_decoder=False)
"""T5EncoderModel config (``d_model`` == the DiT's ``joint_attention_dim``; gated GELU as FLUX.1's T5-XXL)."""
TINY_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                latent_channels=1, norm_num_groups=4, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
                use_quant_conv=False, use_post_quant_conv=False)
"""AutoencoderKL config: one latent channel (the DiT's ``in_channels`` 4 // 2x2 packing), 2x spatial
(``vae_scale_factor`` 2, so sizes are multiples of 4), no quant convs (as FLUX.1's VAE)."""
WORDS = ("a", "cat", "dog", "tiny", "photo", "of", "the", "on", "in", "red", "blue", "sits", "runs", "beach",
         "street", "sky", "with", "and", "green", "hat")
"""The tokenizers' own words (anything else is spelled out by characters)."""


def write_runtime_components(root: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Write ``text_encoder/`` + ``tokenizer/`` (CLIP), ``text_encoder_2/`` + ``tokenizer_2/`` (T5), ``vae/``
    (``AutoencoderKL``) and ``scheduler/`` (``FlowMatchEulerDiscreteScheduler`` with FLUX.1-dev's dynamic shift)
    under ``root``; returns their ``model_index.json`` entries."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    root = Path(root)
    clip_tok, t5_tok = clip_tokenizer(WORDS), t5_tokenizer(WORDS)
    clip_tok.save_pretrained(root / "tokenizer")
    t5_tok.save_pretrained(root / "tokenizer_2")
    gen = torch.Generator().manual_seed(seed + 300)
    torch.manual_seed(seed + 300)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tok), bos_token_id=clip_tok.bos_token_id,
                                        eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id,
                                        **TINY_CLIP))
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), pad_token_id=t5_tok.pad_token_id,
                                 eos_token_id=t5_tok.eos_token_id, decoder_start_token_id=t5_tok.pad_token_id,
                                 **TINY_T5))
    vae = AutoencoderKL(**TINY_VAE)
    for name, module in (("text_encoder", clip), ("text_encoder_2", t5), ("vae", vae)):
        seed_parameters(module, gen).eval().to(dtype).save_pretrained(root / name)
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                    base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                    max_image_seq_len=4096).save_pretrained(root / "scheduler")
    return {"text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", type(clip_tok).__name__],
            "text_encoder_2": ["transformers", "T5EncoderModel"],
            "tokenizer_2": ["transformers", type(t5_tok).__name__],
            "vae": ["diffusers", "AutoencoderKL"], "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "image_encoder": [None, None], "feature_extractor": [None, None]}
