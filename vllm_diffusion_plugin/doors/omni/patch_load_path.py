"""Patch: vllm-omni's diffusion workers load the DiTs through our path under ``--load-format diffusion-hsdp``.

Why. vllm-omni's diffusion model runner builds ``DiffusersPipelineLoader(LoadConfig(), od_config)``: the load
format never reaches the loader (``patch_serve_flag`` carries it in ``od_config.additional_config``), and
its own ``load_weights`` reads every DiT with vLLM's iterators (no strict shard manifests, every rank reads
everything), fuses distilled LoRAs after loading with its own rules, and only for the distill backend.

How. Three wrappers on ``DiffusersPipelineLoader`` (all shapes checked before any is applied):

- ``__init__``: when ``od_config`` carries our load format, the loader gets a copy of its load config with
  ``load_format="diffusion-hsdp"`` (so ``patch_load_format``'s HSDP sizing and ``_prepare_weights`` engage);
- ``load_model``: for our format, before vllm-omni builds anything: options from
  ``--additional-config diffusion_hsdp`` (``serve_options``), combinations we do not carry refused
  (``serve_options.check_supported``; vllm-omni's ``--diffusion-load-format diffusers`` / ``dummy``;
  GGUF / torchao / pre-quantized checkpoints but ModelOpt FP8: ``serve_options.checkpoint_strategy``), this rank's
  planned device peak held against its free accelerator memory (``preflight.check_device``); the weight-load
  strategy (``broadcast``: vllm-omni's ``enable_broadcast_weight_load`` on the loader's copy of ``od_config``: rank
  0 loads through our path, vllm-omni's bucketed broadcast sends the result, the other ranks read nothing; a
  ModelOpt FP8 checkpoint loads with ``full``, as vllm-omni broadcasts no quantized one); then one INFO line per DiT
  component on every rank, ``diffusion-hsdp load report: component=... rank=... bytes_read=... total_s=...
  peak_rss=...`` (the worker's peak RSS up to the end of its load). vllm-omni's load runs within
  ``reader.bounded_reads(read_timeout_s)``: a read of ours that the store does not answer fails the load naming
  the file and the offset; a load error is recorded for the server's line (``patch_worker_death.record_error``);
- ``load_weights``: for our format, the DiT sources go through ``load_path`` (our manifests, our reader,
  LoRA fused per component with our fusion and device rule, vllm-omni's ``model.load_weights`` for its names
  and q/k/v stacking, our strict missing-weight check). LoRA files: ``lora_path`` entries
  ``[COMPONENT=]PATH[@SCALE]`` (``pipeline.assign_loras``), plus vllm-omni's own distilled LoRAs
  (``--lora-path`` with ``--lora-backend distill``, by position as vllm-omni assigns them), after which the
  model is marked ``lora_is_fused`` so vllm-omni does not fuse them again. A pipeline with checkpoint
  adapters (non-diffusers layouts) is refused naming the component, except vllm-omni's ModelOpt FP8 adapter of a
  pre-quantized checkpoint, which our stream goes through (``load_path``).

Post-load processing (``patch_postprocess``) and HSDP sharding (vllm-omni's ``apply_hsdp_to_model``, sizes from
``patch_load_format``) follow in vllm-omni's own ``load_model``.

Versions. Recognized shape: ``__init__(self, load_config, od_config)``, ``load_model(self, load_device,
load_format, custom_pipeline_name, device)``, ``load_weights(self, model, *, stream_online_quant_to_cpu,
sources, planned_weights)``, ``_get_weight_sources``, ``_get_expected_parameter_names``,
``_get_checkpoint_adapter`` (tested on 0.30.0, 0.31.0rc1 and 0.32.0rc1). From 0.31 on, vllm-omni's own
``_load_model_with_hsdp`` first branches to its ``pre_sharded`` load (``--hsdp-weight-load-strategy``; no LoRA, no
stacked q/k/v): under our load format that option means our ``rank_local`` (``serve_options.weight_load_strategy``),
its combination with a broadcast switch is refused at startup (``serve_options.refusals``), and the loader's copy of
``od_config`` never hands a load to it.

Remove when vllm-omni's loader takes a load format from vLLM's loader registry for its DiT sources.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import time
from typing import Any

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni._patching import (
    UnrecognizedShape,
    is_patched,
    mark,
    require_attr,
    require_params,
)

logger = init_logger(__name__)

NAME = "load-path"
TARGET = "vllm_omni.diffusion.model_loader.diffusers_loader"
REQUIRED_BY_LOAD_FORMAT = True
LOAD_MODEL_PARAMS = ("self", "load_device", "load_format", "custom_pipeline_name", "device")
LOAD_WEIGHTS_KWARGS = ("stream_online_quant_to_cpu", "sources", "planned_weights")
HELPERS = ("_get_weight_sources", "_get_expected_parameter_names", "_get_checkpoint_adapter",
           "_init_from_load_format", "_process_weights_after_loading")
LOAD_HSDP_PARAMS = ("self", "target_device", "load_format", "custom_pipeline_name")
RANK_LOCAL_NEEDS = {
    "vllm_omni.diffusion.distributed.hsdp": ("HSDPInferenceConfig", "apply_hsdp_to_model"),
    "vllm_omni.diffusion.offloader.module_collector": ("ModuleDiscovery",),
}
"""What ``rank_local.load_model`` uses of vllm-omni besides the loader's own methods."""
QUANT_SCALE_SUFFIXES = (".g_idx", ".weight_scale", ".weight_scale_inv", ".input_scale")
STATE_ATTR = "_diffusion_hsdp_state"
CARRIED_PIPELINE_FORMATS = (None, "default", "custom_pipeline")
"""vllm-omni's own ``--diffusion-load-format`` values whose pipelines declare ``weights_sources`` for us to read
(a custom pipeline without them is refused by ``load_dits``)."""


