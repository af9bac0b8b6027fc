"""The vllm-omni door's load: the DiTs of a pipeline vllm-omni builds itself, read through a load session.

vllm-omni builds the whole pipeline with its own model classes (fused ``to_qkv``, ``ffn.net_0``, ...) and maps
diffusers checkpoint names onto them in each model's ``load_weights``. Per DiT weight source
(``model.weights_sources``) this door hands the session what only it knows -- vllm-omni's sources, its names, its
checkpoint adapter -- and the session does the rest:

    resolve (strict manifests, stamps, LoRAs assigned) -> the session's stream (our reader, LoRA fused into each
      checkpoint tensor as it passes: ``engine.fused_stream``) -> vllm-omni's model.load_weights (its names, its
      q/k/v stacking) -> strict missing-weight check -> the report lines

A pre-quantized ModelOpt FP8 checkpoint streams its FP8 weights and scales as they are through vllm-omni's own
``ModelOptFp8CheckpointAdapter`` into vllm-omni's FP8 layers; a LoRA targeting an FP8 weight is fused exactly by the
session's fuser. ``rank_local`` (``rank_local.load_model``) traces where each checkpoint row lands and hands the
bindings to the session instead.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni.lora_update import keep
from vllm_diffusion_plugin.doors.omni.patch_load_format import omni_load_options
from vllm_diffusion_plugin.doors.omni.preflight import check_device
from vllm_diffusion_plugin.doors.omni.serve_options import (
    check_supported,
    checkpoint_strategy,
    read_threads,
    weight_load_strategy,
)
from vllm_diffusion_plugin.engine.session import (
    ComponentReport,
    ComponentSource,
    LoadSession,
    LoraSpec,
    StreamFuser,
    WeightLoadError,
    World,
    accelerator_of,
    resolve_checkpoint,
)

logger = init_logger(__name__)

QUANT_SCALE_SUFFIXES = (".g_idx", ".weight_scale", ".weight_scale_inv", ".input_scale")
STATE_ATTR = "_diffusion_hsdp_state"
CARRIED_PIPELINE_FORMATS = (None, "default", "custom_pipeline")
"""vllm-omni's own ``--diffusion-load-format`` values whose pipelines declare ``weights_sources`` for us to read
(a custom pipeline without them is refused by :func:`load_dits`)."""


@dataclass
class DitSource:
    """One of vllm-omni's DiT weight sources, resolved by the session."""

    component: str
    prefix: str
    source: ComponentSource
    fuser: StreamFuser | None
    report: ComponentReport
    adapter: Any = None
    """vllm-omni's ``ModelOptFp8CheckpointAdapter`` for a pre-quantized ModelOpt FP8 source (its names), or None."""


def component_name(omni_source: Any) -> str:
    return omni_source.subfolder or omni_source.prefix.rstrip(".") or "transformer"


def is_fp8_adapter(adapter: Any) -> bool:
    """vllm-omni's checkpoint adapter for ModelOpt FP8 (not its NVFP4 / mixed-precision subclasses)."""
    return type(adapter).__name__ == "ModelOptFp8CheckpointAdapter"


