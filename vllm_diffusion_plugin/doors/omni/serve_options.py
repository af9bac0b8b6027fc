"""Options of ``--load-format diffusion-hsdp`` under ``vllm serve --omni``, and what that door supports.

vllm-omni refuses ``--model-loader-extra-config`` and drops the stage's load format on the way to its
diffusion workers (``build_diffusion_config`` keeps only ``OmniDiffusionConfig`` fields). Options therefore
travel in ``--additional-config '{"diffusion_hsdp": {...}}'`` -- the same keys, types and ``VLLM_DIFFUSION_*``
env fallbacks as ``--model-loader-extra-config`` (``config.LoadOptions``) -- and the load format itself is
carried to the workers under :data:`CARRIED_KEY` of the same ``additional_config`` (``patch_serve_flag``).

Everything here is checked twice: in the API server (``patch_serve_flag``, before any worker starts) and in
each worker before the first weight is read (``patch_load_path``), so an offline ``Omni(...)`` gets the same
refusals.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.session import (
    LOAD_FORMAT,
    LoadOptions,
    LoadSession,
    LoraSpec,
    is_transformer,
    resolve_checkpoint,
    row_wise_methods,
)

logger = init_logger(__name__)

OPTIONS_KEY = "diffusion_hsdp"
"""The ``--additional-config`` key holding our options."""
CARRIED_KEY = "diffusion_hsdp_load_format"
"""Set by ``patch_serve_flag`` in ``additional_config`` when the stage's ``--load-format`` is ours."""
ORIGIN = "--additional-config diffusion_hsdp"

UNSUPPORTED_KEYS = {
    "hsdp_block_pattern": "vllm-omni shards each DiT by its own _hsdp_shard_conditions",
    "hsdp_broadcast_bucket_mb": "vllm-omni's broadcast uses its own 256 MiB buckets",
    "hsdp_broadcast_timeout_s": "vllm-omni's broadcast uses its process group's timeout",
    "collective_timeout_s": "vllm-omni creates its process groups with its own timeout",
    "strict_unexpected": "vllm-omni's model load_weights skips checkpoint keys it has no place for",
}
"""Keys with no effect under vllm-omni: a non-default value is an error naming the key and why."""

OFFLOAD_FIELDS = ("enable_cpu_offload", "enable_layerwise_offload", "enable_distributed_layerwise_offload")


def omni_options(additional_config: Mapping[str, Any] | None, *, origin: str = ORIGIN):
    """Our ``LoadOptions`` from ``additional_config[OPTIONS_KEY]`` (env fallbacks apply), or raise naming the key."""
    raw = (additional_config or {}).get(OPTIONS_KEY) or {}
    if not isinstance(raw, Mapping):
        raise TypeError(f"{origin} must be a JSON object of load options, got {type(raw).__name__} {raw!r}")
    options = LoadOptions.from_extra_config(raw, origin=origin, not_listed=UNSUPPORTED_KEYS)
    defaults = LoadOptions()
    for key, why in UNSUPPORTED_KEYS.items():
        if getattr(options, key) != getattr(defaults, key):
            raise ValueError(f"{origin} key {key!r} (= {getattr(options, key)!r}) has no effect under vllm-omni: "
                             f"{why}; remove it")
    return options


def check_lora_entries(options: Any, model: Any) -> None:
    """Every ``lora_path`` entry's file exists, and a component it names is one that a local pipeline folder's
    ``model_index.json`` lists (whether that component is a DiT the workers decide); else an error naming the
    entry, before any worker starts."""

    specs = [(text, LoraSpec.parse(text, default_scale=options.lora_scale)) for text in options.lora_path]
    for text, spec in specs:
        if not spec.path.is_file():
            raise FileNotFoundError(f"lora_path entry {text!r}: LoRA file {spec.path} does not exist")
    index = Path(str(model)) / "model_index.json" if model else None
    if index is None or not index.is_file() or all(spec.component is None for _, spec in specs):
        return
    try:
        components = sorted(k for k, v in json.loads(index.read_text()).items()
                            if not k.startswith("_") and isinstance(v, list))
    except (OSError, ValueError, AttributeError):
        return  # the workers' checkpoint resolution names what is wrong with the index
    for text, spec in specs:
        if spec.component is not None and spec.component not in components:
            raise ValueError(f"lora_path entry {text!r} names component {spec.component!r}, which {index} does "
                             f"not list; its components: {', '.join(components)}")


