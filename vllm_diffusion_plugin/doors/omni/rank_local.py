"""``hsdp_weight_load=rank_local`` under vllm-omni: each rank reads only its own rows of every DiT tensor.

vllm-omni's DiTs are not diffusers modules: their ``load_weights`` renames checkpoint tensors and stacks some
of them (q/k/v into one ``to_qkv``), so one rank's rows of a parameter can come from several checkpoint tensors,
and vllm-omni's own meta-first path refuses such "transforms". We learn where every checkpoint row goes instead
of assuming it: the model's own ``load_weights`` runs once on ``meta`` tensors (nothing read, nothing allocated)
under a dispatch mode that records each ``copy_`` into a DiT parameter -- which checkpoint tensor, which of its
rows, which rows of which parameter (:func:`trace_bindings`). Any other write into a parameter, a source that is
not a row block of one checkpoint tensor, or a parameter left partly uncovered is refused naming it.

Then, per DiT: shard on ``meta`` with vllm-omni's own ``apply_hsdp_to_model`` (its ``_hsdp_shard_conditions``,
its mesh and mixed-precision policy), allocate only the local shards, read this rank's rows of the bound
checkpoint tensors straight into them (``engine.strategies.rank_local.read_bound_rows``: ``pread``, ~1/S of
the bytes per rank), fuse LoRA into the same rows (``fuse_bound_rows``: ``B[key rows] @ A``, our device rule),
check nothing is left on ``meta``. Online-quantized linears are quantized from each rank's rows
(``strategies.rank_local``) where their method declares the row protocol, else gathered whole layer by layer and
post-processed by their method (``quant.whole``); a pre-quantized ModelOpt FP8 checkpoint's layers are read and
finished from them (``quant.parts``: the trace goes through vllm-omni's checkpoint adapter). A weight source that is
not a DiT vllm-omni shards (FLUX.1's T5 encoder, which its pipeline reads through the same loader) is read whole on
every rank, as ``full`` reads it (:func:`split_sources`). vllm-omni's post-load processing (ours, HSDP-aware:
``patch_postprocess``) and its placement of VAEs / encoders follow, as in its own HSDP path.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni import load_path, lora_update
from vllm_diffusion_plugin.engine.session import (
    DequantizedBinding,
    DistributedLoadError,
    RowBinding,
    RowLoad,
    WeightLoadError,
    bind,
    materialize_local_shards,
    row_layers,
    scale_key,
    status_memory,
    to_row_layout,
)

logger = init_logger(__name__)


class TraceError(ValueError):
    """A DiT's ``load_weights`` does something a row binding cannot express; the message names the parameter."""


