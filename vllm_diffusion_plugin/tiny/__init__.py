"""Tiny diffusers checkpoints built locally (no hub access): what ``vllm-diffusion demo`` and ``demo --serve`` load,
and what the tests load too.

- :mod:`.models`: tiny DiTs of each family (``build_tiny_model``, ``TINY_CONFIGS``), saved by diffusers in several
  shards (``write_tiny_pipeline``; ``runnable=True`` adds every component vllm-omni's pipeline loads), and LoRA
  files for them (``write_tiny_lora``);
- :mod:`.flux`, :mod:`.qwen_image`, :mod:`.z_image`: the runnable components of those families (text encoders,
  VAEs, schedulers); :mod:`.tokenizers`: their tokenizers, built offline and deterministically;
- :mod:`.serve_checkpoints`: the runnable Wan2.2 pipeline with one LoRA per transformer and its diffusers-merged
  twin (``demo --serve`` and the serving proof).
"""
