"""A loaded model's fused LoRA set replaced in place, exactly: the base of every module the old set changed re-read
from the checkpoint, the new set fused the way the load fuses it.

Fusion is not undone by subtraction: ``W + sBA - sBA`` is not ``W`` in bf16 (each add rounds; merge / unmerge
cycles drift), and a copy of the base would double the memory of what is touched. The checkpoint holds the base
exactly and each rank reads just its own rows of it (``io.rows``: one ``pread`` per row range, into the local
shard). So a swap is the row load (``strategies.rank_local.load_bound_rows``) run again on the touched part of each
DiT::

    validate: the new files read and checked against each DiT's skeleton (factors finite too), the checkpoint
      unchanged since the load, the peak held against free memory -- every rank agreeing; a refusal here changes
      nothing (:class:`LoraSwapRefused`)
    -> FSDP2's unsharded copies dropped -> per DiT: the touched modules' rows re-read into their shards, the new deltas
      fused into them, online-quantized layers quantized again and pre-quantized FP8 layers finished again from their
      re-read rows (a failure from here on: :class:`LoraSwapFailed`)

The touched part is every module the old or the new set changes, whole (all of its bound checkpoint tensors: a
stacked ``to_qkv``'s q, k and v; a quantized layer's every part and scale), so stacked parts and per-tensor scales
are recomputed from base rows as the load computed them: the same functions on the same rows give the same bits
(``rank_local`` fuses rows as ``full`` fuses whole tensors, bit for bit; ``tests/test_lora_swap.py`` holds both to a
fresh load). What the swap holds at its peak: the new LoRA factors, one block's transient rows of the
online-quantized layers it touches, one fusion chunk (:func:`planned_peak`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.config import LoadOptions
from vllm_diffusion_plugin.engine.errors import CheckpointError
from vllm_diffusion_plugin.engine.fused_stream import StreamFuser, delta_tensors, lora_fuser
from vllm_diffusion_plugin.engine.io import integrity
from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource, is_transformer
from vllm_diffusion_plugin.engine.io.integrity import FileStamp
from vllm_diffusion_plugin.engine.io.rows import identity_bindings
from vllm_diffusion_plugin.engine.lora.prepare import PreparedLora
from vllm_diffusion_plugin.engine.lora.specs import LoraSpec, assign_loras
from vllm_diffusion_plugin.engine.lora.types import LoraFormatError
from vllm_diffusion_plugin.engine.memory import host_available, reset_peak_rss, size_text, status_memory
from vllm_diffusion_plugin.engine.platform import free_memory
from vllm_diffusion_plugin.engine.quant.layer import serialized_layers
from vllm_diffusion_plugin.engine.quant.online import QuantLayer, is_online, local_part
from vllm_diffusion_plugin.engine.quant.whole import LAYER_WHOLE_ATTR
from vllm_diffusion_plugin.engine.strategies.rank_local import RowLoad, load_bound_rows

logger = init_logger(__name__)


class LoraSwapRefused(ValueError):
    """A LoRA swap refused before any weight changed (a bad LoRA file, a checkpoint changed since the load, not
    enough memory): the old set is still fused. The message is one line naming the file."""


class LoraSwapFailed(RuntimeError):
    """A LoRA swap that failed after weights began to change: the model holds part of the old set and part of the
    new one and must not serve until it is loaded (or swapped) again."""


@dataclass(frozen=True)
class FusedFile:
    """One LoRA file of a DiT's fused set, as it was when fused."""

    component: str
    path: Path
    scale: float
    stamp: FileStamp
    fused_at: float
    """``time.time()`` when the set it belongs to was fused."""

    @classmethod
    def of(cls, component: str, path: str | Path, scale: float, fused_at: float) -> FusedFile:
        return cls(component, Path(path).resolve(), scale, FileStamp.of(Path(path)), fused_at)

    def describe(self, hashes: dict[tuple[Path, FileStamp], str] | None) -> dict[str, Any]:
        """JSON-able: component, path, scale, fused_at (ISO 8601, UTC) and, given ``hashes`` (a cache of digests by
        file and stamp), sha256 of the file as fused (None once it changed on disk, saying how)."""
        entry = {"component": self.component, "path": str(self.path), "scale": self.scale,
                 "fused_at": datetime.fromtimestamp(self.fused_at, UTC).isoformat(timespec="seconds")}
        if hashes is None:
            return entry
        entry["sha256"] = None
        try:
            unchanged = FileStamp.of(self.path) == self.stamp
        except OSError as exc:
            return {**entry, "changed": f"gone since it was fused ({exc.strerror or exc})"}
        if not unchanged:
            return {**entry, "changed": "rewritten or replaced since it was fused"}
        key = (self.path, self.stamp)
        if key not in hashes:
            digest = hashlib.sha256()
            with open(self.path, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
            hashes[key] = digest.hexdigest()
        return {**entry, "sha256": hashes[key]}


class FusedSets:
    """Each DiT's fused LoRA set: the checkpoint tensors it changes (what a swap re-reads) and its files (what a
    report names). Recorded as a load prepares its LoRA files, replaced by each swap."""

    def __init__(self) -> None:
        self._sets: dict[str, tuple[set[str], list[FusedFile]]] = {}
        self._hashes: dict[tuple[Path, FileStamp], str] = {}

    def record(self, component: str, tensors: set[str], files: Sequence[tuple[str, float]],
               fused_at: float | None = None) -> None:
        fused_at = time.time() if fused_at is None else fused_at
        self._sets[component] = (set(tensors), [FusedFile.of(component, p, s, fused_at) for p, s in files])

    def tensors(self, component: str) -> set[str]:
        return self._sets.get(component, (set(), []))[0]

    def describe(self, components: Sequence[str] | None = None, *, sha256: bool = True) -> list[dict[str, Any]]:
        """The files of ``components``' sets (default all), DiT by DiT (``FusedFile.describe``; ``sha256``: each
        file hashed once per version, read whole the first time)."""
        return [f.describe(self._hashes if sha256 else None) for name, (_, files) in self._sets.items()
                if components is None or name in components for f in files]


@dataclass
class SwapReport:
    """What one swap did on this rank."""

    loras: list[dict[str, Any]]
    """The new set (``FusedFile.describe`` without sha256: ``LoadSession.fused_loras`` hashes the files)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """``validate`` (nothing changed yet), ``swap`` (rows re-read, fused, quantized), ``total``."""
    bytes_read: int = 0
    """Checkpoint bytes re-read on this rank."""
    tensors: int = 0
    """Checkpoint tensors re-read (this rank's rows of them)."""
    modules: int = 0
    """Touched modules, all DiTs together."""
    lora_targets: int = 0
    """LoRA targets fused on this rank."""
    planned_host_bytes: int = 0
    planned_device_bytes: int = 0
    peak_rss_growth: int | None = None
    """This process's peak RSS during the swap less its RSS before (None where the peak cannot be reset)."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def tensor_names(prepared: Sequence[PreparedLora], module: nn.Module) -> set[str]:
    """The checkpoint tensors LoRA files ``prepared`` against ``module`` (its names are checkpoint keys) change."""
    return {name for name, _, _ in delta_tensors([p.deltas for p in prepared], {n for n, _ in module.named_modules()})}


def module_rows(component: str, module: nn.Module, source: ComponentSource, *, device: torch.device,
                dtype: torch.dtype) -> RowLoad:
    """A diffusers DiT a session loaded itself (any strategy: names are checkpoint keys), as the row load sees it:
    each key bound to its own tensor whole, its online-quantized linears (their rows read in ``dtype``)."""
    if serialized_layers(module):
        raise LoraSwapRefused(f"{component} ({source.folder}) is a pre-quantized FP8 checkpoint loaded through its "
                              f"diffusers class; a LoRA swap re-finishes FP8 rows only where vllm-omni built the "
                              f"layers (--omni with hsdp_weight_load=rank_local): restart with the new set")
    online = [(name, sub) for name, sub in module.named_modules() if is_online(sub)]
    refuse_layer_whole(component, [name for name, sub in online if getattr(sub, LAYER_WHOLE_ATTR, False)])
    if whole := [name for name, sub in online if not getattr(sub, "weight_row_major", False)]:
        raise LoraSwapRefused(f"{component}'s online-quantized layers ({whole[0]} ...) are in their method's own "
                              f"layout (quantized whole by hsdp_weight_load=full/broadcast); a swap quantizes rows "
                              f"again where rank_local laid them out: load with hsdp_weight_load=rank_local to swap "
                              f"LoRAs, or restart with the new set")
    targets = module.state_dict(keep_vars=True)
    quantized = [QuantLayer(name, sub.quant_method, tuple(sub.weight.shape), dtype) for name, sub in online]
    return RowLoad(component, "", module, identity_bindings(source.tensors, targets), targets, device,
                   quantized=quantized)


def refuse_layer_whole(component: str, layers: Sequence[str]) -> None:
    """:class:`LoraSwapRefused` naming ``layers`` (online-quantized layers post-processed whole, ``quant.whole``)."""
    if layers:
        raise LoraSwapRefused(f"{component}'s online-quantized layers {', '.join(layers[:3])} ... were post-processed "
                              f"whole by their method (it declares no row protocol: rank_local's layer-whole path); "
                              f"a LoRA swap does not re-finish such layers yet: restart with the new set")


def touched(dit: RowLoad, source: ComponentSource, keys: set[str]) -> tuple[ComponentSource, RowLoad]:
    """The part of ``dit`` (and of its ``source``) a swap re-reads for checkpoint tensors ``keys``: every module one
    of them is bound into, whole -- all bindings into it, its quantized layers, the scales beside their weights."""
    modules = {b.target.rpartition(".")[0] for b in dit.bindings if b.key in keys}
    refuse_layer_whole(dit.component, [layer.module for layer in dit.whole if layer.module in modules])
    bindings = [b for b in dit.bindings if b.target.rpartition(".")[0] in modules]
    bound = {b.key for b in bindings} | {getattr(b, "scale_key", None) for b in bindings}
    scales = {k.removesuffix(".weight") + ".weight_scale" for k in bound if k}
    tensors = {k: info for k, info in source.tensors.items() if k in bound or k in scales}
    part = dataclasses.replace(dit, bindings=bindings,
                               quantized=[layer for layer in dit.quantized if layer.module in modules],
                               prequantized=[layer for layer in dit.prequantized if layer.module in modules])
    return dataclasses.replace(source, tensors=tensors), part


def planned_peak(fuser: StreamFuser | None, part: RowLoad, *, chunk_mb: int) -> tuple[int, int]:
    """``(host, device)`` bytes the swap of ``part`` holds at its peak on this rank beyond the model: the new LoRA
    factors (host), and the larger of one fusion chunk and the transient rows of its online-quantized layers (the
    rows are read in the load dtype before they are quantized; all of them at the worst, one block at a time)."""
    host = 0
    for per_file in fuser.deltas if fuser is not None else ():
        for delta in per_file.values():
            host += sum(v.numel() * v.element_size() for v in (delta.A, delta.B, delta.bias_delta, delta.full_delta)
                        if isinstance(v, torch.Tensor))
    transient = sum(local_part(part.targets[layer.weight]).numel() * layer.dtype.itemsize for layer in part.quantized)
    return host, max(transient, chunk_mb << 20)


def _agree(error: str | None) -> str | None:
    """Every rank's verdict: None when all ranks may go on, else the first refusal (with its rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return error
    verdicts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, error)
    refused = [(rank, v) for rank, v in enumerate(verdicts) if v is not None]
    if not refused:
        return None
    rank, first = refused[0]
    return first if error == first else f"rank {rank}: {first}"


def _check_memory(component: str, host: int, device_bytes: int, device: torch.device) -> None:
    available = host_available()
    if available is not None and host > available.available:
        raise LoraSwapRefused(f"a LoRA swap of {component} holds {size_text(host)} of LoRA factors in host memory; "
                              f"{size_text(available.available)} is available ({available.source})")
    free = free_memory(device)
    if free is not None and device_bytes > free:
        raise LoraSwapRefused(f"a LoRA swap of {component} holds up to {size_text(device_bytes)} of transient rows "
                              f"on {device}; {size_text(free)} is free")


def loaded_rows(loaded: Mapping[str, nn.Module], sources: Mapping[str, ComponentSource], *, device: torch.device,
                dtype: torch.dtype) -> dict[str, RowLoad]:
    """The DiTs among ``loaded`` (a session's own load) as the row load sees them (:func:`module_rows`)."""
    return {name: module_rows(name, module, sources[name], device=device, dtype=dtype)
            for name, module in loaded.items() if is_transformer(sources[name])}


@dataclass
class Swap:
    """One swap's inputs (see the module doc), as the session hands them over."""

    dits: Mapping[str, RowLoad]
    sources: Mapping[str, ComponentSource]
    stamps: Mapping[str, Mapping[Path, FileStamp]]
    fused: FusedSets
    """The sets fused now: replaced on success."""
    options: LoadOptions
    dtype: torch.dtype
    staging: Callable[[torch.device], Any]


def swap_loras(swap: Swap, lora_specs: Sequence[LoraSpec]) -> tuple[SwapReport, dict[str, list[LoraSpec]]]:
    """The swap of the module doc to ``lora_specs`` (assigned to the DiTs as at load) on this rank; every rank calls
    it alike. Returns the report and the new assignment."""
    start, options = time.perf_counter(), swap.options
    rss_before = status_memory().get("VmRSS", 0) if reset_peak_rss() else None
    fusers: dict[str, StreamFuser | None] = {}
    changes: dict[str, set[str]] = {}  # per DiT: the checkpoint tensors the new set changes
    parts: dict[str, tuple[ComponentSource, RowLoad]] = {}
    report, assigned, error = SwapReport(loras=[]), {}, None
    try:
        assigned = assign_loras(lora_specs, list(swap.dits))
        for name, dit in swap.dits.items():
            source = swap.sources[name]
            fuser = lora_fuser(source, [(str(s.path), s.scale) for s in assigned[name]], dtype=swap.dtype,
                               strict=options.lora_strict, chunk_mb=options.lora_device_chunk_mb,
                               check_finite=options.lora_check_finite, host_weights=options.lora_host_weights)
            integrity.check_unchanged(swap.stamps[name], component=name)
            changes[name] = fuser.tensor_names() if fuser is not None else set()
            parts[name], fusers[name] = touched(dit, source, swap.fused.tensors(name) | changes[name]), fuser
            host, device_bytes = planned_peak(fuser, parts[name][1], chunk_mb=options.lora_device_chunk_mb)
            report.planned_host_bytes += host
            report.planned_device_bytes = max(report.planned_device_bytes, device_bytes)
            _check_memory(name, host, device_bytes, dit.device)
    except (LoraFormatError, CheckpointError, LoraSwapRefused, OSError, ValueError) as exc:
        error = " ".join(str(exc).split()) or type(exc).__name__
    error = _agree(error)
    if error is not None:
        raise LoraSwapRefused(f"LoRA swap refused, the fused set is unchanged: {error}")
    report.seconds["validate"] = time.perf_counter() - start
    failure: BaseException | None = None
    try:
        for name, (source, part) in parts.items():
            for sub in part.module.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()  # a gathered copy would hide the new rows until the next all-gather
            done = load_bound_rows(source, part, fuser=fusers[name], options=options,
                                   staging=swap.staging(part.device))
            report.bytes_read += done.bytes_read
            report.tensors += len(done.keys)
            report.modules += len({b.target.rpartition(".")[0] for b in part.bindings})
            report.lora_targets += done.lora.targets if done.lora is not None else 0
    except Exception as exc:  # noqa: BLE001 (told to every rank below: none may serve a mixed model)
        failure = exc
    try:  # the swap ends when every rank holds the new set
        mixed = _agree(None if failure is None else f"{type(failure).__name__}: {failure}")
    except Exception as exc:  # noqa: BLE001 (a rank gone: the agreement itself failed)
        failure, mixed = exc, f"{type(exc).__name__}: {exc}"
    if mixed is not None:
        raise LoraSwapFailed(f"LoRA swap failed after weights began to change ({mixed}); the model holds part of "
                             f"the old set and part of the new: do not serve it") from failure
    fused_at = time.time()
    for name in fusers:
        swap.fused.record(name, changes[name], [(str(s.path), s.scale) for s in assigned[name]], fused_at)
    if rss_before is not None:
        report.peak_rss_growth = status_memory().get("VmHWM", 0) - rss_before
    report.seconds["swap"] = time.perf_counter() - start - report.seconds["validate"]
    report.seconds["total"] = time.perf_counter() - start
    report.loras = swap.fused.describe(list(swap.dits), sha256=False)
    logger.info("LoRA swap: %d modules of %s re-read (%s on this rank, %d tensors) and fused with %d file(s) in "
                "%.2f s (validate %.2f s)", report.modules, ", ".join(swap.dits), size_text(report.bytes_read),
                report.tensors, len(report.loras), report.seconds["total"], report.seconds["validate"])
    return report, assigned