def check_lora_files(options: Any, od_config: Any) -> None:
    """Every ``lora_path`` file read and checked as the workers will (keys, ranks, shapes, finiteness, a file that
    fuses nothing) against its DiT's skeleton built on ``meta`` from the folder's ``config.json``, so that a bad
    LoRA stops the API server in seconds instead of every worker after it built its pipeline. A model that is no
    local folder (a hub id) is left to the workers. Errors name the file, the component and the first keys."""
    model = field_of(od_config, "model", None)
    if not options.lora_path or not model or not Path(str(model)).is_dir():
        return
    specs = [LoraSpec.parse(text, default_scale=options.lora_scale) for text in options.lora_path]
    session = LoadSession(options, device=torch.device("cpu"), dtype=torch.float32, lora_specs=specs)
    dits = [s for s in resolve_checkpoint(str(model), allow_pickle=options.allow_pickle) if is_transformer(s)]
    session.adopt(dits, our_quantization=False)  # quantization: the workers' check, with vllm-omni's config
    for source in dits:
        session.prepare_loras(source)


def carried(od_config: Any) -> bool:
    """Whether vllm-omni's diffusion config carries ``--load-format diffusion-hsdp`` (see ``patch_serve_flag``)."""
    additional = getattr(od_config, "additional_config", None) or {}
    return isinstance(additional, Mapping) and additional.get(CARRIED_KEY) == LOAD_FORMAT


def weight_load_strategy(options: Any, od_config: Any) -> str:
    """Ours (``hsdp_weight_load``), except that the default ``full`` gives way to vllm-omni's own switches:
    ``--enable-broadcast-weight-load`` means ``broadcast``; ``hsdp_weight_load_strategy=pre_sharded`` (vllm-omni
    after 0.30: meta-first shards, each rank reads its slices) means ``rank_local``."""
    if options.hsdp_weight_load != "full":
        return options.hsdp_weight_load
    if bool(field_of(od_config, "enable_broadcast_weight_load", False)):
        return "broadcast"
    if field_of(od_config, "hsdp_weight_load_strategy", "full") == "pre_sharded":
        return "rank_local"
    return "full"


def read_threads(options: Any, od_config: Any) -> int:
    """Ours (``read_threads`` in ``diffusion_hsdp`` or ``VLLM_DIFFUSION_READ_THREADS``) when given, else vllm-omni's
    own reading threads: ``--num-weight-load-threads`` (default 4), 1 with ``enable_multithread_weight_load`` off."""
    if options.read_threads is not None:
        return options.read_threads
    if not field_of(od_config, "enable_multithread_weight_load", True):
        return 1
    threads = field_of(od_config, "num_weight_load_threads", None)
    return options.threads if threads is None else max(1, int(threads))


def refusals(options: Any, od_config: Any) -> list[str]:
    """Every combination of our options with vllm-omni's that this door does not carry (empty: all fine).

    ``od_config`` is vllm-omni's ``OmniDiffusionConfig`` or the mapping of its fields (API server)."""
    problems = []
    strategy = weight_load_strategy(options, od_config)
    if strategy == "broadcast" and field_of(od_config, "hsdp_weight_load_strategy", "full") == "pre_sharded":
        ours = "hsdp_weight_load='broadcast'" if options.hsdp_weight_load == "broadcast" else \
            "vllm-omni's --enable-broadcast-weight-load"
        problems.append(f"{ours} together with vllm-omni's --hsdp-weight-load-strategy pre_sharded (rank 0 reading "
                        f"for all, or each rank its own rows: pre_sharded alone is our 'rank_local', which fuses "
                        f"LoRAs and loads stacked q/k/v; drop one of the two)")
    # online quantization with rank_local: each rank quantizes its own rows where the method declares the row
    # protocol, else each layer is gathered whole and post-processed by the method (engine.quant.whole)
    for name in OFFLOAD_FIELDS:
        if field_of(od_config, name, False):
            problems.append(f"vllm-omni's {name} (offload plans and the host weight runtime)")
    if str(field_of(od_config, "host_weight_runtime_mode", "disabled") or "disabled") != "disabled":
        problems.append("vllm-omni's host_weight_runtime_mode (the host weight runtime)")
    pipeline_format = field_of(od_config, "diffusion_load_format", "default") or "default"
    if pipeline_format in ("diffusers", "dummy"):
        problems.append(f"vllm-omni's --diffusion-load-format {pipeline_format} (its pipeline reads no DiT "
                        f"weights through the loader)")
    if field_of(od_config, "diffusion_offload_config", None):
        problems.append("vllm-omni's diffusion_offload_config (offload plans)")
    return problems


