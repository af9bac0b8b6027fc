"""HSDP for diffusion transformers: config, device mesh, which blocks to shard, ``fully_shard``, gather.

HSDP is FSDP2 over a 2-D ``(replicate, shard)`` device mesh: parameters are split across the S ranks of a
shard group and replicated across the R groups, so each rank holds about 1/S of every sharded block.

Which submodules become their own FSDP unit (one all-gather each during forward) is chosen, in order:

1. ``pattern`` — an explicit regex over module names (``re.fullmatch``), e.g. from extra-config;
2. ``conditions`` — explicit callables ``(name, module) -> bool`` passed by the caller;
3. ``attribute`` — the model's ``_hsdp_shard_conditions`` (the vllm-omni convention: a class attribute, a list
   of callables ``(name, module) -> bool``; a module is sharded when any of them returns True);
4. ``builtin`` — per diffusers DiT class (Wan ``blocks.N``, Flux ``transformer_blocks.N`` and
   ``single_transformer_blocks.N``, Qwen-Image ``transformer_blocks.N``, Z-Image ``layers.N``, ...);
5. ``generic`` — for an unknown DiT: the largest ``nn.ModuleList`` of same-class blocks (and any other such
   list at least a quarter its size; restricted to diffusers' ``_repeated_blocks`` classes when the model
   declares them), logged by name.

FSDP2 constraints handled here: 0-dim and integer/bool parameters cannot be sharded — they are passed as
``ignored_params`` (kept whole on every rank, moved to the mesh device by us); non-contiguous parameters
(fp8 ``.t()`` views) are made contiguous first; fp8 parameters disable the mixed-precision cast.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.io.staging import place_module
from vllm_diffusion_plugin.engine.postprocess import move_parameter

logger = init_logger(__name__)

ShardCondition = Callable[[str, nn.Module], bool]
"""``(module name, module) -> bool``: True when the module becomes its own FSDP unit."""

BUILTIN_BLOCK_PATTERNS: dict[str, str] = {
    "WanTransformer3DModel": r"blocks\.\d+",
    "WanVACETransformer3DModel": r"(vace_)?blocks\.\d+",
    "FluxTransformer2DModel": r"(single_)?transformer_blocks\.\d+",
    "Flux2Transformer2DModel": r"(single_)?transformer_blocks\.\d+",
    "QwenImageTransformer2DModel": r"transformer_blocks\.\d+",
    "ZImageTransformer2DModel": r"(layers|noise_refiner|context_refiner)\.\d+",
}
"""Block-name regexes (``re.fullmatch`` over ``named_modules()`` names) per diffusers DiT class name.
Subclasses inherit their base class's entry."""

_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                 "float8_e5m2fnuz") if hasattr(torch, n))
_GENERIC_MIN_FRACTION = 0.25


@dataclass(frozen=True)
class HSDPConfig:
    """The HSDP layout and FSDP2 policy.

    ``replicate_size`` (R) groups each hold a full copy of the model, split over ``shard_size`` (S) ranks;
    R x S must equal the world size. ``shard_size=-1`` means world size / R (see ``resolved``).
    ``param_dtype`` / ``reduce_dtype`` feed ``MixedPrecisionPolicy`` (None keeps the stored dtype; fp8
    parameters always keep theirs). ``reshard_after_forward`` frees the gathered block after its forward.
    Construction checks the values alone; ``resolved(world_size)`` checks them against the world — both
    before any weight is read.
    """

    replicate_size: int = 1
    shard_size: int = -1
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        for name in ("replicate_size", "shard_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"HSDPConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
        if self.replicate_size < 1:
            raise ValueError(f"HSDPConfig.replicate_size must be a positive integer, got {self.replicate_size}")
        if self.shard_size == 0 or self.shard_size < -1:
            raise ValueError(f"HSDPConfig.shard_size must be a positive integer or -1 (= world size / "
                             f"replicate_size), got {self.shard_size}")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"HSDPConfig.{name} must be a floating torch.dtype or None, got {value!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(f"HSDPConfig.reshard_after_forward must be a bool, "
                            f"got {self.reshard_after_forward!r}")

    def resolved(self, world_size: int) -> HSDPConfig:
        """This config with ``shard_size`` filled in for ``world_size``; raises if R x S != world size."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world size must be a positive integer, got {world_size!r}")
        r, s = self.replicate_size, self.shard_size
        if s == -1:
            if world_size % r:
                raise ValueError(f"world size {world_size} is not divisible by HSDP replicate_size {r}; "
                                 f"cannot derive shard_size (-1 = world size / replicate_size)")
            s = world_size // r
        if r * s != world_size:
            raise ValueError(f"HSDP replicate_size {r} x shard_size {s} = {r * s} does not equal the "
                             f"world size {world_size}")
        return replace(self, shard_size=s)

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(R, S)``; only meaningful on a resolved config."""
        if self.shard_size == -1:
            raise ValueError("HSDPConfig.mesh_shape needs a resolved config (call resolved(world_size))")
        return (self.replicate_size, self.shard_size)


