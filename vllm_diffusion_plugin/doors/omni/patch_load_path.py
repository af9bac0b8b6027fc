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
  ``threads.bounded_reads(read_timeout_s)``: a read of ours that the store does not answer fails the load naming
  the file and the offset; a load error is recorded for the server's line (``patch_worker_death.record_error``);
- ``load_weights``: for our format, the DiT sources go through ``load_path`` (our manifests, our reader,
  LoRA fused per component with our fusion and device rule, vllm-omni's ``model.load_weights`` for its names
  and q/k/v stacking, our strict missing-weight check). LoRA files: ``lora_path`` entries
  ``[COMPONENT=]PATH[@SCALE]`` (``lora.specs.assign_loras``), plus vllm-omni's own distilled LoRAs
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

import functools
import importlib
import time
from typing import Any

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni._patching import UnrecognizedShape, is_patched, mark, require_attr, require_params
from vllm_diffusion_plugin.engine.config import LOAD_FORMAT

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
        from vllm_diffusion_plugin.doors.omni import patch_load_format, serve_options

        original(self, load_config, od_config, *args, **kwargs)
        if serve_options.carried(od_config) and not patch_load_format.uses_diffusion_hsdp(self):
            self.load_config = patch_load_format.with_load_format(self.load_config, LOAD_FORMAT)

    return __init__


def _wrap_load_model(original):
    @functools.wraps(original)
    def load_model(self, load_device, load_format="default", custom_pipeline_name=None, device=None, **kwargs):
        from vllm_diffusion_plugin.doors.omni import load_path, patch_load_format, patch_worker_death

        if not patch_load_format.uses_diffusion_hsdp(self):
            return original(self, load_device, load_format, custom_pipeline_name, device, **kwargs)
        try:
            session = load_path.prepare(self, load_format)
            start = time.perf_counter()
            # every read of ours below (the session's stream under full/broadcast, rank_local's rows) in this thread
            with session.reading():
                model = original(self, load_device, load_format, custom_pipeline_name, device, **kwargs)
        except Exception as exc:  # the server's error line names it (not only "rank 0 exited with code 1")
            patch_worker_death.record_error(load_path.World.current().rank, exc)
            raise
        names = [load_path.component_name(s) for s in self._get_weight_sources(model)]
        session.finish(total_s=time.perf_counter() - start, names=names, log=logger)  # every DiT, read here or not
        return model

    return load_model


def _wrap_load_weights(original):
    @functools.wraps(original)
    def load_weights(self, model, *args, stream_online_quant_to_cpu=False, sources=None, planned_weights=(),
                     **kwargs):
        from vllm_diffusion_plugin.doors.omni import load_path, patch_load_format

        if not patch_load_format.uses_diffusion_hsdp(self) or args or kwargs or planned_weights:
            return original(self, model, *args, stream_online_quant_to_cpu=stream_online_quant_to_cpu,
                            sources=sources, planned_weights=planned_weights, **kwargs)
        return load_path.load_dits(self, model, sources=sources, stream_online_quant_to_cpu=stream_online_quant_to_cpu)

    return load_weights


def _wrap_load_model_with_hsdp(original):
    @functools.wraps(original)
    def _load_model_with_hsdp(self, target_device, load_format="default", custom_pipeline_name=None, *args,
                              **kwargs):
        from vllm_diffusion_plugin.doors.omni import load_path, patch_load_format, rank_local

        session = load_path.session_of(self)
        if not patch_load_format.uses_diffusion_hsdp(self) or session is None \
                or session.report.strategy != "rank_local":
            return original(self, target_device, load_format, custom_pipeline_name, *args, **kwargs)
        model = rank_local.load_model(self, session, target_device=target_device, load_format=load_format,
                                      custom_pipeline_name=custom_pipeline_name)
        load_path.mark_fused(self, model)
        return model

    return _load_model_with_hsdp
