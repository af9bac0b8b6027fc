"""The load pipeline every door uses, as one function of named steps.

    resolve checkpoint -> choose the weight-load strategy -> build module skeleton -> stream weights (strict
      check) -> fuse LoRA -> finalize online quant + process weights after loading -> shard with HSDP
      -> place other components

FSDP2 fixes the order: LoRA fusion and post-load processing run on plain tensors before ``fully_shard``,
except with ``hsdp_weight_load=rank_local``, where the DiT is sharded on ``meta`` first, each rank reads its own
rows and fuses LoRA into them (``strategies.rank_local``). ``broadcast`` replaces "stream weights" by rank 0
streaming and sending (``strategies.broadcast``). The read step calls the chosen strategy from
``strategies.LOADERS`` the same way for all three. Everything that can be validated (checkpoint layout, LoRA
assignment, HSDP sizes, strategy) is validated before the first weight is read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine import integrity, platform, prequant
from vllm_diffusion_plugin.engine.checkpoint import ComponentSource, is_transformer, resolve_checkpoint
from vllm_diffusion_plugin.engine.config import LoadOptions
from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
from vllm_diffusion_plugin.engine.report import ComponentReport, LoadReport, report_line, status_memory

logger = init_logger(__name__)


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA file to fuse: ``[COMPONENT=]PATH[@SCALE]`` on the command line / in ``lora_path``."""

    path: Path
    scale: float = 1.0
    component: str | None = None
    """The component it applies to; None: decided by position (see ``assign_loras``)."""

    @classmethod
    def parse(cls, text: str, *, default_scale: float = 1.0) -> LoraSpec:
        """``@SCALE`` multiplies ``default_scale``. An ``@`` whose tail is no number belongs to the file name,
        unless only the part before it names a file: then the scale is malformed, an error naming the spec."""
        component, sep, rest = text.partition("=")
        if not sep or os.sep in component:
            component, rest = None, text
        elif not component.strip():
            raise ValueError(f"LoRA {text!r}: empty component name before '=' (COMPONENT=PATH[@SCALE])")
        path, sep, scale_text = rest.rpartition("@")
        scale = default_scale
        if sep:
            try:
                scale = float(scale_text) * default_scale
            except ValueError:
                if Path(path).is_file() and not Path(rest).exists():
                    raise ValueError(f"LoRA {text!r}: the scale {scale_text!r} after '@' is not a number "
                                     f"([COMPONENT=]PATH[@SCALE])") from None
                path = rest  # an '@' that is part of the file name
        else:
            path = rest
        return cls(Path(path), scale, component or None)


def assign_loras(specs: Sequence[LoraSpec], transformers: Sequence[str]) -> dict[str, list[LoraSpec]]:
    """Which LoRA files each transformer gets.

    A spec naming its component goes there. Unnamed specs: one transformer -> all of them (stacked);
    as many unnamed specs as transformers -> by position (Wan2.2 A14B: the high-noise LoRA for
    ``transformer``, the low-noise one for ``transformer_2``); one spec and several transformers -> all
    transformers; anything else is ambiguous and an error.
    """
    if specs and not transformers:
        raise ValueError(f"{len(specs)} LoRA file(s) ({specs[0].path} ...) but no DiT is loaded (no component "
                         f"whose class is a diffusers transformer); nothing would fuse them")
    assigned: dict[str, list[LoraSpec]] = {name: [] for name in transformers}
    unnamed = [s for s in specs if s.component is None]
    for spec in specs:
        if spec.component is not None:
            if spec.component not in assigned:
                raise ValueError(f"LoRA {spec.path} names component {spec.component!r}, which is not loaded; "
                                 f"loaded transformers: {', '.join(transformers)}")
            assigned[spec.component].append(spec)
    for spec in specs:
        if not spec.path.exists():
            raise FileNotFoundError(f"LoRA file {spec.path} does not exist")
    if not unnamed:
        return assigned
    if len(transformers) == 1 or len(unnamed) == 1:
        for name in transformers:
            assigned[name].extend(unnamed)
    elif len(unnamed) == len(transformers):
        for name, spec in zip(transformers, unnamed):
            assigned[name].append(spec)
    else:
        raise ValueError(
            f"{len(unnamed)} LoRA files for {len(transformers)} transformers ({', '.join(transformers)}) is "
            f"ambiguous: give one file, one per transformer (matched by position), or name the component "
            f"as COMPONENT=PATH")
    return assigned