def build_mesh(config: HSDPConfig, *, device_type: str) -> dist.device_mesh.DeviceMesh:
    """The ``(replicate, shard)`` device mesh over the default process group (must be initialized)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs torch.distributed initialized (the default process group)")
    resolved = config.resolved(dist.get_world_size())
    mesh = init_device_mesh(device_type, resolved.mesh_shape, mesh_dim_names=("replicate", "shard"))
    logger.info("HSDP mesh on %s: replicate=%d x shard=%d (world %d)", device_type,
                *resolved.mesh_shape, dist.get_world_size())
    return mesh


@dataclass(frozen=True)
class BlockSelection:
    """Which modules get their own ``fully_shard`` and how they were chosen."""

    source: str
    """One of ``pattern``, ``conditions``, ``attribute``, ``builtin``, ``generic``."""
    names: tuple[str, ...]
    detail: str = ""
    """The pattern, the condition names, or the ModuleList(s) the generic rule chose."""


def select_blocks(model: nn.Module, *, pattern: str | None = None,
                  conditions: Sequence[ShardCondition] | None = None) -> BlockSelection:
    """Choose the blocks to shard (see the module docstring for the order). Raises when an explicit
    pattern, explicit conditions or the model's own conditions match no module."""
    named = [(n, m) for n, m in model.named_modules() if n]
    cls_name = type(model).__name__
    if pattern is not None:
        regex = _compile(pattern)
        names = tuple(n for n, _ in named if regex.fullmatch(n))
        if not names:
            raise ValueError(f"HSDP block pattern {pattern!r} matches no module of {cls_name}; module names "
                             f"look like: {', '.join(n for n, _ in named[:8])}")
        return BlockSelection("pattern", names, pattern)
    for source, conds in (("conditions", conditions),
                          ("attribute", getattr(model, "_hsdp_shard_conditions", None))):
        if not conds:
            continue
        conds = list(conds)
        bad = [c for c in conds if not callable(c)]
        if bad:
            raise TypeError(f"HSDP shard conditions ({source}) of {cls_name} must be callables "
                            f"(name, module) -> bool; got {bad!r}")
        names = tuple(n for n, m in named if any(c(n, m) for c in conds))
        detail = ", ".join(getattr(c, "__qualname__", repr(c)) for c in conds)
        if not names:
            raise ValueError(f"HSDP shard conditions ({source}: {detail}) of {cls_name} match no module")
        return BlockSelection(source, names, detail)
    for klass in type(model).__mro__:
        if klass.__name__ in BUILTIN_BLOCK_PATTERNS:
            regex = re.compile(BUILTIN_BLOCK_PATTERNS[klass.__name__])
            names = tuple(n for n, _ in named if regex.fullmatch(n))
            if names:
                return BlockSelection("builtin", names, f"{klass.__name__}: {regex.pattern}")
            logger.warning("Built-in HSDP blocks %r for %s match no module of %s; using the generic rule.",
                           regex.pattern, klass.__name__, cls_name)
            break
    return _generic_blocks(model, named)


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"HSDP block pattern {pattern!r} is not a valid regex: {exc}") from None


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _generic_blocks(model: nn.Module, named: list[tuple[str, nn.Module]]) -> BlockSelection:
    """The largest ModuleList whose children are >= 2 blocks of one class holding parameters, plus any other
    such list (not nested in a chosen one) with at least a quarter of its parameters. When the model names
    its block classes in ``_repeated_blocks`` (most diffusers DiTs do), only lists of those classes count."""
    candidates = []
    for name, module in named:
        children = list(module.children()) if isinstance(module, nn.ModuleList) else []
        if len(children) >= 2 and len({type(c) for c in children}) == 1 and _numel(children[0]) > 0:
            candidates.append((_numel(module), name, type(children[0]).__name__, len(children)))
    declared = set(getattr(model, "_repeated_blocks", None) or ())  # diffusers' regional-compile hint
    if declared and any(c[2] in declared for c in candidates):
        candidates = [c for c in candidates if c[2] in declared]
    if not candidates:
        logger.warning("No repeated blocks found in %s; HSDP shards the root module only (its forward "
                       "gathers all parameters at once).", type(model).__name__)
        return BlockSelection("generic", (), "no ModuleList of repeated blocks")
    candidates.sort(key=lambda c: (-c[0], c[1]))
    largest = candidates[0][0]
    chosen: list[tuple[int, str, str, int]] = []
    for cand in candidates:
        nested = any(cand[1].startswith(c[1] + ".") or c[1].startswith(cand[1] + ".") for c in chosen)
        if cand[0] >= _GENERIC_MIN_FRACTION * largest and not nested:
            chosen.append(cand)
    chosen.sort(key=lambda c: c[1])
    names = tuple(f"{name}.{i}" for _, name, _, count in chosen for i in range(count))
    detail = "; ".join(f"{name} ({count} x {klass}, {numel} params)" for numel, name, klass, count in chosen)
    logger.info("HSDP: %s has no built-in block rule; the generic rule chose %s (runners-up: %s).",
                type(model).__name__, detail,
                ", ".join(c[1] for c in candidates if c not in chosen)[:200] or "none")
    return BlockSelection("generic", names, detail)


