"""Our load path for the DiT components of a pipeline that vllm-omni builds itself.

vllm-omni builds the whole pipeline module with its own model classes (fused ``to_qkv``, ``ffn.net_0``, ...)
and maps diffusers checkpoint names onto them in each model's ``load_weights``. We keep that skeleton and
feed it our way, per DiT weight source (``model.weights_sources``):

    resolve (our strict manifests) -> stream our reader's tensors -> fuse LoRA into each checkpoint tensor as it
      passes (our fusion + device rule) -> vllm-omni's model.load_weights (its names, its q/k/v stacking)
      -> strict missing-weight check

LoRA deltas are resolved against a ``meta`` skeleton of the component's own diffusers class (every LoRA
format we read: PEFT/diffusers, Wan/LightX2V, kohya), so they are keyed by *checkpoint* names: fusing before
vllm-omni's name mapping and q/k/v stacking is exact (``W_q + s B_q A_q`` is stacked like ``W_q``) and needs
no knowledge of vllm-omni's packing. Online quantization then quantizes the fused weights as they arrive.

A pre-quantized ModelOpt FP8 checkpoint (``serve_options.carried_fp8_checkpoint``) streams its FP8 weights and
scales as they are, through vllm-omni's own ``ModelOptFp8CheckpointAdapter`` (its names, its q/k/v packing) into
vllm-omni's FP8 layers. A LoRA targeting an FP8 weight is fused exactly (``quant_fuse.fuse_fp8_rows``): the deltas of
every file summed in fp32, added to the dequantized weight, requantized once with a scale recomputed from the fused
tensor; the new scale is handed on right after its weight and the checkpoint's own scale is dropped (the targeted
layers' scales are read first: a few bytes each). vllm-omni's own distill fusion adds the delta to the FP8 parameter
with no scale (``params.add_``), which torch refuses for FP8.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.report import ComponentReport

logger = init_logger(__name__)

@dataclass
class StreamFuser:
    """Fuses LoRA deltas (keyed by checkpoint module names) into checkpoint tensors as they stream past.

    ``deltas`` holds one mapping per LoRA file, applied in order (several files for one DiT stack, as in
    ``lora.fuse_lora_files``). A targeted tensor is copied before it is changed (never the reader's buffer). An FP8
    weight of a pre-quantized checkpoint (``fp8_layers``) is fused exactly and hands on its new scale (:meth:`items`)."""

    deltas: list[dict[str, Any]]
    modules: frozenset[str]
    """Module names of the component's diffusers class (a target not among them is a bare parameter)."""
    dtype: torch.dtype
    chunk_mb: int
    check_finite: bool = False
    host_weights: str = "auto"
    stats: Any = None
    seconds: float = 0.0
    fp8_layers: frozenset[str] = frozenset()
    """Module names whose checkpoint weight is FP8 with a ``weight_scale`` (``prequant.fp8_layers``)."""
    _by_tensor: dict[str, list[tuple[Any, str]]] = field(default_factory=dict)
    _scales: dict[str, torch.Tensor] = field(default_factory=dict)
    _replaced: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for per_file in self.deltas:
            for target, delta in per_file.items():
                if delta.A is not None or delta.full_delta is not None:  # a module's weight, or a bare parameter
                    name = f"{target}.weight" if target in self.modules else target
                    self._by_tensor.setdefault(name, []).append((delta, "weight"))
                if delta.bias_delta is not None:
                    self._by_tensor.setdefault(f"{target}.bias", []).append((delta, "bias"))

    def fp8_scale_keys(self) -> list[str]:
        """The ``weight_scale`` keys of the FP8 layers a LoRA targets: read before the stream (:meth:`items`)."""
        return sorted(f"{n.removesuffix('.weight')}.weight_scale" for n, hits in self._by_tensor.items()
                      if n.removesuffix(".weight") in self.fp8_layers and any(p == "weight" for _, p in hits))

    def items(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """What to hand on for checkpoint tensor ``name``: itself, LoRA fused; for an FP8 weight a LoRA targets,
        the fused FP8 weight and then its new scale; a targeted FP8 layer's own scale is dropped."""
        if name.endswith(".weight_scale") and name.removesuffix(".weight_scale") in self._replaced:
            return  # its weight's new scale is (or will be) handed on right after that weight
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in self._scales:
            q, scale = self._fuse_fp8(name, tensor, self._scales.pop(module))
            yield name, q
            yield f"{module}.weight_scale", scale
            return
        yield name, self(name, tensor)

    def read_fp8_scales(self, scales: Iterable[tuple[str, torch.Tensor]]) -> None:
        for key, scale in scales:
            self._scales[key.removesuffix(".weight_scale")] = scale.clone()
        self._replaced = frozenset(self._scales)

    def _fuse_fp8(self, name: str, q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every file's delta of FP8 weight ``name`` fused into private copies of it and its scale by the engine's
        exact FP8 fusion (``prequant.fuse_fp8_layers``: summed in fp32, added once, requantized once)."""
        from vllm_diffusion_plugin.engine.prequant import fuse_fp8_layers

        start = time.perf_counter()
        module = name.removesuffix(".weight")
        scale_key = f"{module}.weight_scale"
        targets = {name: q.clone(), scale_key: scale.to(q.device, copy=True)}
        files = [{module: dataclasses.replace(delta, bias_delta=None)} for delta, _ in self._by_tensor.pop(name)]
        stats = fuse_fp8_layers(targets, files, modules=self.modules, chunk_mb=self.chunk_mb,
                                check_finite=self.check_finite, host_weights=self.host_weights)
        if stats is not None:
            self.stats = stats if self.stats is None else self.stats + stats
        self.seconds += time.perf_counter() - start
        return targets[name], targets[scale_key]

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        hits = self._by_tensor.pop(name, None)
        if hits is None:
            return tensor
        start = time.perf_counter()
        # the model's precision when floating (as a fusion into the module would), and always a private copy
        tensor = tensor.to(self.dtype, copy=True) if tensor.is_floating_point() else tensor.clone()
        for delta, part in hits:
            if part == "bias":
                with torch.no_grad():
                    tensor.add_(delta.bias_delta.to(tensor.dtype))
                continue
            tensor = self._add(tensor, delta)
        self.seconds += time.perf_counter() - start
        return tensor

    def _add(self, tensor: torch.Tensor, delta: Any) -> torch.Tensor:
        """``tensor`` (a weight, owned here) with ``delta``'s weight part added in place by our fusion and device
        rule; counts its ``FuseStats``."""
        from vllm_diffusion_plugin.engine.lora.fuse import fuse_lora

        holder = nn.Module()
        holder.weight = nn.Parameter(tensor, requires_grad=False)
        stats = fuse_lora(holder, {"": dataclasses.replace(delta, bias_delta=None)}, chunk_mb=self.chunk_mb,
                          check_finite=self.check_finite, log=False, host_weights=self.host_weights)
        self.stats = stats if self.stats is None else self.stats + stats
        return holder.weight.data

    def check_consumed(self, component: str) -> None:
        if self._scales:
            raise ValueError(f"FP8 weights of {component} a LoRA targets were not among its checkpoint tensors: "
                             f"{sorted(self._scales)[:10]}")
        if self._by_tensor:
            raise ValueError(f"LoRA targets of {component} not found among its checkpoint tensors: "
                             f"{sorted(self._by_tensor)[:10]}")


def lora_fuser(source: Any, lora_files: Sequence[tuple[str, float]], *, dtype: torch.dtype, strict: bool,
               chunk_mb: int, check_finite: bool = False, host_weights: str = "auto") -> StreamFuser | None:
    """Normalize and validate every LoRA file for ``source`` (before any weight is read)."""
    if not lora_files:
        return None
    from vllm_diffusion_plugin.engine.lora import prepare_lora_files
    from vllm_diffusion_plugin.engine.prequant import fp8_layers
    from vllm_diffusion_plugin.engine.skeleton import build_component

    skeleton = build_component(source, dtype=dtype, device="meta")
    deltas = [lora.deltas for lora in prepare_lora_files(skeleton, lora_files, strict=strict, component=source.name)]
    fp8 = fp8_layers(source)
    return StreamFuser(deltas, modules=frozenset(name for name, _ in skeleton.named_modules()), dtype=dtype,
                       chunk_mb=chunk_mb, check_finite=check_finite, host_weights=host_weights,
                       fp8_layers=frozenset(fp8.layers) if fp8 is not None else frozenset())


@dataclass
class DitSource:
    """One of vllm-omni's DiT weight sources, resolved by us."""

    component: str
    prefix: str
    source: Any
    fuser: StreamFuser | None
    report: ComponentReport
    threads: int = 1
    """Threads reading its bytes (``engine.reader``)."""
    staging_bytes: int = 0
    """Page-locked bytes its reads onto an accelerator stage through (``pinned_staging_mb``; 0: pageable copies)."""
    adapter: Any = None
    """vllm-omni's ``ModelOptFp8CheckpointAdapter`` for a pre-quantized ModelOpt FP8 source (its names), or None."""
    stamps: dict = field(default_factory=dict)
    """Its files' identities right after their headers were read (``engine.integrity.stamp``): a shard truncated
    or replaced since is named (:func:`unchanged`)."""

    def staging(self, device: torch.device | None):
        """``reader.DeviceStaging`` for reads landing on ``device``, or None (no accelerator, 0 bytes, no pinned
        memory on this host)."""
        from vllm_diffusion_plugin.engine.reader import DeviceStaging

        return None if device is None else DeviceStaging.open(device, max_bytes=self.staging_bytes,
                                                              threads=self.threads)


@contextlib.contextmanager
def unchanged(dits: Iterable[DitSource]) -> Iterator[None]:
    """Around a read of ``dits``' bytes (and what consumes them): a file of one that changed since stamped is named
    (``engine.integrity.unchanged``: ``CheckpointChangedError``), whether the read failed on it or read it silently."""
    from vllm_diffusion_plugin.engine import integrity

    with contextlib.ExitStack() as stack:
        for dit in dits:
            stack.enter_context(integrity.unchanged(dit.stamps, component=dit.component))
        yield


def component_name(omni_source: Any) -> str:
    return omni_source.subfolder or omni_source.prefix.rstrip(".") or "transformer"


def resolve_sources(omni_sources: Sequence[Any], *, allow_pickle: bool) -> list[Any]:
    """Our validated ``ComponentSource`` for each of vllm-omni's sources (strict manifests)."""
    from vllm_diffusion_plugin.engine.checkpoint import resolve_checkpoint

    resolved = []
    for s in omni_sources:
        found = resolve_checkpoint(s.model_or_path, components=[s.subfolder] if s.subfolder else None,
                                   allow_pickle=allow_pickle, revision=s.revision)
        if len(found) != 1:
            raise ValueError(f"{s.model_or_path} (subfolder {s.subfolder!r}) resolves to {len(found)} components")
        resolved.append(found[0])
    return resolved


def is_fp8_adapter(adapter: Any) -> bool:
    """vllm-omni's checkpoint adapter for ModelOpt FP8 (not its NVFP4 / mixed-precision subclasses)."""
    return type(adapter).__name__ == "ModelOptFp8CheckpointAdapter"


def stream(dits: Iterable[DitSource], device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every DiT's tensors, prefixed with vllm-omni's source prefix, LoRA fused, through vllm-omni's checkpoint
    adapter where it has one; counts bytes per component. ``device``: where the DiTs' parameters are (an
    accelerator): the tensors are handed out there, copied through pinned staging (``DitSource.staging``), so
    vllm-omni's weight loaders copy device to device. A DiT's file that changed since stamped
    (``DitSource.stamps``) is named once its tensors were read, or when a read failed; a failure in the consumer is
    the caller's to check (:func:`unchanged`)."""
    for dit in dits:
        tensors = _stream_one(dit, device)
        yield from (dit.adapter.adapt(tensors) if dit.adapter is not None else tensors)


def _stream_one(dit: DitSource, device: torch.device | None) -> Iterator[tuple[str, torch.Tensor]]:
    from vllm_diffusion_plugin.engine.weights import LoadStats, iterate_weights

    stats, start = LoadStats(), time.perf_counter()
    with unchanged([dit]):
        if dit.fuser is not None and (keys := dit.fuser.fp8_scale_keys()):
            dit.fuser.read_fp8_scales(iterate_weights(dit.source, stats=stats, keys=keys))
        for name, tensor in iterate_weights(dit.source, stats=stats, threads=dit.threads,
                                            staging=dit.staging(device)):
            if dit.fuser is None:
                yield dit.prefix + name, tensor
                continue
            for fused_name, fused in dit.fuser.items(name, tensor):
                yield dit.prefix + fused_name, fused
    dit.report.bytes_read, dit.report.tensors = stats.total_bytes, stats.tensors
    if dit.fuser is not None:
        dit.fuser.check_consumed(dit.component)
        dit.report.record_lora(dit.fuser.stats, dit.fuser.seconds)
    dit.report.read_s = time.perf_counter() - start - dit.report.lora_s


def check_fp8_scales_loaded(model: nn.Module) -> None:
    """Raise naming every FP8 layer of ``model`` (vllm-omni's) whose ``weight_scale`` kept its unloaded sentinel: the
    checkpoint stores that layer unquantized (ModelOpt's ``exclude_modules``) but vllm-omni built it as FP8 (the
    exclusion did not reach its layer), so its weight was cast to FP8 with no scale."""
    from vllm_diffusion_plugin.engine.weights import WeightLoadError

    sentinel = torch.finfo(torch.float32).min
    bad = [name for name, module in model.named_modules()
           if isinstance(getattr(module, "weight_scale", None), torch.Tensor)
           and getattr(module, "weight", None) is not None and module.weight.dtype == torch.float8_e4m3fn
           and bool((module.weight_scale.detach().float() == sentinel).any())]
    if bad:
        raise WeightLoadError(f"{len(bad)} FP8 layer(s) of {type(model).__name__} got no weight_scale from the "
                              f"checkpoint: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}. The checkpoint "
                              f"stores them unquantized (ModelOpt exclude_modules) but vllm-omni built them as FP8 "
                              f"layers, so their weights would be cast to FP8 with no scale; name them in "
                              f"quantization_config.exclude_modules as vllm-omni names them")


def check_loaded(model: nn.Module, expected: set[str], loaded: set[str] | None, *, quantized: bool,
                 exempt_suffixes: tuple[str, ...]) -> None:
    """Our strict rule on vllm-omni's names: every expected parameter loaded (quant-only scales excepted)."""
    from vllm_diffusion_plugin.engine.weights import WeightLoadError

    if loaded is None:
        raise WeightLoadError(f"{type(model).__name__}.load_weights returned no loaded-weight names; "
                              f"--load-format diffusion-hsdp cannot check that every weight was loaded")
    missing = expected - loaded
    if quantized:
        missing = {n for n in missing if not n.endswith(exempt_suffixes)}
    if missing:
        listing = ", ".join(sorted(missing)[:20]) + (f" (and {len(missing) - 20} more)" if len(missing) > 20 else "")
        raise WeightLoadError(f"{len(missing)} parameter(s) of {type(model).__name__} were not in the checkpoint: "
                              f"{listing}")
