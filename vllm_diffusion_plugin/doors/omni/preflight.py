"""The pre-flight (``engine.preflight``) behind vllm-omni's door: the API server for the host, each worker for its
accelerator.

- :func:`check_host`, in the API server (``patch_serve_flag``), before any worker starts: the plan of the DiTs of
  a local pipeline folder (``plan.plan_load``: headers and ``meta`` skeletons, our ``lora_path`` files) over the
  diffusion ranks vllm-omni's parallel options give, for the strategy the workers will run
  (``serve_options.weight_load_strategy``), against what this node has left -- the workers share it with the API
  server, and each will hold about what the API server holds now before its load (the same imports). vllm-omni
  copies every tensor into the pipeline it builds, so the host needs are the plan's host peaks (file pages
  included), and the first run's all-gather counts on a CPU (the server warms up).
- :func:`check_device`, in each worker (``patch_load_path``) before vllm-omni builds anything: this rank's device
  peak against its accelerator's free memory; nothing on the CPU.

A hub id (no local folder) is left to the workers' load. The switch named in the refusal: ``"preflight": "warn"``
in ``--additional-config diffusion_hsdp`` or ``VLLM_DIFFUSION_PREFLIGHT=warn``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from vllm_diffusion_plugin import envs
from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni.serve_options import field_of, quant_name, weight_load_strategy
from vllm_diffusion_plugin.engine.session import (
    HSDPConfig,
    LoraSpec,
    accelerator_type,
    check_plan,
    online_fp8_hook,
    plan_load,
    private_rss,
)

logger = init_logger(__name__)

HOW = '"preflight": "warn" in --additional-config diffusion_hsdp (or VLLM_DIFFUSION_PREFLIGHT=warn)'


def _parallel(od_config: Any) -> Any:
    """vllm-omni's ``DiffusionParallelConfig`` of the stage (in the API server resolved from its arguments, nested
    ``parallel_config`` or flat, as vllm-omni resolves them), or None."""
    if not isinstance(od_config, dict):
        return getattr(od_config, "parallel_config", None)
    from vllm_omni.diffusion.data import DiffusionParallelConfig

    resolve = getattr(DiffusionParallelConfig, "from_stage_overrides", None)
    if resolve is not None:
        return resolve(od_config)
    config = od_config.get("parallel_config")
    return DiffusionParallelConfig.from_dict(dict(config)) if isinstance(config, dict) else config


def _plan(options: Any, od_config: Any, *, model: str, device_type: str):
    import torch

    parallel = _parallel(od_config)
    world = int(getattr(parallel, "world_size", 1) or 1)
    if getattr(parallel, "use_hsdp", False):
        hsdp = HSDPConfig(replicate_size=parallel.hsdp_replicate_size, shard_size=parallel.hsdp_shard_size)
    else:
        hsdp = HSDPConfig(replicate_size=options.hsdp_replicate_size, shard_size=options.hsdp_shard_size)
    dtype = od_config.get("dtype") if isinstance(od_config, dict) else getattr(od_config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, torch.bfloat16)  # "auto": the DiTs' usual bf16
    plan = plan_load(model, options=options, world_size=world, hsdp=hsdp if world > 1 else None,
                     dtype=dtype if isinstance(dtype, torch.dtype) else torch.bfloat16, device_type=device_type,
                     lora_specs=[LoraSpec.parse(t, default_scale=options.lora_scale) for t in options.lora_path],
                     lora_headers_only=True,  # checked by serve_options.check_lora_files and by each worker
                     quantization=_online_fp8(od_config))
    strategy = weight_load_strategy(options, od_config)
    return dataclasses.replace(plan, views_files=False), strategy if world > 1 else "full"


def _online_fp8(od_config: Any):
    """The plan's ``quantization`` hook for the stage's online fp8 method (None: none, or another method)."""
    quantization = field_of(od_config, "quantization_config", None) or field_of(od_config, "quantization", None)
    return online_fp8_hook(quant_name(quantization)) if quantization else None


def _plan_or_none(options: Any, od_config: Any, *, model: str, device_type: str):
    """``_plan``, or None (logged) where this folder cannot be planned: a pipeline vllm-omni runs may hold a DiT
    whose class diffusers lacks; its load is then left to the workers, as before the pre-flight."""
    try:
        return _plan(options, od_config, model=model, device_type=device_type)
    except Exception as exc:
        logger.warning("pre-flight skipped: %s cannot be planned (%s)", model,
                                 str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None


def _device_type() -> str:
    return "cpu" if envs.get("VLLM_DIFFUSION_OMNI_CPU") else accelerator_type() or "cpu"


def check_host(options: Any, od_config: Any) -> None:
    """The API server's pre-flight (see the module docstring); ``od_config``: the stage's arguments (a dict: its
    ``OmniDiffusionConfig`` fields over the engine arguments they came from)."""
    model = od_config.get("model") if isinstance(od_config, dict) else getattr(od_config, "model", None)
    if options.preflight == "off" or not model or not Path(str(model)).is_dir():
        return
    planned = _plan_or_none(options, od_config, model=str(model), device_type=_device_type())
    if planned is not None:
        plan, strategy = planned
        check_plan(plan, strategy, mode=options.preflight, how=HOW, host=True,
                   starting=plan.world_size * private_rss())


def check_device(session: Any, od_config: Any) -> None:
    """A worker's pre-flight for its accelerator, before vllm-omni builds its pipeline (nothing on the CPU)."""
    model = getattr(od_config, "model", None)
    options = session.options
    if options.preflight == "off" or not model or not Path(str(model)).is_dir() or _device_type() == "cpu" \
            or session.free_memory() is None:
        return
    planned = _plan_or_none(options, od_config, model=str(model), device_type=session.device.type)
    if planned is not None:
        plan, strategy = planned
        session.preflight(plan, strategy=strategy, how=HOW)
