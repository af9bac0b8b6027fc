"""What the weight-load strategies share: their names, errors, result type, the pre-flight check and the one
call shape the pipeline uses for all of them.

A strategy is a function ``load(source, *, context, lora_files) -> ComponentLoad`` (``Strategy``); the
pipeline picks it by name from ``strategies.LOADERS`` and calls every strategy the same way. ``context`` holds
what a load's components share (options, device, dtype, report, mesh, broadcast channel).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine import skeleton
from vllm_diffusion_plugin.engine.config import WEIGHT_LOAD_STRATEGIES, LoadOptions
from vllm_diffusion_plugin.engine.errors import StrategyError
from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource, is_transformer
from vllm_diffusion_plugin.engine.lora import prepare_lora_files
from vllm_diffusion_plugin.engine.report import LoadReport

logger = init_logger(__name__)

STRATEGIES = WEIGHT_LOAD_STRATEGIES
"""Values of ``hsdp_weight_load``."""


@dataclass(frozen=True)
class ComponentLoad:
    """What loading one component on this rank produced."""

    module: nn.Module
    bytes_read: int
    """Checkpoint bytes this rank read (counted in the reader)."""
    tensors: int
    """Checkpoint tensors that went into the module on this rank."""
    lora: Any = None
    """``lora.FuseStats`` when LoRA was fused on this rank, else None."""
    shard: Any = None
    """``hsdp.ShardReport`` when the strategy sharded the module itself (``rank_local``), else None."""
    quant_path: str | None = None
    """How ``rank_local`` finished its online-quantized layers (``quant.whole.quant_path``), else None."""


@dataclass(frozen=True)
class LoadContext:
    """What every component of one load shares; each strategy reads the fields it needs."""

    options: LoadOptions
    device: torch.device
    """Where the components end (``rank_local`` allocates its local shards there directly)."""
    dtype: torch.dtype
    report: LoadReport
    hsdp: Any = None
    """``hsdp.HSDPConfig`` when the DiTs are sharded, else None."""
    mesh: Any = None
    """The HSDP ``DeviceMesh`` when the DiTs are sharded, else None."""
    channel: Any = None
    """``broadcast.BroadcastChannel`` during a ``broadcast`` load, else None."""
    progress: bool | None = None
    """Progress bar: None = when interactive, False = never (ranks other than 0)."""
    staging: Any = None
    """``staging.DeviceStaging`` when weights land on an accelerator through pinned memory, else None."""
    quantization: Any = None
    """``quantization(module)``: gives a freshly built DiT skeleton (on ``meta`` or not) its online quant methods,
    as vLLM's ``quant_config`` does for the models it builds; None: no quantization (``engine.quant.online``)."""


class Strategy(Protocol):
    """The call every strategy answers: load ``source`` on this rank, fusing ``lora_files`` (path, scale)."""

    def __call__(self, source: ComponentSource, *, context: LoadContext,
                 lora_files: Sequence[tuple[str, float]]) -> ComponentLoad: ...


def check_strategy(strategy: str, *, sources: Sequence[ComponentSource], world_size: int, sharded: bool) -> str:
    """The strategy to use for this load, or ``StrategyError`` naming one that works. Reads nothing.

    ``sharded``: whether the DiTs are sharded with HSDP. The checks hold for any world size; with one
    process the answer is ``full`` (there is nobody to send to and nothing to split).
    """
    if strategy not in STRATEGIES:
        raise StrategyError(f"hsdp_weight_load must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy == "full":
        return strategy
    concerned = [s for s in sources if strategy == "broadcast" or is_transformer(s)]
    for source in concerned:
        cls = skeleton.component_class(source)
        if callable(getattr(cls, "load_weights", None)):
            raise StrategyError(
                f"hsdp_weight_load={strategy}: {cls.__name__} ({source.folder}) maps checkpoint tensors onto its "
                f"parameters with its own load_weights (renamed/stacked tensors), which {strategy} cannot apply "
                f"(it moves tensors by checkpoint key{' and row range' if strategy == 'rank_local' else ''}); "
                f"use hsdp_weight_load=full")
    if strategy == "rank_local":
        pickled = [s for s in concerned if s.format != "safetensors"]
        if pickled:
            raise StrategyError(
                f"hsdp_weight_load=rank_local reads row ranges of safetensors files, but {pickled[0].folder} "
                f"holds pickle weights ({pickled[0].files[0].name}), which can only be read whole; use "
                f"hsdp_weight_load=broadcast (rank 0 reads them once) or convert the checkpoint to safetensors")
        if world_size > 1 and not sharded:
            raise StrategyError(
                f"hsdp_weight_load=rank_local reads each rank's rows of the HSDP shards, but this load of "
                f"{world_size} ranks does not shard with HSDP; use hsdp_weight_load=broadcast (one read, sent "
                f"to every rank)")
    if world_size == 1:
        logger.info("hsdp_weight_load=%s with a single process: loading with 'full'.", strategy)
        return "full"
    return strategy


def normalize_lora_files(module: nn.Module, files: Sequence[tuple[str, float]], *, strict: bool,
                         component: str | None = None) -> list[dict[str, Any]]:
    """Read and validate every LoRA file against ``module`` (a meta skeleton is enough); one delta dict per
    file, fused in this order. Nothing is touched."""
    return [lora.deltas for lora in prepare_lora_files(module, files, strict=strict, component=component)]
