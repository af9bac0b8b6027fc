"""The ``full`` weight-load strategy: this rank reads the whole checkpoint into a full host copy and fuses LoRA.

Simple and always possible (a single process, pickle weights, models with their own ``load_weights``), but
S ranks read S copies and each holds a full model before the pipeline shards it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from vllm_diffusion_plugin.engine import weights
from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource, is_transformer
from vllm_diffusion_plugin.engine.lora import fuse_prepared, prepare_lora_files
from vllm_diffusion_plugin.engine.quant.fuse import fuse_files_into_fp8
from vllm_diffusion_plugin.engine.quant.layer import serialized_layers
from vllm_diffusion_plugin.engine.skeleton import build_component
from vllm_diffusion_plugin.engine.strategies.base import ComponentLoad, LoadContext


def load_full(source: ComponentSource, *, context: LoadContext,
              lora_files: Sequence[tuple[str, float]]) -> ComponentLoad:
    """Build the skeleton, stream every weight into it, fuse LoRA on plain tensors.

    Where the component ends whole on an accelerator with pinned staging (not a DiT FSDP2 will shard), the
    skeleton is built there and the weights arrive through the staging ring, so LoRA is fused on the device in
    place; otherwise on the host (mapped, copy-on-write), and the pipeline places or shards it afterwards."""

    options, report = context.options, context.report
    staging = context.staging if not (context.mesh is not None and is_transformer(source)) else None
    with report.phase("build"):
        module = build_component(source, dtype=context.dtype, device=context.device if staging else "cpu")
        if context.quantization is not None and is_transformer(source):
            context.quantization(module)  # quantized whole by post-load processing, after the LoRA
    with report.phase("read"):
        result = weights.load_into_module(module, source=source, strict_unexpected=options.strict_unexpected,
                                  progress=context.progress, map_private=True,  # untouched weights: no copy
                                  threads=options.threads, staging=staging)
    stats = None
    if lora_files:  # the accelerator computes when it is usable (lora.fuse's device rule)
        with report.phase("lora"):
            prepared = prepare_lora_files(module, lora_files, strict=options.lora_strict, component=source.name)
            fp8 = serialized_layers(module)  # a pre-quantized checkpoint's FP8 layers: dequantize, add, requantize
            if fp8:
                rest, stats = fuse_files_into_fp8(module.state_dict(keep_vars=True), [p.deltas for p in prepared],
                                                  fp8, modules=(n for n, _ in module.named_modules()),
                                                  options=options)
                prepared = [dataclasses.replace(p, deltas=r) for p, r in zip(prepared, rest) if r]
            more = fuse_prepared(module, prepared, chunk_mb=options.lora_device_chunk_mb,
                                 check_finite=options.lora_check_finite, progress=context.progress,
                                 name=source.name, host_weights=options.lora_host_weights) if prepared else None
            stats = more if stats is None else stats if more is None else stats + more
    return ComponentLoad(module, bytes_read=result.bytes_read, tensors=len(result.loaded), lora=stats)
