"""Patch: vllm-omni's diffusion loader accepts ``--load-format diffusion-hsdp`` and loads it with HSDP.

Why. ``DiffusersPipelineLoader._prepare_weights`` raises ``ValueError("Unknown load_format: ...")`` for every
load format but ``auto``/``hf``, and vllm-omni uses HSDP only when its own ``--use-hsdp`` is set.

How. Two wrappers on ``DiffusersPipelineLoader`` (both shapes are checked before either is applied); any
other load format goes to vllm-omni's code untouched:

- ``_prepare_weights``: for ``diffusion-hsdp``, vllm-omni's own code runs as for ``hf`` (index-driven shard
  lists, local folders, hub downloads) on a copy of the load config; pickled ``.bin``/``.pt`` weights are then
  refused unless our option ``allow_pickle`` is true.
- ``load_model``: for ``diffusion-hsdp``, the loader gets an HSDP-enabled copy of its parallel config before
  vllm-omni's ``load_model`` chooses its path. Sizes: vllm-omni's own ``--use-hsdp`` options when set (sizes
  given in our options must then agree), else ``hsdp_replicate_size``/``hsdp_shard_size`` from our options
  (``VLLM_DIFFUSION_*`` env fallbacks; ``-1`` = world / R), checked against the torch.distributed world
  vllm-omni started: R x S must equal it; one rank with no sizes anywhere keeps vllm-omni's plain path.
  vllm-omni's own ``apply_hsdp_to_model`` shards, following each model's ``_hsdp_shard_conditions``. The copy
  is the loader's only (``od_config.parallel_config`` is not changed).

Options: ``--additional-config '{"diffusion_hsdp": {...}}'`` under ``vllm serve --omni`` (carried by
``patch_serve_flag``), else the load config's extra config; keys with no effect under vllm-omni are refused
(``serve_options.UNSUPPORTED_KEYS``). The DiT weights themselves are read by ``patch_load_path``.

Versions. Every vllm-omni release checked needs it (0.22, 0.24, 0.26, 0.28 and 0.30 reject other load
formats). Recognized shape: ``__init__(self, load_config, od_config)``, ``_prepare_weights(self,
model_name_or_path, subfolder, revision, fall_back_to_pt, allow_patterns_overrides)``, ``load_model(self,
load_device, load_format, custom_pipeline_name, device)`` and ``_load_model_with_hsdp`` (0.24-0.30; tested
on 0.30.0, 0.31.0rc1 and 0.32.0rc1).
0.22's ``load_model(self, od_config, ...)`` is not recognized: skipped with a warning.

Remove when vllm-omni accepts plugin load formats (e.g. by asking vLLM's loader registry) and takes HSDP
sizes from the load config.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.doors.omni._patching import is_patched, mark, require_attr, require_params
from vllm_diffusion_plugin.engine.config import LOAD_FORMAT

logger = init_logger(__name__)

NAME = "load-format"
REQUIRED_BY_LOAD_FORMAT = True
TARGET = "vllm_omni.diffusion.model_loader.diffusers_loader"

PREPARE_PARAMS = ("self", "model_name_or_path", "subfolder", "revision", "fall_back_to_pt",
                  "allow_patterns_overrides")
LOAD_MODEL_PARAMS = ("self", "load_device", "load_format", "custom_pipeline_name", "device")


def apply(module: Any) -> str:
    where = f"{module.__name__}.DiffusersPipelineLoader"
    cls = require_attr(module, "DiffusersPipelineLoader", module.__name__)
    prepare = require_attr(cls, "_prepare_weights", where)
    load_model = require_attr(cls, "load_model", where)
    if is_patched(prepare) and is_patched(load_model):
        return "already applied"
    require_params(require_attr(cls, "__init__", where), ("self", "load_config", "od_config"), f"{where}.__init__")
    require_attr(cls, "_load_model_with_hsdp", where)
    prepare_sig = require_params(prepare, PREPARE_PARAMS, f"{where}._prepare_weights")
    require_params(load_model, LOAD_MODEL_PARAMS, f"{where}.load_model")
    if not is_patched(prepare):
        cls._prepare_weights = mark(_wrap_prepare_weights(prepare, prepare_sig), unit=NAME, original=prepare)
    if not is_patched(load_model):
        cls.load_model = mark(_wrap_load_model(load_model), unit=NAME, original=load_model)
    return "applied"


def uses_diffusion_hsdp(loader: Any) -> bool:
    """Whether ``loader``'s load config asks for our load format."""
    load_format = getattr(getattr(loader, "load_config", None), "load_format", None)
    return isinstance(load_format, str) and load_format.lower() == LOAD_FORMAT