def prepare(loader: Any, load_format: str | None) -> LoadSession:
    """Every check that needs no weights, then this worker's load session: options from ``--additional-config
    diffusion_hsdp``, combinations not carried refused, this rank's accelerator pre-flight, the strategy set on the
    loader's own copy of ``od_config``; kept on the loader."""
    od_config = loader.od_config
    options = omni_load_options(loader)
    options = dataclasses.replace(options, read_threads=read_threads(options, od_config))
    check_supported(options, od_config)
    world = World.current()
    if load_format not in CARRIED_PIPELINE_FORMATS:
        raise ValueError(f"--load-format diffusion-hsdp reads the DiTs a pipeline declares in weights_sources; "
                         f"vllm-omni's --diffusion-load-format {load_format!r} (the diffusers adapter loads "
                         f"itself, dummy weights read nothing) is not carried: drop one of them")
    strategy = weight_load_strategy(options, od_config)
    if strategy != "full" and world.world_size == 1:
        logger.info("hsdp_weight_load=%s with a single rank: loading with 'full'.", strategy)
        strategy = "full"
    strategy = checkpoint_strategy(loader.quant_config, strategy)
    session = LoadSession(options, device=None, dtype=od_config.dtype, world=world, strategy=strategy)
    check_device(session, od_config)  # this rank's accelerator, before vllm-omni builds anything
    session.watch(f"diffusion worker {world.rank}'s load and first run", whole_process=True)
    ours = {"enable_broadcast_weight_load": strategy == "broadcast"}
    if getattr(od_config, "hsdp_weight_load_strategy", "full") == "pre_sharded":
        ours["hsdp_weight_load_strategy"] = "full"  # never upstream's pre-sharded load (no LoRA, no stacked q/k/v)
    if any(getattr(od_config, key, False) != value for key, value in ours.items()):
        loader.od_config = copy.copy(od_config)
        for key, value in ours.items():
            setattr(loader.od_config, key, value)
    # before vllm-omni builds the pipeline: full/broadcast fill the DiTs it builds (some of their layers it
    # initializes); rank_local frees them and takes its own once they are on meta (rank_local.load_model)
    session.mark_baseline()
    setattr(loader, STATE_ATTR, {"session": session, "options": options, "strategy": strategy,
                                 "report": session.report})
    return session


def session_of(loader: Any) -> LoadSession | None:
    """The worker's load session, once :func:`prepare` ran for ``loader`` (None before)."""
    state = getattr(loader, STATE_ATTR, None)
    return state["session"] if state is not None else None


def prepare_dits(loader: Any, model: Any, sources=None) -> list[DitSource]:
    """``model``'s DiT sources resolved by the session (strict manifests, stamps), their LoRA files validated
    against each DiT's diffusers skeleton, one report entry each. Nothing is read."""
    session = session_of(loader) or prepare(loader, "default")
    omni_sources = list(sources if sources is not None else loader._get_weight_sources(model))
    if not omni_sources:
        raise ValueError(f"{type(model).__name__} declares no weight sources; --load-format diffusion-hsdp loads "
                         f"pipelines whose DiTs are diffusers folders")
    adapters = [loader._get_checkpoint_adapter(model, s, True) for s in omni_sources]
    for s, adapter in zip(omni_sources, adapters):
        if adapter is not None and not is_fp8_adapter(adapter):
            raise ValueError(f"{type(model).__name__}.{component_name(s)} needs vllm-omni's checkpoint "
                             f"adapter {type(adapter).__name__}, which --load-format diffusion-hsdp does not carry")
    names = [component_name(s) for s in omni_sources]
    resolved = [_resolve(s, name, allow_pickle=session.options.allow_pickle) for s, name in zip(omni_sources, names)]
    session.adopt(resolved, dits=names, lora_specs=_lora_specs(loader.od_config, session.options, names))
    return [DitSource(name, s.prefix, source, session.stream_fuser(source, dtype=loader.od_config.dtype),
                      session.component(source), adapter=adapter)
            for s, name, source, adapter in zip(omni_sources, names, resolved, adapters)]


def _resolve(omni_source: Any, name: str, *, allow_pickle: bool) -> ComponentSource:
    """Our validated ``ComponentSource`` of one of vllm-omni's sources (strict manifests), named ``name``."""
    found = resolve_checkpoint(omni_source.model_or_path, allow_pickle=allow_pickle, revision=omni_source.revision,
                               components=[omni_source.subfolder] if omni_source.subfolder else None)
    if len(found) != 1:
        raise ValueError(f"{omni_source.model_or_path} (subfolder {omni_source.subfolder!r}) resolves to "
                         f"{len(found)} components")
    return dataclasses.replace(found[0], name=name)