@dataclass(frozen=True)
class ShardReport:
    """What ``apply_hsdp`` did on this rank."""

    source: str
    """How the blocks were chosen: pattern, conditions, attribute, builtin or generic."""
    blocks: tuple[str, ...]
    detail: str
    mesh_shape: tuple[int, ...]
    rank: int
    param_dtype: torch.dtype | None
    """The all-gather dtype FSDP uses (None: each parameter's stored dtype, forced when fp8 is present)."""
    replicated_params: tuple[str, ...]
    """0-dim / integer parameters kept whole on every rank (FSDP2 ``ignored_params``)."""
    made_contiguous: tuple[str, ...]
    local_bytes: int
    """Parameter bytes this rank holds after sharding (all parameters)."""
    total_bytes: int
    """Parameter bytes of the unsharded model."""
    block_local_bytes: int
    block_total_bytes: int

    @property
    def block_fraction(self) -> float:
        """The share of the sharded blocks' parameters this rank holds (about 1/S)."""
        return self.block_local_bytes / self.block_total_bytes if self.block_total_bytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "blocks": len(self.blocks), "detail": self.detail,
                "mesh_shape": list(self.mesh_shape), "rank": self.rank,
                "param_dtype": str(self.param_dtype) if self.param_dtype else None,
                "replicated_params": list(self.replicated_params),
                "made_contiguous": list(self.made_contiguous), "local_bytes": self.local_bytes,
                "total_bytes": self.total_bytes, "block_local_bytes": self.block_local_bytes,
                "block_total_bytes": self.block_total_bytes, "block_fraction": round(self.block_fraction, 4)}


def _mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    return torch.device(mesh.device_type, index)


def unshardable(param: torch.Tensor) -> bool:
    """Whether FSDP2 leaves ``param`` whole on every rank (0-dim or not floating point: replicated)."""
    return param.ndim == 0 or not (param.is_floating_point() or param.is_complex())


def _prepare_params(model: nn.Module, device: torch.device,
                    allow_meta: bool = False) -> tuple[dict[nn.Parameter, str], list[str]]:
    """Make non-contiguous parameters contiguous; move unshardable ones to ``device`` (FSDP does not move
    ignored parameters; with ``allow_meta`` meta ones stay for the caller's ``to_empty``). Returns
    {unshardable parameter: name} and the names made contiguous."""
    ignored: dict[nn.Parameter, str] = {}
    made_contiguous: list[str] = []
    seen: set[int] = set()
    for owner_name, owner in model.named_modules():
        for pname, param in list(owner._parameters.items()):
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{owner_name}.{pname}" if owner_name else pname
            if isinstance(param, _dtensor_type()):
                raise ValueError(f"Parameter {name} is already a DTensor ({param.placements}); apply_hsdp "
                                 f"expects an unsharded model")
            if param.is_meta and not allow_meta:
                raise ValueError(f"Parameter {name} {tuple(param.shape)} is still on the meta device; finalize "
                                 f"online quantization (postprocess.process_weights_after_loading) before HSDP")
            if unshardable(param):
                if param.device != device and not param.is_meta:
                    move_parameter(owner, pname, device)
                ignored[owner._parameters[pname]] = name
            elif not param.is_contiguous():
                logger.debug("Making %s contiguous for FSDP2 (shape %s, stride %s, %s).", name,
                             tuple(param.shape), param.stride(), param.dtype)
                param.data = param.data.contiguous()
                made_contiguous.append(name)
    return ignored, made_contiguous


def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor
    return DTensor


def _param_bytes(params) -> tuple[int, int]:
    dtensor, local, total = _dtensor_type(), 0, 0
    for p in params:
        size = p.element_size()
        total += p.numel() * size
        local += (p.to_local().numel() if isinstance(p, dtensor) else p.numel()) * size
    return local, total