def apply(module: Any) -> str:
    where = f"{module.__name__}.DiffusersPipelineLoader"
    cls = require_attr(module, "DiffusersPipelineLoader", module.__name__)
    init, load_model, load_weights, load_hsdp = (require_attr(cls, n, where) for n in (
        "__init__", "load_model", "load_weights", "_load_model_with_hsdp"))
    if is_patched(init) and is_patched(load_weights):
        return "already applied"
    require_params(load_hsdp, LOAD_HSDP_PARAMS, f"{where}._load_model_with_hsdp")
    for target, names in RANK_LOCAL_NEEDS.items():
        found = importlib.import_module(target)
        for name in names:
            require_attr(found, name, target)
    require_params(init, ("self", "load_config", "od_config"), f"{where}.__init__")
    require_params(load_model, LOAD_MODEL_PARAMS, f"{where}.load_model")
    signature = require_params(load_weights, ("self", "model"), f"{where}.load_weights")
    missing = [k for k in LOAD_WEIGHTS_KWARGS if k not in signature.parameters]
    if missing:
        raise UnrecognizedShape(f"{where}.load_weights{signature} has no parameter(s) {missing}")
    for helper in HELPERS:
        require_attr(cls, helper, where)
    cls.__init__ = mark(_wrap_init(init), unit=NAME, original=init)
    cls.load_model = mark(_wrap_load_model(load_model), unit=NAME, original=load_model)
    cls.load_weights = mark(_wrap_load_weights(load_weights), unit=NAME, original=load_weights)
    cls._load_model_with_hsdp = mark(_wrap_load_model_with_hsdp(load_hsdp), unit=NAME, original=load_hsdp)
    return "applied"


def _wrap_init(original):
    @functools.wraps(original)
    def __init__(self, load_config, od_config, *args, **kwargs):
        from vllm_diffusion_plugin import LOAD_FORMAT
        from vllm_diffusion_plugin.doors.omni.patch_load_format import uses_diffusion_hsdp, with_load_format
        from vllm_diffusion_plugin.doors.omni.serve_options import carried

        original(self, load_config, od_config, *args, **kwargs)
        if carried(od_config) and not uses_diffusion_hsdp(self):
            self.load_config = with_load_format(self.load_config, LOAD_FORMAT)

    return __init__


def _wrap_load_model(original):
    @functools.wraps(original)
    def load_model(self, load_device, load_format="default", custom_pipeline_name=None, device=None, **kwargs):
        from vllm_diffusion_plugin.doors.omni.load_path import component_name
        from vllm_diffusion_plugin.doors.omni.patch_load_format import uses_diffusion_hsdp

        if not uses_diffusion_hsdp(self):
            return original(self, load_device, load_format, custom_pipeline_name, device, **kwargs)
        from vllm_diffusion_plugin.engine.reader import bounded_reads

        try:
            state = _prepare(self, load_format)
            start = time.perf_counter()
            # every read of ours below (load_path.stream under full/broadcast, rank_local's rows) runs in this thread
            with bounded_reads(state["options"].read_timeout_s):
                model = original(self, load_device, load_format, custom_pipeline_name, device, **kwargs)
        except Exception as exc:  # the server's error line names it (not only "rank 0 exited with code 1")
            from vllm_diffusion_plugin.doors.omni.patch_worker_death import record_error
            from vllm_diffusion_plugin.engine.pipeline import World

            record_error(World.current().rank, exc)
            raise
        names = [component_name(s) for s in self._get_weight_sources(model)]
        _log_reports(state, names, total_s=time.perf_counter() - start)
        return model

    return load_model


