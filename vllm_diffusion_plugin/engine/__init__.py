"""The engine: a diffusers checkpoint -> loaded (LoRA-fused, quantized, post-processed, HSDP-sharded) modules.

Its face is ``session``: a ``LoadSession`` runs one load on a rank, and the doors import from that module alone.
Below it, arrows point down: ``strategies`` (full, broadcast, rank_local) -> ``lora`` / ``quant`` -> ``io``
(reading: checkpoints into tensors); on the ground floor ``config``, ``errors``, ``memory``, ``platform``,
``progress``, ``report``. docs/architecture.md draws it. Importing this package imports nothing.
"""