def _resolved_on(mesh, config: HSDPConfig) -> HSDPConfig:
    """``config`` resolved for ``mesh``'s size, or ValueError when the mesh's shape is not its ``(R, S)``."""
    config = config.resolved(mesh.size())
    expected = config.mesh_shape if mesh.ndim == 2 or config.replicate_size > 1 else (config.shard_size,)
    if tuple(mesh.shape) != expected:
        raise ValueError(f"HSDP mesh shape {tuple(mesh.shape)} does not match replicate_size x shard_size "
                         f"{config.mesh_shape}")
    return config


def _all_gather_dtype(model: nn.Module, config: HSDPConfig) -> torch.dtype | None:
    """The dtype FSDP2 all-gathers in: ``config.param_dtype``, or each parameter's stored one with fp8 present."""
    has_fp8 = any(p.dtype in _FP8_DTYPES for p in model.parameters())
    if has_fp8 and config.param_dtype is not None:
        logger.info("fp8 parameters present: FSDP all-gathers stored dtypes (param_dtype %s not applied).",
                    config.param_dtype)
    return None if has_fp8 else config.param_dtype


def apply_hsdp(model: nn.Module, *, mesh, config: HSDPConfig, conditions: Sequence[ShardCondition] | None = None,
               pattern: str | None = None, allow_meta: bool = False, staging: Any = None,
               threads: int = 1) -> ShardReport:
    """Shard ``model`` in place with FSDP2 over ``mesh``: each chosen block bottom-up, then the root.

    Run after LoRA fusion and post-load processing (FSDP2 wants plain, contiguous, materialized tensors).
    ``allow_meta``: accept a skeleton on ``meta`` (the rank-local load: shard first, then ``to_empty`` allocates
    only the local shards and each rank reads its own rows; see ``strategies.rank_local``). ``staging``
    (``staging.DeviceStaging``): a host-resident block crosses to the mesh's accelerator through it just before
    FSDP2 shards it (FSDP2's own move is a pageable copy), one block at a time as FSDP2 would.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if isinstance(model, FSDPModule):
        raise ValueError(f"{type(model).__name__} is already sharded with FSDP2")
    config = _resolved_on(mesh, config)
    selection = select_blocks(model, pattern=pattern, conditions=conditions)
    device = _mesh_device(mesh)
    ignored, made_contiguous = _prepare_params(model, device, allow_meta)
    if made_contiguous:
        logger.info("Made %d non-contiguous parameters contiguous for FSDP2 (e.g. %s).",
                    len(made_contiguous), ", ".join(made_contiguous[:3]))
    param_dtype = _all_gather_dtype(model, config)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": config.reshard_after_forward,
                              "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype,
                                                                reduce_dtype=config.reduce_dtype)}
    modules = dict(model.named_modules())
    order = {name: i for i, name in enumerate(modules)}
    block_param_names = {f"{name}.{pname}" for name in selection.names
                         for pname, p in modules[name].named_parameters() if p not in ignored}
    # Deepest first (reverse of named_modules' pre-order), so nested units are wrapped before their parents.
    for name in sorted(selection.names, key=order.__getitem__, reverse=True):
        block = modules[name]
        own_ignored = set(ignored).intersection(block.parameters())
        if staging is not None:
            place_module(block, device, staging, threads=threads)
        fully_shard(block, **kwargs, ignored_params=own_ignored or None)
    if staging is not None:
        place_module(model, device, staging, threads=threads)
    fully_shard(model, **kwargs, ignored_params=set(ignored) or None)

    rank = dist.get_rank() if dist.is_initialized() else 0
    named_params = list(model.named_parameters())  # FSDP2 swapped in DTensor parameters; shared ones once
    local, total = _param_bytes(p for _, p in named_params)
    block_local, block_total = _param_bytes(p for n, p in named_params if n in block_param_names)
    report = ShardReport(source=selection.source, blocks=selection.names, detail=selection.detail,
                         mesh_shape=tuple(mesh.shape), rank=rank, param_dtype=param_dtype,
                         replicated_params=tuple(ignored.values()), made_contiguous=tuple(made_contiguous),
                         local_bytes=local, total_bytes=total, block_local_bytes=block_local,
                         block_total_bytes=block_total)
    logger.info("HSDP applied to %s on rank %d: %d blocks (%s: %s) + root; mesh %s; local parameters %.1f MiB "
                "of %.1f MiB (blocks %.3f); %d replicated.", type(model).__name__, rank, len(selection.names),
                selection.source, selection.detail[:120], tuple(mesh.shape), local / 2**20, total / 2**20,
                report.block_fraction, len(ignored))
    return report