def check_supported(options: Any, od_config: Any) -> None:
    """Raise naming a bad ``lora_path`` entry (:func:`check_lora_entries`), or one error listing every combination
    :func:`refusals` finds."""
    check_lora_entries(options, field_of(od_config, "model", None))
    problems = refusals(options, od_config)
    if problems:
        raise ValueError("--load-format diffusion-hsdp under vllm-omni cannot be combined with: "
                         + "; ".join(problems) + ". Drop them or serve without --load-format diffusion-hsdp")


CARRIED_FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
"""ModelOpt ``quant_algo`` values of the pre-quantized checkpoints this door reads (``fused_stream.StreamFuser``)."""


def carried_fp8_checkpoint(quant_config: Any) -> bool:
    """vllm-omni's ModelOpt FP8 config of a pre-quantized checkpoint (per tensor or per channel): read as it is
    through vllm-omni's own ModelOpt adapter and layers, LoRA fused exactly."""
    name = quant_config.get_name() if hasattr(quant_config, "get_name") else None
    return name == "modelopt" and getattr(quant_config, "is_checkpoint_fp8_serialized", False) is True \
        and str(getattr(quant_config, "quant_method", "")).upper() in CARRIED_FP8_ALGOS


def checkpoint_strategy(quant_config: Any, strategy: str = "full") -> str:
    """The weight-load strategy a checkpoint quantized as ``quant_config`` (vllm-omni's) loads with, or raise naming
    vllm-omni's quantization when the checkpoint itself is quantized (GGUF, torchao, serialized FP8 / NVFP4 / MXFP /
    INT8, ModelOpt mixed) and not carried. ModelOpt FP8 is (:func:`carried_fp8_checkpoint`): with ``full``; with
    ``rank_local`` where its method finishes a layer row by row (named in ``quant.online.ROW_WISE_METHODS``, see
    ``quant.parts``); ``broadcast`` loads it with ``full`` (vllm-omni broadcasts only unquantized weights,
    so every rank reads it; said once)."""
    if quant_config is None:
        return strategy
    name = quant_config.get_name() if hasattr(quant_config, "get_name") else type(quant_config).__name__
    if carried_fp8_checkpoint(quant_config):
        if strategy == "rank_local" and name not in row_wise_methods():
            raise ValueError(f"a pre-quantized ModelOpt FP8 checkpoint ({quant_config.quant_method}) with "
                             f"hsdp_weight_load='rank_local': each rank finishes its own FP8 rows as the method "
                             f"finishes the whole layer, and {type(quant_config).__name__}'s method does not declare "
                             f"how (vLLM's ModelOpt post-processing and GEMM layout are CUDA ops, not checked row by "
                             f"row here); use 'full' (the CLI's rank_local reads FP8 rows)")
        if strategy == "broadcast":
            logger.info("hsdp_weight_load=broadcast with a pre-quantized ModelOpt FP8 checkpoint: vllm-omni "
                        "broadcasts only unquantized weights, so every rank reads the checkpoint ('full'); "
                        "'rank_local' reads 1/S of it per rank")
            return "full"
        return strategy
    # each config marks a serialized checkpoint with its own flag (is_checkpoint_fp8_serialized,
    # _nvfp4_, _mxfp8_, _int8_, _torchao_ ...), as vllm-omni's own _disk_marks_serialized reads them
    flags = sorted(k for k, v in vars(quant_config).items() if k.startswith("is_checkpoint_") and v is True) \
        if hasattr(quant_config, "__dict__") else []
    pre_quantized = bool(flags) or getattr(quant_config, "data_type", None) == "mx_fp" or \
        str(name).lower().startswith(("gguf", "torchao", "modelopt"))
    if pre_quantized:
        raise ValueError(f"--load-format diffusion-hsdp reads unquantized diffusers checkpoints (online "
                         f"quantization is fine) and ModelOpt FP8 ones; vllm-omni's quantization {name!r} with a "
                         f"GGUF / torchao / pre-quantized checkpoint ({', '.join(flags) or 'by its method'}) is not "
                         f"carried: serve it without --load-format diffusion-hsdp")
    return strategy


def quant_name(quantization: Any) -> str:
    if isinstance(quantization, str):
        return quantization
    if isinstance(quantization, Mapping):
        return str(quantization.get("method") or quantization.get("quant_method") or dict(quantization))
    return quantization.get_name() if hasattr(quantization, "get_name") else type(quantization).__name__


def field_of(config: Any, name: str, default: Any) -> Any:
    """``config``'s field ``name`` -- vllm-omni's ``OmniDiffusionConfig`` or, in the API server, the mapping of its
    fields -- or ``default``."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)
