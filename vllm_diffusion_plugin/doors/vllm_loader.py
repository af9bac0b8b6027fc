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
from vllm_diffusion_plugin.engine.session import (
    ComponentSource,
    LoadOptions,
    LoadSession,
    LoraSpec,
    PickleRefusedError,
    StrategyError,
    accelerator_of,
    plan_module_load,
    process_weights_after_loading,
    quantization_config,
    resolve_checkpoint,
)

logger = init_logger(__name__)
PREFLIGHT_HOW = 'add "preflight": "warn" to --model-loader-extra-config (or set VLLM_DIFFUSION_PREFLIGHT=warn)'
PICKLE_HOW = 'add "allow_pickle": true to --model-loader-extra-config (or set VLLM_DIFFUSION_ALLOW_PICKLE=1)'


class DiffusionHSDPLoader(compat.base_model_loader()):
    """Streams an HF / diffusers checkpoint folder into the model vLLM builds, through a load session."""

    def __init__(self, load_config: LoadConfig):
        super().__init__(load_config)
        self.options = LoadOptions.from_extra_config(load_config.model_loader_extra_config)
        if self.options.hsdp_weight_load != "full":
            raise StrategyError(f"hsdp_weight_load={self.options.hsdp_weight_load!r} is not available in the vLLM "
                                f"loader (vLLM builds and loads its model on every rank); use 'full', or "
                                f"`vllm-diffusion load --hsdp-weight-load` for diffusers checkpoints")
        if self.options.lora_update_dirs:
            raise ValueError(f"lora_update_dirs ({', '.join(self.options.lora_update_dirs)}) is read by vllm serve "
                             f"--omni's API server (the runtime LoRA update); the vLLM loader has no such update: "
                             f"remove it (or unset VLLM_DIFFUSION_LORA_UPDATE_DIRS)")
        self.lora_specs = [LoraSpec.parse(text, default_scale=self.options.lora_scale)
                           for text in self.options.lora_path]
        for spec in self.lora_specs:
            if spec.component is not None:
                raise ValueError(f"lora_path entry {spec.component}={spec.path}: vLLM loads one model, "
                                 f"components cannot be named here")
            if not spec.path.exists():
                raise FileNotFoundError(f"lora_path {spec.path} does not exist")
        self._session: LoadSession | None = None

    # ---- BaseModelLoader API --------------------------------------------------------------------------
    def download_model(self, model_config: ModelConfig) -> None:
        self._source(self._new_session(model_config, torch.device("cpu")), model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Check the configured LoRA files against the model (before any read), stream the checkpoint through
        ``model.load_weights`` (vLLM's stacked-parameter mapping applies), check every parameter was loaded,
        then fuse the LoRA files. Onto an accelerator the bytes go through pinned staging (``pinned_staging_mb``)."""
        session = self._session or self._new_session(model_config, accelerator_of([model]) or torch.device("cpu"))
        source = self._source(session, model_config)
        entry = session.component(source)
        loras = self._prepare_loras(session, model, source) if self.lora_specs else None
        result = session.fill(model, source, entry=entry)
        logger.info("Loaded %d tensors (%.1f MB) from %s in %.2f s", len(result.loaded),
                    result.bytes_read / 1e6, source.folder, result.seconds)
        if loras is not None:
            stats = session.fuse(model, loras, entry=entry)
            logger.info("Fused %d LoRA file(s) into %s: %d targets, compute device %s, %d fallback(s)",
                        len(self.lora_specs), type(model).__name__, stats.targets, stats.compute_device,
                        stats.fallbacks)

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
        device = accelerator_of([model])
        session = self._new_session(model_config, device or torch.device("cpu"))
        return session.tensors(self._source(session, model_config), device=device)

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        from vllm.utils.torch_utils import set_default_torch_dtype

        load_device = vllm_config.load_config.device or vllm_config.device_config.device
        target_device = torch.device(load_device)
        session = self._session = self._new_session(model_config, target_device)
        session.mark_baseline()
        try:
            with session.report.phase("total"):  # the report's total_s and peak: the load from pre-flight to shard
                self._preflight(session, vllm_config, model_config, target_device)
                with set_default_torch_dtype(model_config.dtype), target_device:
                    model = compat.initialize_model()(vllm_config=vllm_config, model_config=model_config,
                                                      prefix=prefix)
                self.load_weights(model, model_config)
                retie = compat.maybe_retie_word_embeddings()
                if retie is not None:
                    retie(model, model_config)
                process_weights_after_loading(model, target_device, model_config)
                shard = session.shard(model, entry=session.report.components[-1])
            if shard is not None:
                logger.info("HSDP: sharded %d blocks of %s (%s); this rank holds %.1f MB of %.1f MB parameters",
                            len(shard.blocks), type(model).__name__, shard.source, shard.local_bytes / 1e6,
                            shard.total_bytes / 1e6)
            session.finish(log=logger)  # the load report line, as every door logs it
            return model.eval()
        finally:
            self._session = None

    # ---- steps ------------------------------------------------------------------------------------------
    def _new_session(self, model_config: ModelConfig, device: torch.device) -> LoadSession:
        dtype = getattr(model_config, "dtype", None) or torch.get_default_dtype()  # the report's; vLLM casts itself
        return LoadSession(self.options, device=device, dtype=dtype, lora_specs=self.lora_specs)

    def _preflight(self, session: LoadSession, vllm_config: VllmConfig, model_config: ModelConfig,
                   device: torch.device) -> None:
        """Before vLLM allocates the model (``engine.preflight``): the checkpoint's bytes at the model's dtype (its
        tensor-parallel share) and the LoRA files against what this node's host has left, for all its workers
        together, and against this worker's free accelerator memory. Every worker measures, then waits for the
        others (vLLM's world group), so that none counts another's model as taken."""
        if self.options.preflight == "off":
            return
        parallel = vllm_config.parallel_config
        local = getattr(parallel, "local_world_size", None) or \
            max(1, parallel.world_size // max(1, getattr(parallel, "nnodes", 1)))
        plan = plan_module_load(
            self._source(session, model_config), dtype=model_config.dtype, device_type=device.type, ranks=local,
            lora_files=[(str(s.path), s.scale) for s in self.lora_specs],
            tensor_parallel=parallel.tensor_parallel_size, chunk_mb=self.options.lora_device_chunk_mb)
        rank = dist.get_rank() if dist.is_initialized() else 0
        session.preflight(plan, strategy="full", how=PREFLIGHT_HOW, host=True, rank=rank % local,
                          before_verdict=compat.world_barrier, strategies=("full",))

    def _source(self, session: LoadSession, model_config: ModelConfig) -> ComponentSource:
        """vLLM's model folder, resolved (strict manifests) and taken into ``session``: its one component gets every
        LoRA file; its quantization is vLLM's own (the model vLLM built reads any checkpoint vLLM reads). Resolved
        once per session: the pre-flight's headers and stamps serve the load."""
        if session.sources:
            return next(iter(session.sources.values()))
        try:
            sources = resolve_checkpoint(model_config.model, revision=model_config.revision,
                                         allow_pickle=self.options.allow_pickle)
        except PickleRefusedError as exc:
            raise exc.with_how(PICKLE_HOW) from None
        if len(sources) != 1:
            raise ValueError(f"{model_config.model} resolves to {len(sources)} components "
                             f"({', '.join(s.name for s in sources)}); vLLM loads one model folder")
        session.adopt(sources, dits=[sources[0].name], our_quantization=False)
        return sources[0]

    def _prepare_loras(self, session: LoadSession, model: nn.Module, source: ComponentSource) -> list:
        """Every LoRA file read and checked against the model's shapes (nothing is touched): errors name the file,
        the component and the first offending keys before any checkpoint byte is read."""
        _check_lora_fusable(model, quantization_config(source))
        return session.prepare_loras(source, module=model,
                                     packed_modules=getattr(model, "packed_modules_mapping", None))


def _check_lora_fusable(model: nn.Module,
                        checkpoint_quantization: tuple[dict | None, str] = (None, "")) -> None:
    """LoRA is fused into full, unquantized weights on one rank; refuse what would fuse wrongly.
    ``checkpoint_quantization``: ``quant.checkpoints.quantization_config`` of the checkpoint (a pre-quantized one is
    named)."""
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