def _prepare(loader: Any, load_format: str | None) -> dict[str, Any]:
    """Every check that needs no weights; the strategy set on the loader's own copy of ``od_config``."""
    from vllm_diffusion_plugin.doors.omni.patch_load_format import omni_load_options
    from vllm_diffusion_plugin.doors.omni.preflight import check_device
    from vllm_diffusion_plugin.doors.omni.serve_options import (
        check_supported,
        checkpoint_strategy,
        read_threads,
        weight_load_strategy,
    )
    from vllm_diffusion_plugin.engine.pipeline import World
    from vllm_diffusion_plugin.engine.report import LoadReport, status_memory

    od_config = loader.od_config
    options = omni_load_options(loader)
    options = dataclasses.replace(options, read_threads=read_threads(options, od_config))
    check_supported(options, od_config)
    check_device(options, od_config)  # this rank's accelerator, before vllm-omni builds anything
    from vllm_diffusion_plugin.engine.pressure import watch_process

    watch_process(f"diffusion worker {World.current().rank}'s load and first run")  # the worker's life
    if load_format not in CARRIED_PIPELINE_FORMATS:
        raise ValueError(f"--load-format diffusion-hsdp reads the DiTs a pipeline declares in weights_sources; "
                         f"vllm-omni's --diffusion-load-format {load_format!r} (the diffusers adapter loads "
                         f"itself, dummy weights read nothing) is not carried: drop one of them")
    strategy = weight_load_strategy(options, od_config)
    if strategy != "full" and World.current().world_size == 1:
        logger.info("hsdp_weight_load=%s with a single rank: loading with 'full'.", strategy)
        strategy = "full"
    strategy = checkpoint_strategy(loader.quant_config, strategy)
    ours = {"enable_broadcast_weight_load": strategy == "broadcast"}
    if getattr(od_config, "hsdp_weight_load_strategy", "full") == "pre_sharded":
        ours["hsdp_weight_load_strategy"] = "full"  # never upstream's pre-sharded load (no LoRA, no stacked q/k/v)
    if any(getattr(od_config, key, False) != value for key, value in ours.items()):
        loader.od_config = copy.copy(od_config)
        for key, value in ours.items():
            setattr(loader.od_config, key, value)
    world = World.current()
    state = {"options": options, "strategy": strategy,
             "report": LoadReport(rank=world.rank, world_size=world.world_size, strategy=strategy,
                                   read_threads=options.threads)}
    # before vllm-omni builds the pipeline: full/broadcast fill the DiTs it builds (some of their layers it
    # initializes); rank_local frees them and takes its own once they are on meta (rank_local.load_model)
    state["report"].baseline_rss_bytes = status_memory().get("VmRSS", 0)
    setattr(loader, STATE_ATTR, state)
    return state


def _wrap_load_weights(original):
    @functools.wraps(original)
    def load_weights(self, model, *args, stream_online_quant_to_cpu=False, sources=None, planned_weights=(),
                     **kwargs):
        from vllm_diffusion_plugin.doors.omni.patch_load_format import uses_diffusion_hsdp

        if not uses_diffusion_hsdp(self) or args or kwargs or planned_weights:
            return original(self, model, *args, stream_online_quant_to_cpu=stream_online_quant_to_cpu,
                            sources=sources, planned_weights=planned_weights, **kwargs)
        return load_dits(self, model, sources=sources, stream_online_quant_to_cpu=stream_online_quant_to_cpu)

    return load_weights


def prepare_dits(loader: Any, model: Any, sources=None) -> list[Any]:
    """``model``'s DiT sources resolved by us (strict manifests), their LoRA files validated against each DiT's
    diffusers skeleton, one report each: ``load_path.DitSource`` per source. Nothing is read."""
    from vllm_diffusion_plugin.doors.omni import load_path
    from vllm_diffusion_plugin.engine import integrity
    from vllm_diffusion_plugin.engine.report import ComponentReport

    state = getattr(loader, STATE_ATTR, None) or _prepare(loader, "default")
    options = state["options"]
    omni_sources = list(sources if sources is not None else loader._get_weight_sources(model))
    if not omni_sources:
        raise ValueError(f"{type(model).__name__} declares no weight sources; --load-format diffusion-hsdp loads "
                         f"pipelines whose DiTs are diffusers folders")
    adapters = [loader._get_checkpoint_adapter(model, s, True) for s in omni_sources]
    for s, adapter in zip(omni_sources, adapters):
        if adapter is not None and not load_path.is_fp8_adapter(adapter):
            raise ValueError(f"{type(model).__name__}.{load_path.component_name(s)} needs vllm-omni's checkpoint "
                             f"adapter {type(adapter).__name__}, which --load-format diffusion-hsdp does not carry")
    resolved = load_path.resolve_sources(omni_sources, allow_pickle=options.allow_pickle)
    stamps = [integrity.stamp(source.files) for source in resolved]  # right after their headers were read
    names = [load_path.component_name(s) for s in omni_sources]
    loras = _assign_loras(loader, options, names)
    dits = []
    for s, source, name, adapter, stamped in zip(omni_sources, resolved, names, adapters, stamps):
        files = [(str(spec.path), spec.scale) for spec in loras.get(name, [])]
        report = ComponentReport(name=name, class_name=str(source.config.get("_class_name", "?")),
                                 files=len(source.files), lora_files=len(files))
        fuser = load_path.lora_fuser(source, files, dtype=loader.od_config.dtype, strict=options.lora_strict,
                                     chunk_mb=options.lora_device_chunk_mb,
                                     check_finite=options.lora_check_finite,
                                     host_weights=options.lora_host_weights)
        dits.append(load_path.DitSource(name, s.prefix, source, fuser, report, threads=options.threads,
                                        staging_bytes=options.pinned_staging_mb << 20, adapter=adapter,
                                        stamps=stamped))
        state["report"].components.append(report)
    return dits