def stream(session: LoadSession, dits: Iterable[DitSource],
           device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every DiT's tensors from the session's stream (LoRA fused, counted), prefixed with vllm-omni's source prefix,
    through vllm-omni's checkpoint adapter where it has one. ``device``: where the DiTs' parameters are (an
    accelerator): the tensors are handed out there through pinned staging, so vllm-omni copies device to device."""
    for dit in dits:
        tensors = ((dit.prefix + name, tensor) for name, tensor in
                   session.stream(dit.source, entry=dit.report, fuser=dit.fuser, device=device))
        yield from (dit.adapter.adapt(tensors) if dit.adapter is not None else tensors)


def load_dits(loader: Any, model: Any, *, sources=None, stream_online_quant_to_cpu: bool = False) -> None:
    """``full`` / ``broadcast`` (rank 0): ``model``'s DiT sources streamed into vllm-omni's ``load_weights``."""
    session = session_of(loader) or prepare(loader, "default")
    dits = prepare_dits(loader, model, sources)
    expected = loader._get_expected_parameter_names(model)
    device = None if stream_online_quant_to_cpu else accelerator_of(
        model.get_submodule(dit.prefix.rstrip(".")) if dit.prefix else model for dit in dits)
    weights = stream(session, dits, device)
    if stream_online_quant_to_cpu:
        weights = loader._stream_online_quant_weights_to_cpu(model, weights)
    with session.reading(*(dit.component for dit in dits)):  # a shard truncated or replaced since: named
        loaded = model.load_weights(weights)
    check_loaded(model, expected, None if loaded is None else set(loaded),
                 quantized=loader.quant_config is not None, exempt_suffixes=QUANT_SCALE_SUFFIXES)
    if any(dit.adapter is not None for dit in dits):
        check_fp8_scales_loaded(model)
    mark_fused(loader, model)
    keep(model, session, strategy=session.report.strategy)  # what a runtime LoRA update asks (it refuses this one)


def check_fp8_scales_loaded(model: nn.Module) -> None:
    """Raise naming every FP8 layer of ``model`` (vllm-omni's) whose ``weight_scale`` kept its unloaded sentinel: the
    checkpoint stores that layer unquantized (ModelOpt's ``exclude_modules``) but vllm-omni built it as FP8 (the
    exclusion did not reach its layer), so its weight was cast to FP8 with no scale."""
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


def mark_fused(loader: Any, model: Any) -> None:
    if _omni_distill_loras(loader.od_config):
        model.lora_is_fused = True  # fused with our rule; vllm-omni must not fuse them again


def _omni_distill_loras(od_config: Any) -> list[str]:
    backend = getattr(od_config, "lora_backend", None)
    if getattr(backend, "value", backend) != "distill":
        return []
    paths = getattr(od_config, "lora_path", None) or []
    return [paths] if isinstance(paths, str) else list(paths)


def _lora_specs(od_config: Any, options: Any, components: Sequence[str]) -> list[LoraSpec]:
    """Our ``lora_path`` entries, then vllm-omni's own distilled LoRAs (``--lora-path`` with ``--lora-backend
    distill``), by position as vllm-omni assigns them to ``components``."""
    specs = [LoraSpec.parse(text, default_scale=options.lora_scale) for text in options.lora_path]
    distill = _omni_distill_loras(od_config)
    if distill:
        scale = getattr(od_config, "lora_scale", 1.0)
        if scale != 1.0:
            raise ValueError(f"vllm-omni's --lora-scale {scale} with --lora-backend distill has no effect in "
                             f"vllm-omni; with --load-format diffusion-hsdp give the scale as PATH@SCALE in "
                             f"--additional-config diffusion_hsdp lora_path")
        if len(distill) > 1 and len(distill) != len(components):
            raise ValueError(f"vllm-omni's --lora-path has {len(distill)} files for {len(components)} DiTs "
                             f"({', '.join(components)}); give one per DiT, in order")
        named = components if len(distill) == len(components) else [None] * len(distill)
        specs += [LoraSpec.parse(path) if name is None else LoraSpec(LoraSpec.parse(path).path, 1.0, name)
                  for path, name in zip(distill, named)]
    return specs