def _sid(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _row_numel(shape: Sequence[int]) -> int:
    return 1 if len(shape) <= 1 else int(torch.Size(shape[1:]).numel())


class _BindingTracer(TorchDispatchMode):
    """Records ``param_view.copy_(checkpoint rows)`` during a ``load_weights`` on ``meta`` tensors.

    ``params``: storage id -> (parameter name, parameter); ``origins``: storage id -> (DiT, checkpoint key,
    its shape, element offset of the storage's first element in the key). Dtype casts and clones of a
    checkpoint tensor keep its origin; views share its storage."""

    def __init__(self, params: dict[int, tuple[str, torch.Tensor]], origins: dict[int, tuple]) -> None:
        super().__init__()
        self.params, self.origins = params, origins
        self.scaled: dict[int, str] = {}
        """storage id -> scale key: FP8 checkpoint rows dequantized by vllm-omni's ModelOpt adapter (``w * s``)."""
        self.bindings: list[tuple[Any, RowBinding]] = []
        """(the DiT the checkpoint tensor belongs to, its binding)"""
        self.problems: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        aten = torch.ops.aten
        if func is aten.copy_.default:
            self._copy(args[0], args[1])
        elif func in (aten._to_copy.default, aten.clone.default):
            self._derive(args[0], out)
        elif func is aten.mul.Tensor:
            self._dequantized(args[0], args[1], out)
        else:
            for i, arg in enumerate(func._schema.arguments):
                info = arg.alias_info
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if info is not None and info.is_write and isinstance(value, torch.Tensor) \
                        and _sid(value) in self.params:
                    self.problems.append(f"{self.params[_sid(value)][0]}: written by {func} (only copies of "
                                         f"checkpoint rows can be replayed rank-locally)")
        return out

    def _derive(self, src: torch.Tensor, out: Any) -> None:
        origin = self.origins.get(_sid(src))
        if origin is not None and isinstance(out, torch.Tensor) and src.is_contiguous() and out.is_contiguous() \
                and out.shape == src.shape:
            dit, key, shape, base = origin
            self.origins[_sid(out)] = (dit, key, shape, base + src.storage_offset())
            if _sid(src) in self.scaled:
                self.scaled[_sid(out)] = self.scaled[_sid(src)]

    def _dequantized(self, weight: torch.Tensor, scale: Any, out: Any) -> None:
        """``weight * scale`` of a whole FP8 checkpoint tensor and its own ``weight_scale``: what vllm-omni's
        ModelOpt adapter hands a layer it built unquantized; its rows stay bound to the FP8 tensor's rows, marked."""
        origin = self.origins.get(_sid(weight))
        found = self.origins.get(_sid(scale)) if isinstance(scale, torch.Tensor) else None
        if origin is None or found is None or not isinstance(out, torch.Tensor) or out.shape != weight.shape \
                or origin[3] or weight.storage_offset() or found[1] != scale_key(origin[1]):
            return
        self.origins[_sid(out)] = origin
        self.scaled[_sid(out)] = found[1]

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        found = self.params.get(_sid(dst))
        if found is None:
            return
        name, param = found
        origin = self.origins.get(_sid(src))
        if origin is None:
            self.problems.append(f"{name}: written from a tensor that is not rows of one checkpoint tensor")
            return
        dit, key, key_shape, base = origin
        if not (dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape):
            self.problems.append(f"{name}: {key} is copied in through a reshaped, transposed or broadcast view")
            return
        if param.dim() == 0 or len(key_shape) == 0:  # a scalar, or one element of a 1-D parameter (per-part scales)
            if dst.numel() != 1 or int(torch.Size(key_shape).numel()) != 1 or param.dim() > 1:
                self.problems.append(f"{name}: scalar copy from {key} {tuple(key_shape)}")
                return
            self.bindings.append((dit, RowBinding(key, name) if param.dim() == 0 else
                                  RowBinding(key, name, start=dst.storage_offset(), rows=1)))
            return
        row = _row_numel(param.shape)
        key_offset = base + src.storage_offset()
        if tuple(param.shape[1:]) != tuple(key_shape[1:]) or dst.storage_offset() % row or dst.numel() % row \
                or key_offset % row:
            self.problems.append(f"{name} {tuple(param.shape)}: {key} {tuple(key_shape)} does not land on whole "
                                 f"rows of it")
            return
        rows = dict(start=dst.storage_offset() // row, key_start=key_offset // row, rows=dst.numel() // row)
        scaled_by = self.scaled.get(_sid(src))
        self.bindings.append((dit, RowBinding(key, name, **rows) if scaled_by is None else
                              DequantizedBinding(key, name, **rows, scale_key=scaled_by)))


def trace_bindings(model: nn.Module, dits: Sequence[Any]) -> tuple[dict[str, list[RowBinding]], set[str] | None]:
    """Where every checkpoint row of ``dits`` (``load_path.DitSource``) lands in ``model``, learned by running
    ``model.load_weights`` once on meta tensors (the DiTs' parameters must be on ``meta`` already).

    Returns the bindings per component (keys unprefixed, targets named in ``model``) and what
    ``load_weights`` reported as loaded. Raises :class:`TraceError` naming every parameter it cannot bind."""
    params = {_sid(p): (name, p) for name, p in model.named_parameters() if p.is_meta}
    params.update({_sid(b): (name, b) for name, b in model.named_buffers() if b.is_meta})
    before = {name: sid for sid, (name, _) in params.items()}
    probes, origins, streams = [], {}, []
    for dit in dits:
        mine = []
        for key, info in dit.source.tensors.items():
            probe = torch.empty(info.shape, dtype=info.dtype, device="meta")
            mine.append((dit.prefix + key, probe))
            origins[_sid(probe)] = (dit, key, tuple(info.shape), 0)
        probes += mine  # all alive until the end: storage ids stay unique
        streams.append(dit.adapter.adapt(iter(mine)) if dit.adapter is not None else iter(mine))  # as load_path
    tracer = _BindingTracer(params, origins)
    try:
        with tracer, torch.no_grad():
            loaded = model.load_weights(itertools.chain(*streams))
    except (RuntimeError, NotImplementedError) as exc:
        raise TraceError(f"{type(model).__name__}.load_weights cannot run on meta tensors ({exc}), so rank_local "
                         f"cannot learn where each checkpoint row goes; use hsdp_weight_load=full or "
                         f"broadcast") from exc
    replaced = [name for name, p in model.named_parameters() if name in before and _sid(p) != before[name]]
    problems = tracer.problems + [f"{name}: replaced by load_weights (param.data = ...)" for name in replaced]
    if problems:
        raise TraceError(f"hsdp_weight_load=rank_local cannot replay {type(model).__name__}.load_weights row by "
                         f"row: {'; '.join(problems[:10])}; use hsdp_weight_load=full or broadcast")
    bindings: dict[str, list[RowBinding]] = {dit.component: [] for dit in dits}
    for dit, binding in tracer.bindings:
        if not binding.target.startswith(dit.prefix):
            raise TraceError(f"{dit.component}'s {binding.key} was copied into {binding.target}, outside "
                             f"{dit.component} ({dit.prefix}*)")
        bindings[dit.component].append(binding)
    return bindings, None if loaded is None else set(loaded)


def check_coverage(dit: Any, module: nn.Module, bindings: Sequence[RowBinding]) -> None:
    """Every parameter of ``module`` (``dit``'s) is covered by bound rows exactly once, or raise naming it."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for b in bindings:
        spans.setdefault(b.target, []).append((b.start, None if b.rows is None else b.start + b.rows))
    missing, overlapping = [], []
    for name, param in module.named_parameters():
        full = dit.prefix + name
        rows = param.shape[0] if param.dim() else 1
        covered = 0
        for start, stop in sorted((s, rows if e is None else e) for s, e in spans.get(full, ())):
            if start < covered:
                overlapping.append(full)
                break
            if start > covered:
                break
            covered = stop
        if covered < rows and full not in overlapping:
            missing.append(f"{full} (rows {covered}:{rows})" if covered else full)
    if overlapping:
        raise TraceError(f"{dit.component}: checkpoint rows are copied twice into {', '.join(overlapping[:10])}; "
                         f"rank_local cannot tell which copy wins; use hsdp_weight_load=full or broadcast")
    if missing:
        raise WeightLoadError(f"{len(missing)} parameter(s) of {dit.component} ({dit.source.folder}) are not "
                              f"(wholly) in the checkpoint: {', '.join(missing[:20])}")


def _give_data(param: nn.Parameter, data: torch.Tensor) -> None:
    """Put ``data`` (any device, meta included) under the same ``param`` object: its identity, class and
    attributes (vLLM's ``weight_loader``, ``output_dim`` ...) stay. ``param.data = ...`` cannot cross between
    meta and real devices, and ``Module.to`` / ``to_empty`` would make new Parameters without the attributes."""
    cls = type(param)
    new = nn.Parameter(data, requires_grad=False) if cls is nn.Parameter else cls.__new__(cls, data)
    new.__dict__.update(param.__dict__)
    new.requires_grad_(param.requires_grad)
    torch.utils.swap_tensors(param, new)


def release_to_meta(module: nn.Module) -> dict[str, torch.Tensor]:
    """Move ``module``'s parameters (the same objects) and buffers to ``meta``; returns the buffers' values."""
    saved = {}
    for prefix, sub in module.named_modules():
        for name, param in sub._parameters.items():
            if param is not None and not param.is_meta:
                _give_data(param, torch.empty_like(param, device="meta"))
        for name, buffer in sub._buffers.items():
            if buffer is not None and not buffer.is_meta:
                saved[f"{prefix}.{name}" if prefix else name] = buffer.detach().clone()
                sub._buffers[name] = buffer.to("meta")
    return saved


def _shard_on_meta(module: nn.Module, hsdp_config: Any, device: torch.device) -> None:
    """vllm-omni's own sharding of a DiT whose tensors are on ``meta``, then its local shards allocated on
    ``device``. What vllm-omni keeps unsharded (``_hsdp_ignored_modules``, scalar or integer parameters) it
    moves with ``.to(device)``, which a meta tensor cannot do: those are allocated on ``device`` first."""
    from vllm_omni.diffusion.distributed.hsdp import apply_hsdp_to_model

    kept = []
    for name in getattr(module, "_hsdp_ignored_modules", None) or ():
        try:
            kept += list(module.get_submodule(name).parameters())
        except AttributeError:
            continue  # vllm-omni warns about it itself
    kept += [p for p in module.parameters() if p.dim() == 0 or not (p.is_floating_point() or p.is_complex())]
    for param in kept:
        if param.is_meta:
            _give_data(param, torch.empty_like(param, device=device))
    apply_hsdp_to_model(module, hsdp_config, target_device=device)
    materialize_local_shards(module, device, {})


def split_sources(model: nn.Module, sources: Sequence[Any], outermost: tuple[Sequence[str], Sequence[nn.Module]]):
    """``(dits, whole)``: the weight sources of the DiTs vllm-omni shards (read rank-locally) and the others, e.g.
    FLUX.1's ``text_encoder_2`` (a T5 encoder vllm-omni keeps whole on every rank: read whole, as ``full`` does).
    Every sharded DiT must have its own source, and no other source may hold or sit inside a DiT."""
    outer_names, outer = outermost
    outer_ids = {id(m) for m in outer}
    modules = {s.component: model.get_submodule(s.prefix.rstrip(".")) for s in sources}
    dits = [s for s in sources if id(modules[s.component]) in outer_ids]
    whole = [s for s in sources if id(modules[s.component]) not in outer_ids]
    inside = {id(m) for dit in outer for m in dit.modules()}
    mixed = [s for s in whole if id(modules[s.component]) in inside
             or any(id(m) in outer_ids for m in modules[s.component].modules())]
    if {id(modules[s.component]) for s in dits} != outer_ids or mixed:
        raise ValueError(f"hsdp_weight_load=rank_local reads the DiTs vllm-omni shards ({', '.join(outer_names)}) "
                         f"from their own weight sources ({', '.join(s.prefix or '<root>' for s in sources)}), and "
                         f"these do not match in {type(model).__name__}; use hsdp_weight_load=full or broadcast")
    return dits, whole


def _memory(step: str) -> None:
    """DEBUG: this rank's resident and peak host memory after ``step`` (``VLLM_LOGGING_LEVEL=DEBUG``)."""
    if not logger.isEnabledFor(logging.DEBUG):
        return

    if memory := status_memory():
        logger.debug("rank_local memory after %s: VmRSS %.2f GiB, VmHWM %.2f GiB", step,
                     memory.get("VmRSS", 0) / 2**30, memory.get("VmHWM", 0) / 2**30)


def load_model(loader: Any, session: Any, *, target_device: torch.device | None, load_format: str,
               custom_pipeline_name: Any) -> nn.Module:
    """vllm-omni's HSDP load of a pipeline with every DiT read rank-locally (see the module doc), through this
    worker's load ``session``: its ``baseline_rss_bytes`` is this rank's RSS once the DiTs vllm-omni built are
    released to ``meta`` (its construction initializes some of their layers: ~0.47 GB per A14B-width DiT)."""
    from vllm_omni.diffusion.distributed.hsdp import HSDPInferenceConfig
    from vllm_omni.diffusion.offloader.module_collector import ModuleDiscovery

    device = target_device if target_device is not None else torch.device("cpu")
    parallel = loader.parallel_config
    hsdp_config = HSDPInferenceConfig(enabled=True, hsdp_replicate_size=parallel.hsdp_replicate_size,
                                      hsdp_shard_size=parallel.hsdp_shard_size, param_dtype=loader.od_config.dtype)
    _memory("start")
    model = loader._init_from_load_format(load_format, device, custom_pipeline_name, is_hsdp=True)
    _memory("pipeline constructed")
    discovered = ModuleDiscovery.discover(model)
    dits, whole = split_sources(model, load_path.prepare_dits(loader, model), discovered.outermost_dits())
    modules = {dit.component: model.get_submodule(dit.prefix.rstrip(".")) for dit in dits}
    layers = {dit.component: row_layers(modules[dit.component], prefix=dit.prefix, device=device) for dit in dits}
    buffers = {dit.component: release_to_meta(modules[dit.component]) for dit in dits}
    _memory("DiTs released to meta")
    session.mark_baseline()
    bindings, loaded = trace_bindings(model, dits)
    _memory("bindings traced")
    if whole:  # e.g. FLUX.1's T5 encoder: not sharded by vllm-omni, so every rank reads all of it
        with session.reading(*(dit.component for dit in whole)):
            whole_loaded = model.load_weights(load_path.stream(session, whole))
        loaded = None if loaded is None or whole_loaded is None else loaded | set(whole_loaded)
    load_path.check_loaded(model, loader._get_expected_parameter_names(model), loaded, quantized=False,
                           exempt_suffixes=())
    for dit in dits:
        check_coverage(dit, modules[dit.component], bindings[dit.component])
        bind(layers[dit.component][1], bindings[dit.component], dit.source)
    for dit in dits:
        module = modules[dit.component]
        quantized, prequantized, whole = layers[dit.component]
        to_row_layout(module, prefix=dit.prefix, quantized=quantized, prequantized=prequantized, whole=whole)
        _shard_on_meta(module, hsdp_config, device)
        with torch.no_grad():
            for name, value in buffers[dit.component].items():
                module.get_buffer(name).copy_(value)
    _memory("sharded on meta, local shards allocated")
    targets = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    loaded_rows = {}
    for dit in dits:
        quantized, prequantized, whole = layers[dit.component]
        rows = loaded_rows[dit.component] = RowLoad(dit.component, dit.prefix, modules[dit.component],
                                                    bindings[dit.component], targets, device, quantized=quantized,
                                                    prequantized=prequantized, whole=whole)
        session.load_rows(dit.source, entry=dit.report, rows=rows, fuser=dit.fuser)
        _memory(f"{dit.component} read and fused")
    lora_update.keep(model, session, strategy="rank_local", rows=loaded_rows)  # a runtime LoRA update re-reads them
    on_meta = [n for n, t in targets.items() if any(n.startswith(d.prefix) for d in dits)
               and (t.to_local() if isinstance(t, DTensor) else t).is_meta]
    if on_meta:
        raise DistributedLoadError(f"{len(on_meta)} tensor(s) are still on the meta device after the rank-local "
                                   f"read: {', '.join(on_meta[:20])}")
    loader._process_weights_after_loading(model, device)
    _memory("post-processed")
    for group in (discovered.vaes, discovered.encoders, discovered.resident_modules):
        for module in group or ():
            module.to(device)
    return model
