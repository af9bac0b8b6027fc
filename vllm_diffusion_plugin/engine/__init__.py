"""The engine: a diffusers checkpoint -> loaded (LoRA-fused, post-processed, HSDP-sharded) modules.

One load, step by step (``pipeline.load_components`` runs them; every door ends up there or in the same
building blocks):

1. options -- ``config.LoadOptions`` (extra-config / env / CLI values, validated before anything is read);
2. resolve -- ``checkpoint.resolve_checkpoint``: component folders, shards, tensor headers (no data read);
3. strategy -- ``strategies.check_strategy`` picks ``full`` / ``broadcast`` / ``rank_local``;
4. skeleton -- ``skeleton.build_component``: the diffusers class on ``meta``/host without random init;
5. read -- ``strategies.LOADERS[name](source, context=..., lora_files=...)``; the strategies stream with
   ``weights.load_into_module`` / ``weights.iterate_weights`` (strict checks from the headers first);
6. LoRA -- ``lora.normalize_lora`` (every file format -> ``LoraDelta``) then ``lora.fuse_lora`` with the
   device rule (``lora.fuse.resolve_compute_device``);
7. post-process -- ``postprocess.process_weights_after_loading``: online-quant finalize, HSDP-aware;
8. shard -- ``hsdp.apply_hsdp`` (FSDP2 over a ``(replicate, shard)`` mesh from ``hsdp.build_mesh``), or place
   the module on its device; ``report.LoadReport`` times every phase.

``platform`` answers which accelerator this process has and whether it works. Nothing here imports
``vllm_diffusion_plugin.doors``.
"""
