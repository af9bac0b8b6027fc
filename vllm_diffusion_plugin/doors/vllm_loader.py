"""The ``diffusion-hsdp`` vLLM model loader: vLLM's front door to the plugin's load path.

Registered by ``register()`` when the plugin is enabled; selected with
``vllm serve MODEL --load-format diffusion-hsdp --model-loader-extra-config '{...}'``.

``load_model`` is vLLM's template with the plugin's steps::

    build the model (vLLM's initialize_model) -> stream weights through model.load_weights (strict check)
      -> fuse LoRA (packed_modules_mapping) -> online-quant finalize + HSDP-aware post-processing
      -> shard with HSDP (only when the model declares shard conditions or hsdp_block_pattern is set) -> eval

Options are parsed (and rejected) in ``__init__``, before any weight is read.

``get_all_weights`` (vLLM 0.34's in-place weight reload: ``reload_weights`` streams it through
``model.load_weights`` and re-runs vLLM's post-load processing) yields the checkpoint's tensors, so a reload
gives the model of the first load. It refuses, before the model is touched, what a reload could not rebuild:
a load with ``lora_path`` (the stream carries base weights; the fused LoRA would be silently dropped) and an
HSDP-sharded model (vLLM's weight loaders copy full tensors into parameters).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig

from vllm_diffusion_plugin import compat
from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.checkpoint import ComponentSource, PickleRefusedError, resolve_checkpoint
from vllm_diffusion_plugin.engine.config import LoadOptions
from vllm_diffusion_plugin.engine.pipeline import LoraSpec

logger = init_logger(__name__)
PREFLIGHT_HOW = ('add "preflight": "warn" to --model-loader-extra-config (or set VLLM_DIFFUSION_PREFLIGHT=warn)')


class DiffusionHSDPLoader(compat.base_model_loader()):
    """Streams an HF / diffusers checkpoint folder into the model vLLM builds, through the plugin's steps."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = LoadOptions.from_extra_config(load_config.model_loader_extra_config)
        if self.options.hsdp_weight_load != "full":
            from vllm_diffusion_plugin.engine.strategies import StrategyError

            raise StrategyError(f"hsdp_weight_load={self.options.hsdp_weight_load!r} is not available in the vLLM "
                                f"loader (vLLM builds and loads its model on every rank); use 'full', or "
                                f"`vllm-diffusion load --hsdp-weight-load` for diffusers checkpoints")
        self.lora_specs = [LoraSpec.parse(text, default_scale=self.options.lora_scale)
                           for text in self.options.lora_path]
        for spec in self.lora_specs:
            if spec.component is not None:
                raise ValueError(f"lora_path entry {spec.component}={spec.path}: vLLM loads one model, "
                                 f"components cannot be named here")
            if not spec.path.exists():
                raise FileNotFoundError(f"lora_path {spec.path} does not exist")

    # ---- BaseModelLoader API --------------------------------------------------------------------------
    def download_model(self, model_config: ModelConfig) -> None:
        self._source(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Check the configured LoRA files against the model (before any read), stream the checkpoint through
        ``model.load_weights`` (vLLM's stacked-parameter mapping applies), check every parameter was loaded,
        then fuse the LoRA files. Onto an accelerator the bytes go through pinned staging (``pinned_staging_mb``)."""
        from vllm_diffusion_plugin.engine.weights import load_into_module

        from vllm_diffusion_plugin.engine import integrity
        from vllm_diffusion_plugin.engine.reader import bounded_reads

        source = self._source(model_config)
        stamps = integrity.stamp(source.files)  # a shard truncated or replaced from here on is named
        loras = self._prepare_loras(model, source=source) if self.lora_specs else None
        with integrity.unchanged(stamps, component=source.name), bounded_reads(self.options.read_timeout_s):
            result = load_into_module(model, source=source, strict_unexpected=self.options.strict_unexpected,
                                      threads=self.options.threads, staging=self._staging(model))
        logger.info("Loaded %d tensors (%.1f MB) from %s in %.2f s", len(result.loaded),
                    result.bytes_read / 1e6, source.folder, result.seconds)
        if loras is not None:
            self._fuse_loras(model, loras)

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Every checkpoint tensor by checkpoint name, for vLLM's in-place reload (vLLM 0.34+). Raises at the
        call, before the reload touches ``model``, when the reload would not give the loaded model back."""
        if self.lora_specs:
            raise NotImplementedError(
                f"load_format='diffusion-hsdp': in-place weight reload of a model loaded with lora_path "
                f"({', '.join(str(s.path) for s in self.lora_specs)}) is not supported: the reload streams the "
                f"base weights through model.load_weights and vLLM re-processes them, so the LoRA fused at load "
                f"would be dropped. Restart with the new weights instead, or fuse the LoRA into the checkpoint "
                f"(`vllm-diffusion load ... --save-fused DIR`) and load that without lora_path")
        sharded = [n for n, p in model.named_parameters() if hasattr(p, "full_tensor")]
        if sharded:
            raise NotImplementedError(
                f"load_format='diffusion-hsdp': in-place weight reload of an HSDP-sharded model is not supported "
                f"({len(sharded)} sharded parameters, e.g. {sharded[0]}): vLLM's weight loaders copy full "
                f"tensors into parameters. Restart with the new weights instead")
        from vllm_diffusion_plugin.engine.weights import iterate_weights

        return iterate_weights(self._source(model_config), threads=self.options.threads, staging=self._staging(model))

    def _staging(self, model: nn.Module):
        """``reader.DeviceStaging`` for the accelerator the model's parameters are on, or None (host, mixed)."""
        from vllm_diffusion_plugin.engine import platform
        from vllm_diffusion_plugin.engine.reader import DeviceStaging

        device = platform.accelerator_of([model])
        return None if device is None else DeviceStaging.open(device, max_bytes=self.options.pinned_staging_mb << 20,
                                                              threads=self.options.threads)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        from vllm.utils.torch_utils import set_default_torch_dtype

        from vllm_diffusion_plugin.engine.postprocess import process_weights_after_loading

        load_device = vllm_config.load_config.device or vllm_config.device_config.device
        target_device = torch.device(load_device)
        self._preflight(vllm_config, model_config, target_device)
        with set_default_torch_dtype(model_config.dtype), target_device:
            model = compat.initialize_model()(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        self.load_weights(model, model_config)
        retie = compat.maybe_retie_word_embeddings()
        if retie is not None:
            retie(model, model_config)
        process_weights_after_loading(model, target_device, model_config)
        self._maybe_shard(model, target_device)
        return model.eval()

    # ---- steps ------------------------------------------------------------------------------------------
    def _preflight(self, vllm_config: VllmConfig, model_config: ModelConfig, device: torch.device) -> None:
        """Before vLLM allocates the model (``engine.preflight``): the checkpoint's bytes at the model's dtype (its
        tensor-parallel share) and the LoRA files against what this node's host has left, for all its workers
        together, and against this worker's free accelerator memory. Every worker measures, then waits for the
        others (vLLM's world group), so that none counts another's model as taken."""
        if self.options.preflight == "off":
            return
        from vllm_diffusion_plugin.engine import platform, preflight

        parallel = vllm_config.parallel_config
        local = getattr(parallel, "local_world_size", None) or \
            max(1, parallel.world_size // max(1, getattr(parallel, "nnodes", 1)))
        plan = preflight.plan_module_load(
            self._source(model_config), dtype=model_config.dtype, device_type=device.type, ranks=local,
            lora_files=[(str(s.path), s.scale) for s in self.lora_specs],
            tensor_parallel=parallel.tensor_parallel_size, chunk_mb=self.options.lora_device_chunk_mb)
        host, free = preflight.host_available(), platform.free_memory(device)
        rank = dist.get_rank() if dist.is_initialized() else 0
        compat.world_barrier()
        preflight.enforce([preflight.check_host(plan, "full", host=host, strategies=("full",)),
                           preflight.check_device(plan, "full", rank=rank % local, free=free, strategies=("full",))],
                          mode=self.options.preflight, how=PREFLIGHT_HOW)

    def _source(self, model_config: ModelConfig) -> ComponentSource:
        try:
            sources = resolve_checkpoint(model_config.model, revision=model_config.revision,
                                         allow_pickle=self.options.allow_pickle)
        except PickleRefusedError as exc:
            raise exc.with_how('add "allow_pickle": true to --model-loader-extra-config (or set '
                               'VLLM_DIFFUSION_ALLOW_PICKLE=1)') from None
        if len(sources) != 1:
            raise ValueError(f"{model_config.model} resolves to {len(sources)} components "
                             f"({', '.join(s.name for s in sources)}); vLLM loads one model folder")
        return sources[0]

    def _prepare_loras(self, model: nn.Module, *, source: ComponentSource) -> list:
        """Every LoRA file read and checked against the model's shapes (nothing is touched): errors name the file,
        the component and the first offending keys before any checkpoint byte is read."""
        from vllm_diffusion_plugin.engine.lora import prepare_lora_files
        from vllm_diffusion_plugin.engine.prequant import quantization_config

        _check_lora_fusable(model, quantization_config(source))
        return prepare_lora_files(model, [(s.path, s.scale) for s in self.lora_specs],
                                  strict=self.options.lora_strict,
                                  packed_modules=getattr(model, "packed_modules_mapping", None),
                                  component=source.name)

    def _fuse_loras(self, model: nn.Module, loras: list) -> None:
        from vllm_diffusion_plugin.engine.lora import fuse_prepared

        stats = fuse_prepared(model, loras, chunk_mb=self.options.lora_device_chunk_mb,
                              check_finite=self.options.lora_check_finite,
                              host_weights=self.options.lora_host_weights)
        logger.info("Fused %d LoRA file(s) into %s: %d targets, compute device %s, %d fallback(s)",
                    len(self.lora_specs), type(model).__name__, stats.targets, stats.compute_device,
                    stats.fallbacks)

    def _maybe_shard(self, model: nn.Module, target_device: torch.device) -> None:
        from vllm_diffusion_plugin.engine.hsdp import HSDPConfig, apply_hsdp, build_mesh

        declared = getattr(model, "_hsdp_shard_conditions", None)
        if not declared and not self.options.hsdp_block_pattern:
            return
        if not dist.is_initialized():
            raise RuntimeError("HSDP was requested but torch.distributed is not initialized")
        config = HSDPConfig(replicate_size=self.options.hsdp_replicate_size,
                            shard_size=self.options.hsdp_shard_size)
        mesh = build_mesh(config, device_type=target_device.type)
        report = apply_hsdp(model, mesh=mesh, config=config, pattern=self.options.hsdp_block_pattern)
        logger.info("HSDP: sharded %d blocks of %s (%s); this rank holds %.1f MB of %.1f MB parameters",
                    len(report.blocks), type(model).__name__, report.source, report.local_bytes / 1e6,
                    report.total_bytes / 1e6)


def _check_lora_fusable(model: nn.Module,
                        checkpoint_quantization: tuple[dict | None, str] = (None, "")) -> None:
    """LoRA is fused into full, unquantized weights on one rank; refuse what would fuse wrongly.
    ``checkpoint_quantization``: ``prequant.quantization_config`` of the checkpoint (a pre-quantized one is named)."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    base = compat.quantize_method_base()
    # vLLM's plain layers carry Unquantized{Linear,Embedding,FusedMoE}Method; anything else quantizes. Layers
    # without a weight (an attention's KV-cache method) hold nothing a LoRA fuses into.
    quantized = [name for name, m in model.named_modules()
                 if isinstance(getattr(m, "quant_method", None), base) and "weight" in m._parameters
                 and not type(m.quant_method).__name__.startswith("Unquantized")]
    config, where = checkpoint_quantization
    if quantized and config is not None:
        method = str(config.get("quant_method") or config.get("quant_algo") or "?")
        raise ValueError(f"lora_path: the checkpoint is pre-quantized (quant_method {method!r}, {where}); fusing a "
                         f"LoRA into its quantized layers ({', '.join(quantized[:3])}, ...) is not supported by the "
                         f"vLLM loader: load the unquantized checkpoint with lora_path (a diffusers FP8 checkpoint "
                         f"takes a LoRA through `vllm-diffusion load`)")
    if quantized:
        raise ValueError(f"lora_path: fusing a LoRA into quantized layers ({', '.join(quantized[:3])}, ...) is "
                         f"not supported; load the unquantized checkpoint (online quantization quantizes "
                         f"weights as they load, before a LoRA could be fused)")
    tp = get_tensor_model_parallel_world_size()
    if tp > 1:
        raise ValueError(f"lora_path with tensor_parallel_size {tp} is not supported: the LoRA would be fused "
                         f"into each rank's slice of packed weights; use tensor_parallel_size 1 or HSDP")