def prepare_loras(source: ComponentSource, specs: Sequence[LoraSpec], *, dtype: torch.dtype, strict: bool) -> list:
    """The LoRA files of one DiT read and checked (keys, ranks, shapes) against its skeleton built on ``meta``
    from its config, before any of its weights is read; ``lora.PreparedLora`` per file, in fusion order."""
    from vllm_diffusion_plugin.engine.lora import prepare_lora_files
    from vllm_diffusion_plugin.engine.skeleton import build_component

    skeleton = build_component(source, dtype=dtype, device="meta")
    return prepare_lora_files(skeleton, [(s.path, s.scale) for s in specs], strict=strict, component=source.name)


@dataclass(frozen=True)
class World:
    """This process's place in the job (one process when torch.distributed is not initialized)."""

    rank: int = 0
    world_size: int = 1

    @classmethod
    def current(cls) -> World:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()


@dataclass
class LoadedComponents:
    """The loaded modules by component name, their sources and this rank's report."""

    modules: dict[str, nn.Module]
    sources: dict[str, ComponentSource]
    report: LoadReport
    shard_reports: dict[str, object] = field(default_factory=dict)
    progress: bool | None = None
    """Progress bars for ``save_components`` (as ``load_components`` got)."""


def resolve_target_device(requested: str) -> torch.device:
    """``auto`` -> this process's accelerator when the probe says it works, else CPU; or the named type."""
    if requested == "auto":
        return platform.usable_device(platform.local_device()) or torch.device("cpu")
    if requested == "cpu":
        return torch.device("cpu")
    device = torch.device(requested, platform.local_rank())
    if platform.usable_device(device) is None:
        raise RuntimeError(f"--device {requested}: {device} is not usable on this host (probe allocation failed)")
    return device


def load_components(
    checkpoint: str | os.PathLike,
    *,
    options: LoadOptions,
    components: Sequence[str] | None = None,
    device: torch.device,
    dtype: torch.dtype,
    hsdp: HSDPConfig | None = None,
    lora_specs: Sequence[LoraSpec] = (),
    progress: bool | None = None,
    quantization=None,
) -> LoadedComponents:
    """Load a diffusers checkpoint's components on this rank, ending sharded (HSDP) or on ``device``.

    Transformers get the LoRA files and, when ``hsdp`` is given, FSDP2 sharding over a
    ``(replicate, shard)`` mesh of the current world; other components are loaded and placed on ``device``.
    ``options.hsdp_weight_load`` picks how the ranks get the weights (``strategies``); every rank of
    the world must call this with the same arguments. ``progress``: progress bars on rank 0 when stderr is a
    terminal -- True for every step, None only for reads over 1 GiB, False never. ``quantization``: a function
    giving each DiT skeleton its online quant methods (``strategies.LoadContext.quantization``).
    """
    from vllm_diffusion_plugin.engine import pressure
    from vllm_diffusion_plugin.engine.hsdp import build_mesh
    from vllm_diffusion_plugin.engine.reader import DeviceStaging, bounded_reads
    from vllm_diffusion_plugin.engine.skeleton import component_class
    from vllm_diffusion_plugin.engine.strategies import LoadContext, check_strategy
    from vllm_diffusion_plugin.engine.strategies.broadcast import open_channel

    world = World.current()
    report = LoadReport(rank=world.rank, world_size=world.world_size, device=str(device),
                        dtype=str(dtype).removeprefix("torch."), read_threads=options.threads)
    if hsdp is not None:
        hsdp = hsdp.resolved(world.world_size)
        report.layout = hsdp.mesh_shape
    # ---- validate everything before the first byte of weights is read
    with report.phase("resolve"):
        sources = resolve_checkpoint(checkpoint, components=components, allow_pickle=options.allow_pickle)
        prequant.check_sources(sources)  # FP8 checkpoints carried, any other pre-quantization refused by name
        stamps = {s.name: integrity.stamp(s.files) for s in sources}  # right after their headers were read
    with report.phase("imports"):  # code, not weights: a diffusers model module pulls in ~400 MB and seconds
        for source in sources:
            component_class(source)
    report.baseline_rss_bytes = status_memory().get("VmRSS", 0)
    with report.phase("total"), pressure.watching(f"rank {world.rank}'s load of {checkpoint}"):
        transformers = [s.name for s in sources if is_transformer(s)]
        loras = assign_loras(lora_specs, transformers) if lora_specs else {}
        report.strategy = check_strategy(options.hsdp_weight_load, sources=sources, world_size=world.world_size,
                                         sharded=hsdp is not None)
        with report.phase("lora"):  # LoRA files checked against meta skeletons: errors before any base read
            for source in sources:
                if loras.get(source.name):
                    prepare_loras(source, loras[source.name], dtype=dtype, strict=options.lora_strict)
        mesh = build_mesh(hsdp, device_type=device.type) if hsdp is not None else None
        context = LoadContext(options=options, device=device, dtype=dtype, report=report, hsdp=hsdp, mesh=mesh,
                              progress=progress if world.rank == 0 else False,
                              staging=DeviceStaging.open(device, max_bytes=options.pinned_staging_mb << 20,
                                                         threads=options.threads),
                              quantization=quantization)
        if report.strategy == "broadcast":
            context = dataclasses.replace(context, channel=open_channel(options, device))
        step = _LoadStep(context)
        loaded = LoadedComponents({}, {s.name: s for s in sources}, report, progress=progress)
        for source in sources:
            files = [(str(s.path), s.scale) for s in loras.get(source.name, [])]
            with integrity.unchanged(stamps[source.name], component=source.name), \
                    bounded_reads(options.read_timeout_s):  # a shard truncated or replaced, a stalled store: named
                loaded.modules[source.name] = step.load(source, is_dit=source.name in transformers,
                                                        lora_files=files, shard_reports=loaded.shard_reports)
        step.close()  # not after a failure: a group with a dead or stalled peer may block in its teardown
    report.finish()
    return loaded


