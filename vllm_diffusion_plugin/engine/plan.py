"""What a load will read and hold on each rank, from the shard headers and ``meta`` skeletons alone.

``plan_load`` resolves the checkpoint (headers only, ``checkpoint.resolve_checkpoint``), builds every component's
skeleton on ``meta`` (``skeleton.build_component``), checks the LoRA files against it (``lora.prepare_lora_files``)
and models, per rank and per component, each ``hsdp_weight_load`` strategy as the engine runs it -- the CLI path
(``session.load_components``), where a diffusers DiT binds each checkpoint key to its own parameter. Under
vllm-omni (``doors/omni/rank_local.py``) stacked q/k/v are three row bindings into one parameter: the rows a rank
reads can differ from what is planned here for those parameters; the totals of the other tensors are the same.

- bytes read: ``full`` every tensor a component's module takes, on every rank; ``broadcast`` the same on rank 0,
  nothing elsewhere; ``rank_local`` this rank's rows of each sharded DiT parameter (``rank_local.shard_rows``, the
  split the load itself uses), whole tensors for what FSDP2 replicates (``hsdp.unshardable``) and for buffers, and
  every other component whole.
- host memory our load adds (device ``cpu``), phase by phase as the load runs. LoRA: the files as read beside
  their normalized factors while preparing, then the factors and one delta chunk (``lora_device_chunk_mb``; under
  ``rank_local`` a chunk of this rank's rows). ``full`` holds each component whole (viewing its files' mappings
  where dtypes match; a cast tensor is a copy beside its mapped file bytes) plus the LoRA, then, while FSDP2
  shards it unit by unit, the local shards it copies out until a file's last tensor is sharded and the file's
  pages go. ``broadcast`` holds it whole plus the staging bucket (``hsdp_broadcast_bucket_mb``; rank 0 also
  maps the file it reads and fuses the LoRA) while streaming; the bucket released, each full tensor is freed as
  its unit is sharded. ``rank_local`` holds the local shards plus the LoRA. Components load one after the
  other. ``first_run_peak``: the held bytes plus what FSDP2's all-gathers add during a DiT's forward
  (:func:`first_run_gather`). Measured against
  ``load --json`` (peak RSS minus ``baseline_rss_bytes``, taken after the model classes are imported):
  ``docs/plan-and-memory.md``.
- the library code a CPU load pages in after its imports (:data:`LOAD_CODE_BYTES`): in ``host_peak``, not in
  ``host_private_peak`` (clean file pages). Online quantization: ``quant.plan``.
- accelerator memory (device not ``cpu``): the local shards plus the LoRA chunk; the first run's peak beside it.

The result types and the fit logic: ``plan_result`` (re-exported here).

Reads no weight byte. Pure functions; no door imports.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_diffusion_plugin.engine.hsdp import select_blocks, unshardable
from vllm_diffusion_plugin.engine.io.checkpoint import is_transformer, resolve_checkpoint
from vllm_diffusion_plugin.engine.io.headers import read_safetensors_header
from vllm_diffusion_plugin.engine.io.rows import shard_rows
from vllm_diffusion_plugin.engine.lora import prepare_lora_files
from vllm_diffusion_plugin.engine.lora.specs import assign_loras
from vllm_diffusion_plugin.engine.plan_result import STRATEGY_ORDER, ComponentPlan, Plan, RankPlan
from vllm_diffusion_plugin.engine.quant.fp8 import FP8
from vllm_diffusion_plugin.engine.quant.fuse import fuse_transient_bytes
from vllm_diffusion_plugin.engine.quant.online import find_layers
from vllm_diffusion_plugin.engine.quant.plan import quantized_bytes, quantized_layers, whole_bytes, whole_layers
from vllm_diffusion_plugin.engine.quant.whole import find_whole_layers
from vllm_diffusion_plugin.engine.skeleton import build_component
from vllm_diffusion_plugin.engine.strategies import StrategyError, check_strategy

MIB = 2**20
LOAD_CODE_BYTES = 24 * MIB
"""Library code a load pages in on the host after its imports (``baseline_rss_bytes``): the code of FSDP2's sharding,
the LoRA GEMMs and the quantization in ``libtorch_cpu`` / ``libtorch_python`` / safetensors, first run by the load.
Measured per rank from ``/proc/self/smaps`` at 2 gloo ranks of ``test_plan``'s 350 MB DiT: 23.7 MiB (bf16
``rank_local`` with a LoRA), 25.6 MiB (the same with online fp8). Clean file pages, shared by a node's ranks and
dropped under pressure: in ``host_peak`` (RSS), not in ``host_private_peak``. Planned for CPU loads (an
accelerator's own libraries page in more, not measured here)."""


@dataclass(frozen=True)
class _Shape:
    """What the plan needs of one component: per tensor (checkpoint bytes, final bytes, rows, sharded), and for
    the order ``full``'s sharding frees its files in, per tensor (file index, FSDP unit index)."""

    name: str
    is_dit: bool
    tensors: dict[str, tuple[int, int, int, bool]]
    order: dict[str, tuple[int, int]]
    """Tensor -> (its file's index, the step of ``hsdp.apply_hsdp`` that shards it: blocks deepest first, root last)."""
    blocks: tuple[int, ...]
    """Bytes (final dtypes) of each FSDP block's parameters, in forward (module) order."""
    root: int
    """Bytes (final dtypes) of the parameters FSDP2's root unit gathers: the DiT's less its blocks'."""
    lora_bytes: int
    """The normalized LoRA factors (held while fusing)."""
    lora_file_bytes: int
    """The LoRA files as read (held beside the normalized factors while they are prepared)."""
    lora_largest: int
    """Bytes of the largest ``B @ A`` delta (final dtype), bounded by the LoRA chunk."""
    lora_targets: int
    """Bytes (final dtypes) of the weights the LoRA fuses into: private copies where they viewed a mapping."""
    largest_file: int
    """The largest checkpoint file's tensor bytes: what a reader's mapping of one file holds at most."""
    quantized: dict[str, tuple[int, int, int, bool, int]] = field(default_factory=dict)
    """Online-quantized weight -> (quantized bytes, its scale's bytes, its FSDP block's index, per-tensor scale,
    elements): the load reads it in the load dtype (``tensors``) and holds it quantized (``quant_shards``;
    ``quant.plan``)."""
    fp8_fuse: int = 0
    """Elements of the largest pre-quantized FP8 weight a LoRA fuses into (``quant.fuse.fuse_transient_bytes``)."""
    whole: dict[str, tuple] = field(default_factory=dict)
    """Online-quantized layers without the row protocol, gathered whole under ``rank_local`` (``quant.plan``)."""


def _component_shape(source, *, is_dit: bool, dtype: torch.dtype, lora_files: Sequence[tuple[str, float]],
                     options, lora_headers_only: bool = False, quantization=None) -> _Shape:

    module = build_component(source, dtype=dtype, device="meta")
    if is_dit and quantization is not None:
        quantization(module)
    online = is_dit and quantization is not None
    layers = find_layers(module, others="skip") if online else []
    whole = find_whole_layers(module) if online else []
    params = dict(module.named_parameters())
    targets = module.state_dict(keep_vars=True)
    tensors = {}
    for key, info in source.tensors.items():
        if key in targets:
            t = targets[key]
            tensors[key] = (info.nbytes, t.numel() * t.element_size(), t.shape[0] if t.dim() else 0,
                            key in params and not unshardable(t))
    blocks: tuple[int, ...] = ()
    names: Sequence[str] = ()
    files = {key: i for i, f in enumerate(source.files) for key in source.keys_in(f)}
    order = {key: (files[key], 0) for key in tensors}
    if is_dit:
        modules = dict(module.named_modules())
        names = select_blocks(module, pattern=options.hsdp_block_pattern).names
        position = {name: i for i, name in enumerate(modules)}
        blocks = tuple(sum(p.numel() * p.element_size() for p in modules[n].parameters())
                       for n in sorted(names, key=position.__getitem__))
        steps = sorted(names, key=position.__getitem__, reverse=True)  # apply_hsdp's order, the root after them
        for key in tensors:
            step = next((i for i, n in enumerate(steps) if key.startswith(f"{n}.")), len(steps))
            order[key] = (files[key], step)
    quantized = quantized_layers(layers, names)
    lora_bytes = largest = targets = fp8_fuse = 0
    lora_file_bytes = sum(os.path.getsize(path) for path, _ in lora_files)
    largest_file = max((sum(source.tensors[k].nbytes for k in source.keys_in(f)) for f in source.files), default=0)
    if lora_headers_only and all(str(path).endswith(".safetensors") for path, _ in lora_files):
        # the factors as their headers list them; every 2-D weight a possible target (an upper bound)

        lora_bytes = sum(t.nbytes for path, _ in lora_files for t in read_safetensors_header(Path(path)).values())
        weights = [p.numel() * p.element_size() for p in params.values() if p.dim() == 2] if lora_files else []
        largest, targets, lora_files = max(weights, default=0), sum(weights), ()
    for lora in prepare_lora_files(module, lora_files, strict=options.lora_strict, component=source.name):
        for name, delta in lora.deltas.items():
            parts = [delta.A, delta.B, delta.bias_delta, delta.full_delta]
            lora_bytes += sum(p.numel() * p.element_size() for p in parts if p is not None)
            weight = params.get(f"{name}.weight", params.get(name))
            if weight is not None and weight.dtype == FP8:  # a pre-quantized layer: dequantized, fused, requantized
                fp8_fuse = max(fp8_fuse, weight.numel())
            elif weight is not None:
                largest = max(largest, weight.numel() * weight.element_size())
            if weight is not None:
                targets += weight.numel() * weight.element_size()
    root = sum(p.numel() * p.element_size() for p in params.values()) - sum(blocks) if blocks else 0
    return _Shape(source.name, is_dit, tensors, order, blocks, root, lora_bytes, lora_file_bytes, largest, targets,
                  largest_file, quantized, fp8_fuse, whole_layers(whole, names))


def first_run_gather(shape: _Shape) -> int:
    """What FSDP2 adds to a rank during one forward of a sharded DiT, above its local shards: the root's unsharded
    parameters for the whole forward, and while a block is gathered, its all-gather output and its unsharded
    parameters beside the previous unit's all-gather output, which FSDP2 keeps until the next all-gather has been
    copied out (``comm_ctx.all_gather_state``). Measured on 2 gloo ranks, a Wan DiT at A14B width (root 0.43 GiB,
    blocks 0.66 GiB): 2.62 GiB above the shards at the peak, this 2.40 GiB plus 0.2 GiB of activations at the
    warm-up's 512 x 512; activations are not modelled (they scale with the request, not the load)."""
    previous, peak = shape.root, 2 * shape.root  # the root's all-gather output, then each block's
    for block in shape.blocks:
        peak, previous = max(peak, shape.root + previous + 2 * block), block
    return peak if shape.blocks else 0


def _shard_peak(shape: _Shape, local_of: dict[str, int], *, maps_files: bool) -> int:
    """What a load holds above the whole component while FSDP2 shards it, step by step: each step copies out
    its tensors' local shards and drops their full tensors. ``maps_files`` (``full``): a tensor viewing its
    file's mapping (same dtype) frees nothing until every such tensor of that file is dropped, then the whole
    file's pages go; otherwise (``broadcast``, casts) each full tensor is freed at its step."""
    mapped: dict[int, int] = {}
    pending: dict[int, int] = {}
    for key, (ckpt, final, _, _) in shape.tensors.items():
        if maps_files and ckpt == final:
            file = shape.order[key][0]
            mapped[file] = mapped.get(file, 0) + ckpt
            pending[file] = pending.get(file, 0) + 1
    above = peak = 0
    for key in sorted(shape.order, key=lambda k: shape.order[k][1]):  # step by step (stable within a step)
        ckpt, final, _, _ = shape.tensors[key]
        above += local_of[key]
        if not maps_files or ckpt != final:
            above -= final
        else:
            file = shape.order[key][0]
            pending[file] -= 1
            if not pending[file]:
                above -= mapped[file]
        peak = max(peak, above)
    return peak


def _private_shard_peak(shape: _Shape, local_of: dict[str, int]) -> int:
    """``_shard_peak`` of ``full`` in private memory: the local shards copied out, less each cast copy dropped at
    its step (a tensor viewing its file's mapping frees file pages only)."""
    above = peak = 0
    for key in sorted(shape.order, key=lambda k: shape.order[k][1]):
        ckpt, final, _, _ = shape.tensors[key]
        above += local_of[key] - (final if ckpt != final else 0)
        peak = max(peak, above)
    return peak


def _component_plan(shape: _Shape, *, runs: str, rank: int, shard_size: int, sharded: bool,
                    options, on_device: bool) -> tuple[ComponentPlan, int, int, int, int, int]:
    """(plan, host peak, device peak, private host peak, private host bytes held after it, file pages its module
    keeps viewing) of one component on ``rank``; private: not clean file pages (``RankPlan.host_private_peak``)."""

    index = rank % shard_size
    rank_local = runs == "rank_local" and sharded
    whole_read = sum(c for c, _, _, _ in shape.tensors.values())
    whole = sum(f for _, f, _, _ in shape.tensors.values())
    local_read, local_of = 0, {}
    for key, (ckpt, final, rows, shard) in shape.tensors.items():
        if sharded and shard and rows:
            start, stop = shard_rows(rows, size=shard_size, index=index)
            local_read += ckpt // rows * (stop - start)
            local_of[key] = final // rows * (stop - start)
        else:
            local_read, local_of[key] = local_read + ckpt, final
    local = sum(local_of.values())
    # online quantization: held quantized (+ scales); rank_local reads a block's rows into load-dtype transients,
    # full / broadcast hold the whole load-dtype tensor while its quantized copy is made
    held_q, quant_rows, quant_whole = quantized_bytes(shape.quantized, shape.tensors, local_of, sharded=sharded,
                                                      rank_local=rank_local)
    held_w, whole_rows, whole_largest = whole_bytes(shape.whole, local_of, shard=(shard_size, index) if sharded
                                                    else None, rank_local=rank_local)
    held_q, quant_rows, quant_whole = held_q + held_w, max(quant_rows, whole_rows), max(quant_whole, whole_largest)
    if runs == "broadcast":
        bytes_read = whole_read if rank == 0 else 0
    else:
        bytes_read = local_read if rank_local else whole_read
    held = (local if sharded else whole) - held_q
    largest = -(-shape.lora_largest // shard_size) if rank_local else shape.lora_largest  # rank_local: its rows
    chunk = min(options.lora_device_chunk_mb * MIB, largest) if shape.lora_bytes else 0
    if shape.lora_bytes and shape.fp8_fuse:  # one FP8 layer's (local) rows at a time
        chunk = max(chunk, fuse_transient_bytes(-(-shape.fp8_fuse // shard_size) if rank_local else shape.fp8_fuse))
    fuses = shape.lora_bytes and (runs != "broadcast" or rank == 0 or rank_local)
    # the LoRA files beside their normalized factors while preparing, then the factors and one delta chunk
    lora = max(shape.lora_file_bytes + shape.lora_bytes, shape.lora_bytes + chunk) if fuses else 0
    bucket = min(options.hsdp_broadcast_bucket_mb * MIB, whole) if runs == "broadcast" else 0
    transients = {"lora_device_chunk_mb": chunk if fuses else 0, "hsdp_broadcast_bucket_mb": bucket,
                  "quantization": quant_rows if rank_local else quant_whole}
    transient = max(transients, key=transients.get)
    copies_shards = sharded and not on_device  # FSDP2's local copies beside the whole component, on the host
    device = held + (chunk if fuses else 0) + (quant_rows if rank_local else 0)
    held_private, held_mapped = (0 if on_device else held), 0
    if rank_local:
        host = private = (0 if on_device else held + quant_rows) + lora
    elif runs == "broadcast":  # the staging bucket while streaming (rank 0 also maps the file it reads and
        # fuses), then, the bucket released, the local shards copied out of the whole component
        host = whole + max(bucket + (shape.largest_file + lora if rank == 0 else 0),
                           _shard_peak(shape, local_of, maps_files=False) if copies_shards else 0)
        private = whole + max(bucket + (lora if rank == 0 else 0),
                              _shard_peak(shape, local_of, maps_files=False) if copies_shards else 0)
    else:  # full: the whole component, viewing its files' mappings where the dtypes match (a cast tensor is a copy,
        # its file pages stay mapped beside it), fused; then its local shards copied out of it
        cast = sum(c for c, f, _, _ in shape.tensors.values() if c != f)
        host = whole + cast + max(lora, _shard_peak(shape, local_of, maps_files=True) if copies_shards else 0)
        # private: the cast copies and the fused weights (copy-on-write), not the clean mapped pages
        mapped = sum(c for c, f, _, _ in shape.tensors.values() if c == f)
        fused = min(shape.lora_targets, mapped) if fuses else 0
        private = min(host, whole - mapped + fused +  # the fused pages' frees at their file's unmap not modelled
                      max(lora, _private_shard_peak(shape, local_of) if copies_shards else 0))
        if not sharded and not on_device:  # the module keeps viewing its files
            held_private, held_mapped = whole - mapped + fused, mapped - fused
    if not rank_local:
        host, private = host + quant_whole, private + quant_whole
    ring = options.pinned_staging_mb * MIB if on_device else 0  # staging.DeviceStaging's page-locked buffers
    if ring and runs != "broadcast" and not sharded:  # built on the device, filled from the ring: no host copy
        host = private = lora
    host, private = host + ring, private + ring
    plan = ComponentPlan(shape.name, bytes_read, held, device if on_device else host, transient,
                         transients[transient])
    return plan, host, device, private, held_private, held_mapped


def plan_load(checkpoint: str, *, options, components: Sequence[str] | None = None, lora_specs: Sequence = (),
              world_size: int = 1, hsdp=None, dtype: torch.dtype = torch.bfloat16, device_type: str = "cpu",
              host_memory: int | None = None, device_memory: int | None = None,
              local_world_size: int | None = None, lora_headers_only: bool = False, quantization=None) -> Plan:
    """Plan a load of ``checkpoint`` over ``world_size`` ranks (``hsdp``: an ``HSDPConfig`` when > 1) for every
    strategy; ``lora_specs``: ``lora.specs.LoraSpec`` (their files are read, checked against the skeletons);
    ``local_world_size``: ranks per node (None: all on one); ``lora_headers_only``: the LoRA figures from the
    files' safetensors headers, not read and checked (the pre-flight: the ranks check them); ``quantization``: the
    hook ``session.load_components`` takes (applied to the DiTs' meta skeletons)."""

    sources = resolve_checkpoint(checkpoint, components=components, allow_pickle=options.allow_pickle)
    transformers = [s.name for s in sources if is_transformer(s)]
    loras = assign_loras(lora_specs, transformers) if lora_specs else {}
    shard_size, layout = 1, None
    if world_size > 1:
        resolved = hsdp.resolved(world_size)
        shard_size, layout = resolved.shard_size, resolved.mesh_shape
    shapes = [_component_shape(s, is_dit=s.name in transformers, dtype=dtype, options=options,
                               lora_headers_only=lora_headers_only,
                               quantization=quantization,
                               lora_files=[(str(x.path), x.scale) for x in loras.get(s.name, [])]) for s in sources]
    on_device = device_type != "cpu"
    ranks, unavailable = [], {}
    for strategy in STRATEGY_ORDER:
        try:
            runs = check_strategy(strategy, sources=sources, world_size=world_size, sharded=world_size > 1)
        except StrategyError as exc:
            unavailable[strategy] = str(exc)
            continue
        for rank in range(world_size):
            planned, host_peak, device_peak, held_before, gather = [], 0, 0, 0, 0
            private_peak = private_before = mapped_after = swap_factors = swap_transient = 0
            for shape in shapes:
                sharded = shape.is_dit and world_size > 1
                cp, host, device, private, held_private, held_mapped = _component_plan(
                    shape, runs=runs, rank=rank, shard_size=shard_size, sharded=sharded, options=options,
                    on_device=on_device)
                planned.append(cp)
                host_held = 0 if on_device else held_before
                host_peak = max(host_peak, host_held + host)
                private_peak = max(private_peak, private_before + private)
                device_peak = max(device_peak, held_before + device)
                held_before += cp.held
                private_before += held_private
                mapped_after += held_mapped
                if shape.is_dit and sharded:
                    gather = max(gather, first_run_gather(shape))
                if shape.lora_bytes and cp.transient != "hsdp_broadcast_bucket_mb":  # a swap re-reads rows in place
                    swap_factors, swap_transient = swap_factors + shape.lora_bytes, max(swap_transient,
                                                                                        cp.transient_bytes)
            host_peak += 0 if on_device else LOAD_CODE_BYTES
            ranks.append(RankPlan(rank, strategy, runs, tuple(planned), sum(c.bytes_read for c in planned),
                                  host_peak, device_peak if on_device else None, held_before + gather,
                                  private_peak, private_before + gather, mapped_after,
                                  swap_factors + swap_transient if swap_factors else 0))
    return Plan(str(checkpoint), world_size, layout, device_type, str(dtype).removeprefix("torch."), tuple(ranks),
                unavailable, host_memory, device_memory, local_world_size)


def plan_module_load(source, *, dtype, device_type: str, lora_files: Sequence[tuple[str, float]] = (),
                     ranks: int = 1, tensor_parallel: int = 1, chunk_mb: int = 256):
    """The plan of a load that streams one checkpoint folder into a model another framework builds whole on every
    rank (the vLLM loader door: ``full`` only), from its headers: every floating tensor at ``dtype``, divided
    over ``tensor_parallel`` ranks (vLLM's own split, near enough), allocated on the device (or the host), plus the
    LoRA files beside their factors (host) and one delta chunk (device). ``ranks``: this node's ranks (host)."""
    size = dtype.itemsize if hasattr(dtype, "itemsize") else 2
    whole = sum(math.prod(t.shape) * (size if t.dtype.is_floating_point else t.dtype.itemsize)
                for t in source.tensors.values())
    read = sum(t.nbytes for t in source.tensors.values())
    held = -(-whole // max(1, tensor_parallel))
    lora = sum(Path(path).stat().st_size for path, _ in lora_files)
    chunk = min(chunk_mb * MIB, held) if lora else 0
    on_device = device_type != "cpu"
    host = 2 * lora + (0 if on_device else held + chunk)  # the files as read beside their factors, then the model
    device = held + chunk if on_device else None
    rows = tuple(RankPlan(rank, "full", "full", (ComponentPlan(source.name, read, held, device or host,
                                                                "lora_device_chunk_mb", chunk),),
                          read, host, device, device or held, host, 0 if on_device else held)
                 for rank in range(ranks))
    why = "the vLLM loader builds and loads its model on every rank"
    return Plan(str(source.folder), ranks, None, device_type, str(dtype).removeprefix("torch."), rows,
                {"broadcast": why, "rank_local": why})