def load_dits(loader: Any, model: Any, *, sources=None, stream_online_quant_to_cpu: bool = False) -> None:
    """``load_path`` for ``model``'s DiT sources (see the module docstring)."""
    from vllm_diffusion_plugin.doors.omni import load_path
    from vllm_diffusion_plugin.engine import platform

    dits = prepare_dits(loader, model, sources)
    expected = loader._get_expected_parameter_names(model)
    device = None if stream_online_quant_to_cpu else platform.accelerator_of(
        model.get_submodule(dit.prefix.rstrip(".")) if dit.prefix else model for dit in dits)
    weights = load_path.stream(dits, device)
    if stream_online_quant_to_cpu:
        weights = loader._stream_online_quant_weights_to_cpu(model, weights)
    with load_path.unchanged(dits):  # a shard truncated or replaced since its header was read: named
        loaded = model.load_weights(weights)
    load_path.check_loaded(model, expected, None if loaded is None else set(loaded),
                           quantized=loader.quant_config is not None, exempt_suffixes=QUANT_SCALE_SUFFIXES)
    if any(dit.adapter is not None for dit in dits):
        load_path.check_fp8_scales_loaded(model)
    _mark_fused(loader, model)


def _mark_fused(loader: Any, model: Any) -> None:
    if _omni_distill_loras(loader.od_config):
        model.lora_is_fused = True  # fused with our rule; vllm-omni must not fuse them again


def _wrap_load_model_with_hsdp(original):
    @functools.wraps(original)
    def _load_model_with_hsdp(self, target_device, load_format="default", custom_pipeline_name=None, *args,
                              **kwargs):
        from vllm_diffusion_plugin.doors.omni import rank_local
        from vllm_diffusion_plugin.doors.omni.patch_load_format import uses_diffusion_hsdp

        state = getattr(self, STATE_ATTR, None)
        if not uses_diffusion_hsdp(self) or state is None or state["strategy"] != "rank_local":
            return original(self, target_device, load_format, custom_pipeline_name, *args, **kwargs)
        model = rank_local.load_model(self, functools.partial(prepare_dits, self), target_device=target_device,
                                      load_format=load_format, custom_pipeline_name=custom_pipeline_name,
                                      report=state["report"])
        _mark_fused(self, model)
        return model

    return _load_model_with_hsdp


def _omni_distill_loras(od_config: Any) -> list[str]:
    backend = getattr(od_config, "lora_backend", None)
    if getattr(backend, "value", backend) != "distill":
        return []
    paths = getattr(od_config, "lora_path", None) or []
    return [paths] if isinstance(paths, str) else list(paths)


def _assign_loras(loader: Any, options: Any, components: list[str]) -> dict[str, list]:
    from vllm_diffusion_plugin.engine.pipeline import LoraSpec, assign_loras

    specs = [LoraSpec.parse(text, default_scale=options.lora_scale) for text in options.lora_path]
    distill = _omni_distill_loras(loader.od_config)
    if distill:
        scale = getattr(loader.od_config, "lora_scale", 1.0)
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
    return assign_loras(specs, components) if specs else {}


def _log_reports(state: dict[str, Any], components: list[str], *, total_s: float) -> None:
    """One INFO line per DiT component on every rank (``report.report_line``); a component this rank did not
    read (a broadcast receiver: vllm-omni did not call ``load_weights`` here) reports ``bytes_read=0``."""
    from vllm_diffusion_plugin.engine.report import ComponentReport, peak_rss_bytes, report_line

    report = state["report"]
    by_name = {c.name: c for c in report.components}
    peak = peak_rss_bytes()  # this worker's high-water mark up to the end of its load
    for name in components:
        component = by_name.get(name) or ComponentReport(name=name, class_name="?")
        logger.info("%s total_s=%.3f peak_rss=%d baseline_rss=%d", report_line(report, component), total_s, peak,
                    report.baseline_rss_bytes)