@dataclass
class _LoadStep:
    """One component through the named steps: read (by strategy) -> fuse LoRA -> postprocess -> shard/place."""

    context: LoadContext

    def close(self) -> None:
        if self.context.channel is not None:
            self.context.channel.close()
            self.context = dataclasses.replace(self.context, channel=None)

    def load(self, source: ComponentSource, *, is_dit: bool, lora_files: list[tuple[str, float]],
             shard_reports: dict[str, object]) -> nn.Module:
        from vllm_diffusion_plugin.engine.hsdp import apply_hsdp
        from vllm_diffusion_plugin.engine.postprocess import process_weights_after_loading
        from vllm_diffusion_plugin.engine.reader import place_module
        from vllm_diffusion_plugin.engine.strategies import LOADERS

        context = self.context
        report, strategy, mesh = context.report, context.report.strategy, context.mesh
        entry = ComponentReport(name=source.name, class_name=str(source.config.get("_class_name", "?")),
                                files=len(source.files), lora_files=len(lora_files))
        report.components.append(entry)
        sharded = is_dit and mesh is not None
        # ---- read: every rank everything / rank 0 then broadcast / each rank its own rows (already sharded)
        load = LOADERS["full" if strategy == "rank_local" and not sharded else strategy]
        before = dict(report.seconds)
        out = load(source, context=context, lora_files=lora_files)
        entry.read_s, entry.lora_s = (report.seconds.get(p, 0.0) - before.get(p, 0.0) for p in ("read", "lora"))
        module = out.module.requires_grad_(False)  # inference: FSDP2 then accepts mixed fp32/bf16 params
        entry.bytes_read, entry.tensors = out.bytes_read, out.tensors
        entry.param_bytes_total = sum(p.numel() * p.element_size() for p in module.parameters())
        if out.lora is not None:
            entry.record_lora(out.lora, entry.lora_s)
        # ---- online-quant finalize + post-load processing (HSDP-aware: also safe after rank_local sharding)
        with report.phase("postprocess"):
            process_weights_after_loading(module, target_device=context.device)
        # ---- shard the DiTs; place everything else
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
        logger.info("%s (loaded %s %s from %s on %s%s)", report_line(report, entry), source.name, entry.class_name,
                    source.folder, context.device,
                    f", sharded {entry.sharded_blocks} blocks ({entry.shard_rule})" if entry.shard_rule else "")
        return module


def save_components(loaded: LoadedComponents, out_dir: str | os.PathLike | None) -> list[Path]:
    """Write every loaded component as a diffusers folder ``out_dir/<name>`` holding its final (fused,
    gathered) weights; sharded modules are gathered collectively and written by rank 0 (other ranks may pass
    None)."""
    from vllm_diffusion_plugin.engine.hsdp import gather_full_state_dict
    from vllm_diffusion_plugin.engine.skeleton import save_component

    rank = World.current().rank
    if rank == 0 and out_dir is None:
        raise ValueError("save_components: rank 0 needs an output folder")
    written = []
    for name, module in loaded.modules.items():
        with loaded.report.phase("save"):
            if name in loaded.shard_reports:
                state = gather_full_state_dict(module, rank0_only=True)
            else:
                state = {k: v.detach().cpu() for k, v in module.state_dict().items()} if rank == 0 else None
            if rank == 0:
                config = prequant.saved_config(loaded.sources[name])  # an FP8 folder stays readable as one
                written.append(save_component(state, config, Path(out_dir) / name, progress=loaded.progress))
                logger.info("Saved %s (%d tensors) to %s", name, len(state), written[-1])
    return written
