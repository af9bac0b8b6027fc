"""The load session: one load on this rank, from the pre-flight to the report, whichever door it came through.

``load_all`` is the whole load of a diffusers checkpoint (the CLI's ranks, ``load_components``): resolve -> per
component read -> LoRA -> quantize -> post-process -> shard (by strategy), under the pressure watch -> report. A door
whose framework builds the model (vLLM, vllm-omni) runs the same order with the parts it needs, handing over only
what it alone knows (the model, its names, the rows it traced): ``preflight``, ``adopt``, ``prepare_loras`` /
``stream_fuser``, ``reading``, ``staging``, ``stream`` / ``fill`` / ``load_rows``, ``fuse``, ``shard``,
``finish``. This module is the engine's face: the doors import from it alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine import platform, preflight, pressure, swap, weights
from vllm_diffusion_plugin.engine.config import LOAD_FORMAT, LoadOptions
from vllm_diffusion_plugin.engine.errors import DistributedLoadError, PickleRefusedError, StrategyError, WeightLoadError
from vllm_diffusion_plugin.engine.fused_stream import StreamFuser, lora_fuser
from vllm_diffusion_plugin.engine.hsdp import HSDPConfig, apply_hsdp, build_mesh
from vllm_diffusion_plugin.engine.io import integrity
from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource, is_dit_class, is_transformer, resolve_checkpoint
from vllm_diffusion_plugin.engine.io.diffusers_classes import import_diffusers, model_class
from vllm_diffusion_plugin.engine.io.rows import RowBinding
from vllm_diffusion_plugin.engine.io.staging import DeviceStaging, place_module
from vllm_diffusion_plugin.engine.io.stream import LoadStats, iterate_weights
from vllm_diffusion_plugin.engine.io.threads import bounded_reads
from vllm_diffusion_plugin.engine.lora.fuse import fuse_prepared, resolve_compute_device
from vllm_diffusion_plugin.engine.lora.prepare import PreparedLora, prepare_lora_files
from vllm_diffusion_plugin.engine.lora.specs import LoraSpec, assign_loras
from vllm_diffusion_plugin.engine.memory import peak_rss_bytes, private_rss, size_text, status_memory
from vllm_diffusion_plugin.engine.plan import plan_load, plan_module_load
from vllm_diffusion_plugin.engine.platform import (
    World,
    accelerator_of,
    accelerator_type,
    dist_backend,
    resolve_target_device,
)
from vllm_diffusion_plugin.engine.postprocess import process_weights_after_loading
from vllm_diffusion_plugin.engine.preflight import check as check_plan
from vllm_diffusion_plugin.engine.quant.checkpoints import check_sources, quantization_config
from vllm_diffusion_plugin.engine.quant.online import row_wise_methods
from vllm_diffusion_plugin.engine.quant.parts import DequantizedBinding, bind, scale_key
from vllm_diffusion_plugin.engine.quant.plan import online_fp8_hook
from vllm_diffusion_plugin.engine.report import ComponentReport, LoadReport, format_table, merge_ranks, report_line
from vllm_diffusion_plugin.engine.save import LoadedComponents, save_components
from vllm_diffusion_plugin.engine.skeleton import build_component, component_class
from vllm_diffusion_plugin.engine.strategies import LOADERS, LoadContext, broadcast, check_strategy
from vllm_diffusion_plugin.engine.strategies.rank_local import (
    RowLoad,
    load_bound_rows,
    materialize_local_shards,
    row_layers,
    to_row_layout,
)
from vllm_diffusion_plugin.engine.swap import LoraSwapFailed, LoraSwapRefused, SwapReport
from vllm_diffusion_plugin.engine.weights import LoadResult

logger = init_logger(__name__)

__all__ = [  # the face the doors use: the session, its options and results, and what a door hands it
    "LOAD_FORMAT", "ComponentReport", "ComponentSource", "DistributedLoadError", "HSDPConfig", "LoadOptions",
    "LoraSwapFailed", "LoraSwapRefused", "PickleRefusedError", "StrategyError", "SwapReport",
    "process_weights_after_loading", "quantization_config",
    "LoadSession", "LoadedComponents", "LoraSpec", "RowBinding", "RowLoad", "StreamFuser", "WeightLoadError", "World",
    "accelerator_of", "dist_backend", "is_transformer", "load_components", "resolve_checkpoint",
    "resolve_compute_device", "resolve_target_device", "save_components", "row_wise_methods",
    # diffusers in a process that only loads: without what a load never uses, one model class at a time
    "import_diffusers", "is_dit_class", "model_class",
    # rank_local behind a door that builds its model (vllm-omni): its quantized layers, their layout, the rows traced
    "DequantizedBinding", "bind", "materialize_local_shards", "row_layers", "scale_key", "status_memory",
    "to_row_layout",
    # the pre-flight where no session loads (a launcher, an API server): the plan, the memory it is held against
    "accelerator_type", "check_plan", "online_fp8_hook", "plan_load", "plan_module_load",
    "private_rss", "size_text", "check_strategy",
    # the reports of a load's ranks together
    "format_table", "merge_ranks"]


class LoadSession:
    """One load on this rank (see the module docstring); every rank of a world runs its own with the same arguments.
    ``progress``: bars on rank 0 when stderr is a terminal (True always, None over 1 GiB, False never);
    ``quantization``: gives each DiT skeleton its online quant methods (``LoadContext.quantization``)."""

    def __init__(self, options: LoadOptions, *, device: torch.device | None, dtype: torch.dtype,
                 hsdp: HSDPConfig | None = None, lora_specs: Sequence[LoraSpec] = (), progress: bool | None = None,
                 quantization=None, strategy: str = "full", world: World | None = None) -> None:
        device = platform.local_device() if device is None else device  # None: this process's accelerator
        self.options, self.device, self.dtype = options, device, dtype
        self.world = world or World.current()
        self.hsdp = hsdp.resolved(self.world.world_size) if hsdp is not None else None
        self.lora_specs, self.progress, self.quantization = list(lora_specs), progress, quantization
        self.report = LoadReport(rank=self.world.rank, world_size=self.world.world_size, device=str(device),
                                 dtype=str(dtype).removeprefix("torch."), read_threads=options.threads,
                                 strategy=strategy)
        if self.hsdp is not None:
            self.report.layout = self.hsdp.mesh_shape
        self.sources: dict[str, ComponentSource] = {}
        self.loras: dict[str, list[LoraSpec]] = {}
        self._stamps: dict[str, dict] = {}
        self._staging: dict[torch.device, DeviceStaging | None] = {}
        self.loaded: LoadedComponents | None = None  # what load_all loaded (not a door's own model)
        self.fused = swap.FusedSets()

    # ---- before the first weight byte ---------------------------------------------------------------------------
    def preflight(self, plan, *, how: str, strategy: str | None = None, host: bool = False, rank: int | None = None,
                  starting: int = 0, before_verdict=None, strategies: Sequence[str] | None = None) -> None:
        """``plan`` held against this rank's accelerator (and, with ``host``, this node's host memory): refused,
        warned about or said as ``options.preflight`` says (``preflight.check``; ``how``: how this door's user sets
        it to ``warn``)."""
        if plan is None:
            return
        preflight.check(plan, strategy or self.options.hsdp_weight_load, mode=self.options.preflight, how=how,
                        host=host, device=self.device, rank=self.world.rank if rank is None else rank,
                        starting=starting, before_verdict=before_verdict, strategies=strategies)

    def resolve(self, checkpoint: str | os.PathLike, *,
                components: Sequence[str] | None = None) -> list[ComponentSource]:
        """The checkpoint's components (headers only), adopted (:meth:`adopt`)."""
        with self.report.phase("resolve"):
            sources = resolve_checkpoint(checkpoint, components=components, allow_pickle=self.options.allow_pickle)
        self.adopt(sources)
        return sources

    def adopt(self, sources: Sequence[ComponentSource], *, dits: Sequence[str] | None = None,
              lora_specs: Sequence[LoraSpec] | None = None, our_quantization: bool = True) -> None:
        """Take ``sources`` into this load: each file stamped right after its header was read (a file that changes
        later is named), the LoRA files (``lora_specs``, default the session's) assigned to ``dits`` (default: the
        components that are diffusers transformers), and -- ``our_quantization``: the layers are ours, not a
        framework's -- pre-quantized FP8 checkpoints carried, any other pre-quantization refused by name."""
        if lora_specs is not None:
            self.lora_specs = list(lora_specs)
        with self.report.phase("resolve"):
            if our_quantization:
                check_sources(sources)
            for source in sources:
                self.sources[source.name] = source
                self._stamps[source.name] = integrity.stamp(source.files)
        if dits is None:
            dits = [s.name for s in self.sources.values() if is_transformer(s)]
        self.loras = assign_loras(self.lora_specs, dits) if self.lora_specs else {}

    def free_memory(self) -> int | None:
        """Free bytes of this session's accelerator, as its backend says (None on the CPU)."""
        return platform.free_memory(self.device)

    def watch(self, what: str, *, whole_process: bool = False):
        """The memory-pressure watch for ``what``: a context manager, or for the process's life (``whole_process``)."""
        return pressure.watch_process(what) if whole_process else pressure.watching(what)

    def mark_baseline(self) -> None:
        """This process's RSS now is what the load starts from (``baseline_rss_bytes``)."""
        self.report.baseline_rss_bytes = status_memory().get("VmRSS", 0)

    def lora_files(self, name: str) -> list[tuple[str, float]]:
        """``(path, scale)`` of the LoRA files component ``name`` gets, in fusion order."""
        return [(str(s.path), s.scale) for s in self.loras.get(name, ())]

    def prepare_loras(self, source: ComponentSource, *, module: nn.Module | None = None,
                      packed_modules: Mapping[str, Sequence[str]] | None = None) -> list[PreparedLora]:
        """``source``'s LoRA files read and checked (keys, ranks, shapes) against ``module`` -- default its skeleton
        built on ``meta`` from its config -- before any of its weights is read; empty without any."""
        files = self.lora_files(source.name)
        if not files:
            return []
        with self.report.phase("lora"):
            module = module if module is not None else build_component(source, dtype=self.dtype, device="meta")
            prepared = prepare_lora_files(module, files, strict=self.options.lora_strict,
                                          packed_modules=packed_modules, component=source.name)
        self.fused.record(source.name, swap.tensor_names(prepared, module), files)
        return prepared

    def stream_fuser(self, source: ComponentSource, *, dtype: torch.dtype | None = None) -> StreamFuser | None:
        """The fuser of :meth:`stream` for ``source``'s LoRA files (``fused_stream.lora_fuser``); None without any."""
        options = self.options
        with self.report.phase("lora"):
            fuser = lora_fuser(source, self.lora_files(source.name), dtype=dtype or self.dtype,
                               strict=options.lora_strict, chunk_mb=options.lora_device_chunk_mb,
                               check_finite=options.lora_check_finite, host_weights=options.lora_host_weights)
        self.fused.record(source.name, fuser.tensor_names() if fuser else set(), self.lora_files(source.name))
        return fuser

    def component(self, source: ComponentSource) -> ComponentReport:
        """A new entry of the report for ``source``."""
        entry = ComponentReport(name=source.name, class_name=str(source.config.get("_class_name", "?")),
                                files=len(source.files), lora_files=len(self.loras.get(source.name, ())))
        self.report.components.append(entry)
        return entry

    # ---- reads --------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def reading(self, *names: str) -> Iterator[None]:
        """Around reads of components ``names`` (and what consumes them): a file of one that changed since it was
        stamped is named (``io.integrity``), and no read waits longer than ``read_timeout_s``."""
        with contextlib.ExitStack() as stack:
            for name in names:
                stack.enter_context(integrity.unchanged(self._stamps[name], component=name))
            stack.enter_context(bounded_reads(self.options.read_timeout_s))
            yield

    def staging(self, device: torch.device | None) -> DeviceStaging | None:
        """The pinned staging ring (``pinned_staging_mb``) for reads onto ``device``, one per device; None on the host,
        with 0 bytes, or where pinned memory cannot be had."""
        if device is None:
            return None
        if device not in self._staging:
            self._staging[device] = DeviceStaging.open(device, max_bytes=self.options.pinned_staging_mb << 20,
                                                       threads=self.options.threads)
        return self._staging[device]

    def stream(self, source: ComponentSource, *, entry: ComponentReport, fuser: StreamFuser | None = None,
               device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``source``'s tensors in order, LoRA fused by ``fuser``, on ``device`` through the staging ring when it is
        an accelerator; bytes, tensors, seconds and the LoRA counted into ``entry``. A file that changed since it
        was stamped is named once its tensors were read, or when a read failed; a failure in the consumer is the
        caller's to check (:meth:`reading`)."""
        stats, start = LoadStats(), time.perf_counter()
        with self.reading(source.name):
            if fuser is not None and (keys := fuser.fp8_scale_keys()):
                fuser.read_fp8_scales(iterate_weights(source, stats=stats, keys=keys))
            for name, tensor in iterate_weights(source, stats=stats, threads=self.options.threads,
                                                staging=self.staging(device)):
                if fuser is None:
                    yield name, tensor
                else:
                    yield from fuser.items(name, tensor)
        entry.bytes_read, entry.tensors = stats.total_bytes, stats.tensors
        if fuser is not None:
            fuser.check_consumed(source.name)
            entry.record_lora(fuser.stats, fuser.seconds)
        entry.read_s = time.perf_counter() - start - entry.lora_s

    def fill(self, module: nn.Module, source: ComponentSource, *, entry: ComponentReport) -> LoadResult:
        """Every tensor of ``source`` into ``module`` (through its own ``load_weights`` where it has one: a model vLLM
        built), strictly checked, onto its accelerator through the staging ring; counted into ``entry``."""
        options = self.options
        with self.reading(source.name):
            result = weights.load_into_module(module, source=source, strict_unexpected=options.strict_unexpected,
                                              threads=options.threads, staging=self.staging(accelerator_of([module])))
        entry.bytes_read, entry.tensors, entry.read_s = result.bytes_read, len(result.loaded), result.seconds
        return result

    def tensors(self, source: ComponentSource, *,
                device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``source``'s tensors by checkpoint name, in order (on ``device`` through the staging ring)."""
        return iterate_weights(source, threads=self.options.threads, staging=self.staging(device))

    def fuse(self, module: nn.Module, prepared: Sequence[PreparedLora], *, entry: ComponentReport):
        """The prepared LoRA files fused into ``module``'s loaded weights, file after file, with the device rule
        (``lora.fuse``); counted into ``entry``. Returns the ``FuseStats``."""
        start = time.perf_counter()
        options = self.options
        stats = fuse_prepared(module, prepared, chunk_mb=options.lora_device_chunk_mb,
                              check_finite=options.lora_check_finite, host_weights=options.lora_host_weights)
        entry.record_lora(stats, time.perf_counter() - start)
        return stats

    def shard(self, module: nn.Module, *, entry: ComponentReport):
        """``module`` sharded with HSDP when it declares ``_hsdp_shard_conditions`` or ``hsdp_block_pattern`` is set."""
        if not getattr(module, "_hsdp_shard_conditions", None) and not self.options.hsdp_block_pattern:
            return None
        if not dist.is_initialized():
            raise RuntimeError("HSDP was requested but torch.distributed is not initialized")
        config = HSDPConfig(replicate_size=self.options.hsdp_replicate_size, shard_size=self.options.hsdp_shard_size)
        shard = apply_hsdp(module, mesh=build_mesh(config, device_type=self.device.type), config=config,
                           pattern=self.options.hsdp_block_pattern)
        entry.param_bytes_local, entry.sharded_blocks, entry.shard_rule = shard.local_bytes, len(shard.blocks), \
            shard.source
        return shard

    def load_all(self, checkpoint: str | os.PathLike, *, components: Sequence[str] | None = None) -> LoadedComponents:
        """Every component of ``checkpoint`` (default: its DiTs) loaded on this rank, the DiTs sharded with HSDP when
        the session has an HSDP config, the others placed on the device; the report finished."""
        sources = self.resolve(checkpoint, components=components)
        with self.report.phase("imports"):  # code, not weights: a diffusers model module pulls in ~400 MB and seconds
            for source in sources:
                component_class(source)
        self.mark_baseline()
        self.loaded = loaded = LoadedComponents({}, {s.name: s for s in sources}, self.report, progress=self.progress)
        with self.report.phase("total"), self.watch(f"rank {self.world.rank}'s load of {checkpoint}"):
            context = self._open(sources)
            for source in sources:
                loaded.modules[source.name] = self.load(source, context=context, shard_reports=loaded.shard_reports)
            if context.channel is not None:  # not after a failure: a group with a dead peer may block in teardown
                context.channel.close()
        self.finish()
        return loaded

    def _open(self, sources: Sequence[ComponentSource]) -> LoadContext:
        """The strategy, the LoRA files checked against ``meta`` skeletons (errors before any base read), the mesh,
        the staging ring and, for ``broadcast``, its channel: what every component of the load shares."""
        sharded = self.hsdp is not None
        self.report.strategy = check_strategy(self.options.hsdp_weight_load, sources=sources,
                                              world_size=self.world.world_size, sharded=sharded)
        for source in sources:
            self.prepare_loras(source)
        mesh = build_mesh(self.hsdp, device_type=self.device.type) if sharded else None
        context = LoadContext(options=self.options, device=self.device, dtype=self.dtype, report=self.report,
                              hsdp=self.hsdp, mesh=mesh, progress=self.progress if self.world.rank == 0 else False,
                              staging=self.staging(self.device), quantization=self.quantization)
        if self.report.strategy == "broadcast":
            context = dataclasses.replace(context, channel=broadcast.open_channel(self.options, self.device))
        return context

    def load(self, source: ComponentSource, *, context: LoadContext, shard_reports: dict[str, object]) -> nn.Module:
        """One component: read (by strategy) -> LoRA -> post-process -> shard the DiTs / place the rest."""
        with self.reading(source.name):  # a file changed under the load is named, also while the module views it
            return self._load(source, context=context, shard_reports=shard_reports)

    def _load(self, source: ComponentSource, *, context: LoadContext, shard_reports: dict[str, object]) -> nn.Module:
        report, strategy, mesh = self.report, self.report.strategy, context.mesh
        entry = self.component(source)
        sharded = is_transformer(source) and mesh is not None
        load = LOADERS["full" if strategy == "rank_local" and not sharded else strategy]
        before = dict(report.seconds)
        out = load(source, context=context, lora_files=self.lora_files(source.name))
        entry.read_s, entry.lora_s = (report.seconds.get(p, 0.0) - before.get(p, 0.0) for p in ("read", "lora"))
        module = out.module.requires_grad_(False)  # inference: FSDP2 then accepts mixed fp32/bf16 params
        entry.bytes_read, entry.tensors, entry.quant_path = out.bytes_read, out.tensors, out.quant_path
        entry.param_bytes_total = sum(p.numel() * p.element_size() for p in module.parameters())
        if out.lora is not None:
            entry.record_lora(out.lora, entry.lora_s)
        with report.phase("postprocess"):  # online-quant finalize + HSDP-aware post-load processing
            process_weights_after_loading(module, target_device=context.device)
        with report.phase("shard"):
            shard = out.shard
            if sharded and shard is None:
                shard = apply_hsdp(module, mesh=mesh, config=context.hsdp, pattern=context.options.hsdp_block_pattern,
                                   staging=context.staging, threads=context.options.threads)
            if shard is not None:
                shard_reports[source.name] = shard
                entry.param_bytes_local = shard.local_bytes
                entry.sharded_blocks, entry.shard_rule = len(shard.blocks), shard.source
            else:
                place_module(module, context.device, context.staging, threads=context.options.threads)
                entry.param_bytes_local = entry.param_bytes_total
        logger.info("Loaded %s %s from %s on %s%s", source.name, entry.class_name, source.folder, context.device,
                    f", sharded {entry.sharded_blocks} blocks ({entry.shard_rule})" if entry.shard_rule else "")
        return module

    def load_rows(self, source: ComponentSource, *, entry: ComponentReport, rows: RowLoad,
                  fuser: StreamFuser | None) -> set[str]:
        """``rank_local`` for a DiT its door sharded on ``meta`` and whose rows it traced (``rows``): this rank's rows
        read, LoRA fused, quantized where its layers are; counted into ``entry``; the checkpoint keys read."""
        start = time.perf_counter()
        with self.reading(source.name):
            done = load_bound_rows(source, rows, fuser=fuser, options=self.options, staging=self.staging(rows.device))
        entry.bytes_read, entry.tensors, entry.quant_path = done.bytes_read, len(done.keys), done.quant_path
        entry.read_s = time.perf_counter() - start - done.lora_s
        if done.lora is not None or done.lora_s:
            entry.record_lora(done.lora, done.lora_s)
        return done.keys

    def swap_loras(self, lora_specs: Sequence[LoraSpec], *, dits: Mapping[str, RowLoad] | None = None) -> SwapReport:
        """After the load: the fused LoRA set of ``dits`` (component -> the ``RowLoad`` its door loaded; default the
        DiTs of :meth:`load_all`) replaced by ``lora_specs``, exactly (``engine.swap``; every rank calls it alike):
        :class:`LoraSwapRefused` before any weight changed, :class:`LoraSwapFailed` after."""
        if dits is None:
            dits = swap.loaded_rows(self.loaded.modules if self.loaded else {}, self.sources, device=self.device,
                                    dtype=self.dtype)
        report, self.loras = swap.swap_loras(swap.Swap(dits, self.sources, self._stamps, self.fused, self.options,
                                                       self.dtype, self.staging), lora_specs)
        return report

    def fused_loras(self) -> list[dict]:  # what swap_loras reports: component, path, scale, sha256, fused_at
        return self.fused.describe()

    def finish(self, *, total_s: float | None = None, names: Iterable[str] | None = None,
               log: logging.Logger | None = None) -> LoadReport:
        """The report finished (the peak RSS), one INFO line per component (``names``: those to report, an empty entry
        for one this rank did not read) on ``log`` -- the door's logger -- and returned."""
        report = self.report.finish()
        by_name = {c.name: c for c in report.components}
        total = report.seconds.get("total", 0.0) if total_s is None else total_s
        for name in by_name if names is None else names:
            entry = by_name.get(name) or ComponentReport(name=name, class_name="?")
            (log or logger).info("%s total_s=%.3f peak_rss=%d baseline_rss=%d", report_line(report, entry), total,
                        peak_rss_bytes(), report.baseline_rss_bytes)
        return report


def load_components(checkpoint: str | os.PathLike, *, options: LoadOptions, components: Sequence[str] | None = None,
                    device: torch.device, dtype: torch.dtype, hsdp: HSDPConfig | None = None,
                    lora_specs: Sequence[LoraSpec] = (), progress: bool | None = None,
                    quantization=None) -> LoadedComponents:
    """``LoadSession.load_all`` of a diffusers checkpoint on this rank: its DiTs LoRA-fused and, with ``hsdp``,
    sharded over a ``(replicate, shard)`` mesh of the current world (every rank calls it alike); the rest placed."""
    session = LoadSession(options, device=device, dtype=dtype, hsdp=hsdp, lora_specs=lora_specs, progress=progress,
                          quantization=quantization)
    return session.load_all(checkpoint, components=components)