def omni_load_options(loader: Any):
    """Our ``LoadOptions`` for ``loader``: from ``--additional-config diffusion_hsdp`` when the load format was
    carried there (``vllm serve --omni``), else from the load config's extra config (a ``LoadConfig`` built
    with our format directly); keys with no effect under vllm-omni are refused (``serve_options``)."""
    from vllm_diffusion_plugin.doors.omni import serve_options

    od_config = getattr(loader, "od_config", None)
    if serve_options.carried(od_config):
        return serve_options.omni_options(od_config.additional_config)
    raw = dict(getattr(loader.load_config, "model_loader_extra_config", None) or {})
    return serve_options.omni_options({serve_options.OPTIONS_KEY: raw}, origin="--model-loader-extra-config")


def with_load_format(load_config: Any, load_format: str) -> Any:
    """A copy of ``load_config`` with another load format."""
    if dataclasses.is_dataclass(load_config):
        return dataclasses.replace(load_config, load_format=load_format)
    clone = copy.copy(load_config)
    object.__setattr__(clone, "load_format", load_format)
    return clone


def _wrap_prepare_weights(original, signature):
    @functools.wraps(original)
    def _prepare_weights(self, *args, **kwargs):
        if not uses_diffusion_hsdp(self):
            return original(self, *args, **kwargs)
        options = omni_load_options(self)
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["fall_back_to_pt"] = bool(bound.arguments["fall_back_to_pt"]) and options.allow_pickle
        load_config = self.load_config
        self.load_config = with_load_format(load_config, "hf")  # vllm-omni's safetensors/hf code path
        try:
            folder, files, use_safetensors = original(*bound.args, **bound.kwargs)
        finally:
            self.load_config = load_config
        if not use_safetensors and not options.allow_pickle:
            raise ValueError(
                f"--load-format diffusion-hsdp found no safetensors weights for "
                f"{bound.arguments['model_name_or_path']} (subfolder {bound.arguments['subfolder']!r}), only "
                f"pickled files {sorted(map(str, files))[:4]}; convert them to safetensors or set "
                f"\"allow_pickle\": true in --additional-config diffusion_hsdp")
        logger.info("diffusion-hsdp (vllm-omni): %d %s weight file(s) in %s", len(files),
                    "safetensors" if use_safetensors else "pickled", folder)
        return folder, files, use_safetensors

    return _prepare_weights


def _wrap_load_model(original):
    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        if uses_diffusion_hsdp(self):
            self.parallel_config = hsdp_parallel_config(
                self.parallel_config, omni_load_options(self), world_size=_world_size())
        return original(self, *args, **kwargs)

    return load_model


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def hsdp_parallel_config(parallel_config: Any, options: Any, *, world_size: int) -> Any:
    """vllm-omni's parallel config with HSDP on (see the module docstring for where the sizes come from).

    Returns ``parallel_config`` itself when vllm-omni's own HSDP options are already on, or on one rank with
    no sizes given, else a copy made with ``dataclasses.replace`` (so vllm-omni's own validation runs on it)."""
    from vllm_diffusion_plugin.engine.session import HSDPConfig

    ours = HSDPConfig(replicate_size=options.hsdp_replicate_size, shard_size=options.hsdp_shard_size)
    given = (ours.replicate_size, ours.shard_size) != (HSDPConfig().replicate_size, HSDPConfig().shard_size)
    if getattr(parallel_config, "use_hsdp", False):
        omni = (parallel_config.hsdp_replicate_size, parallel_config.hsdp_shard_size)
        if given and _resolved(ours, world_size).mesh_shape != omni:
            raise ValueError(
                f"HSDP sizes disagree: vllm-omni's --use-hsdp options give replicate x shard = {omni[0]} x "
                f"{omni[1]}, our options (diffusion_hsdp) give hsdp_replicate_size={ours.replicate_size}, "
                f"hsdp_shard_size={ours.shard_size}; set them in one place")
        logger.info("diffusion-hsdp (vllm-omni): HSDP replicate x shard = %d x %d from vllm-omni's options",
                    *omni)
        return parallel_config
    if world_size == 1 and not given:
        return parallel_config  # one rank and no sizes anywhere: nothing to shard, vllm-omni's plain path
    replicate, shard = _resolved(ours, world_size).mesh_shape
    enabled = dataclasses.replace(parallel_config, use_hsdp=True, hsdp_replicate_size=replicate,
                                  hsdp_shard_size=shard)
    logger.info("diffusion-hsdp (vllm-omni): HSDP replicate x shard = %d x %d over %d ranks (our options)",
                replicate, shard, world_size)
    return enabled


def _resolved(config: Any, world_size: int) -> Any:
    try:
        return config.resolved(world_size)
    except ValueError as exc:
        raise ValueError(f"--load-format diffusion-hsdp under vllm-omni: {exc}. vllm-omni started {world_size} "
                         f"rank(s) from its own parallel options (e.g. --use-hsdp --hsdp-shard-size, "
                         f"--ulysses-degree); HSDP must span exactly those") from exc
