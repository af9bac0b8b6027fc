"""Online quantization of a DiT sharded before any weight exists (``hsdp_weight_load=rank_local``).

``full`` reads a whole weight, fuses the LoRA into it, and the layer's online quant method quantizes the whole
tensor. Under ``rank_local`` no rank ever holds the whole tensor; each quantizes its own rows, and the result
must be bit-identical to the same rows of ``full``'s. The elementwise part (``rows / scale`` -> fp8) is the same
on any subset of rows; the scale is the question:

- per output channel (a ``[out, 1]`` scale): each row's scale comes from that row alone, so a rank's rows
  carry everything; no communication.
- per tensor: the scale comes from the amax of the whole tensor. The max of the ranks' amaxes is the whole
  tensor's amax exactly (a max rounds nothing), so the ranks of one shard group agree on it with one
  ``all_reduce(MAX)`` of fp32 amaxes -- batched per FSDP2 block: one collective per block, 4 bytes per
  per-tensor-scaled layer. Replicas do the same in their own shard group and reach the same value.

The layout is fixed before sharding (:func:`to_quantized_layout`): each quantized layer's ``weight`` becomes an
fp8 ``[out, in]`` parameter on ``meta`` (row-major, the storage vllm-omni's ``prepare_fp8_layers_for_fsdp`` keeps
for FSDP2; the method's ``apply`` transposes at the GEMM) and gets a ``weight_scale``; FSDP2 then shards the fp8
weight by rows, so each rank's local shard holds exactly the rows it reads. After the plain tensors are read,
:func:`quantize_by_block` goes block by block: this rank's rows of the block's quantized weights are read into
transient tensors of the dtype ``full`` would load (the DiT's dtype), the LoRA is fused into them, the amaxes are
agreed, the rows quantized into the fp8 shards and the transients dropped. The transient is one block's local
rows in the load dtype (~1/S of a block); what stays is the fp8 shard plus scales.

A method takes part by declaring the row protocol (``testing.online_quant.TorchFp8OnlineMethod`` does):
``scale_granularity`` (``"tensor"`` / ``"channel"``), ``quantized_dtype``, ``row_amax(rows)`` (fp32: 0-dim, or
``[rows, 1]``), ``quantize_rows(rows, amax) -> (q, scale)`` (the same functions its own
``process_weights_after_loading`` runs on the whole tensor) and ``install_rows(layer)`` (marks the layout and the
layer processed). A method that does not is finished layer-whole instead (``engine/quant/whole``: each layer gathered
from the shard group and post-processed by the method itself), chosen per method by :func:`declares_rows`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vllm_diffusion_plugin import compat
from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.errors import RowQuantError
from vllm_diffusion_plugin.engine.postprocess import PROCESSED_ATTR
from vllm_diffusion_plugin.engine.quant.fp8 import row_chunks

logger = init_logger(__name__)

ROW_PROTOCOL = ("scale_granularity", "quantized_dtype", "row_amax", "quantize_rows", "install_rows")
"""What a quant method declares to be quantized row by row under ``rank_local``."""
GRANULARITIES = ("tensor", "channel")

ROW_WISE_METHODS: set[str] = set()
"""Quantization method names (as given to vllm-omni's ``--quantization``, or a pre-quantized checkpoint's) whose
methods declare the row protocol (a pre-quantized FP8 method: ``engine/quant/parts``'s); a method
registers its name here where it registers itself (``testing.online_quant.register_omni_override``,
``testing.cpu_modelopt.register``). vllm-omni's door refuses ``rank_local`` with a pre-quantized checkpoint of any
other name at startup; an online method of any other name goes layer-whole (``engine/quant/whole``)."""


def row_wise_methods() -> set[str]:
    """The quantization method names that declare the row protocol (:data:`ROW_WISE_METHODS`, as registered now)."""
    return ROW_WISE_METHODS


class LayerNames:
    """The parameter names and the scale granularity of a quantized linear with a ``module`` name and a ``method``
    (``QuantLayer`` here, ``engine/quant/parts.Fp8Layer``)."""

    module: str
    method: Any

    @property
    def weight(self) -> str:
        return f"{self.module}.weight"

    @property
    def scale(self) -> str:
        return f"{self.module}.weight_scale"

    @property
    def per_tensor(self) -> bool:
        return self.method.scale_granularity == "tensor"


@dataclass(frozen=True)
class QuantLayer(LayerNames):
    """One online-quantized linear of a DiT, named as in the targets mapping of the load."""

    module: str
    """The layer's module name (``blocks.0.attn1.to_q``)."""
    method: Any
    shape: tuple[int, int]
    """``(out, in)``."""
    dtype: torch.dtype
    """The dtype ``full`` loads the weight in before quantizing (the transient's)."""


@dataclass
class QuantReport:
    """What :func:`quantize_by_block` did on this rank."""

    layers: int = 0
    per_tensor: int = 0
    blocks: int = 0
    collectives: int = 0
    """``all_reduce(MAX)`` calls (one per block holding per-tensor-scaled layers)."""
    reduced_bytes: int = 0
    """Bytes this rank contributed to them (4 per per-tensor-scaled layer)."""
    transient_peak_bytes: int = 0
    """The largest block's transient rows on this rank (load dtype)."""
    quantized_bytes: int = 0
    """fp8 rows and scales this rank holds."""
    names: list[str] = field(default_factory=list)


def is_online(module: nn.Module) -> bool:
    return bool(getattr(getattr(module, "quant_method", None), "uses_meta_device", False))


def declares_rows(method: Any) -> bool:
    """Whether ``method`` declares the row protocol (:data:`ROW_PROTOCOL`, a known ``scale_granularity``)."""
    return all(hasattr(method, attr) for attr in ROW_PROTOCOL) and method.scale_granularity in GRANULARITIES


def find_layers(module: nn.Module, *, prefix: str = "", detach_layerwise: bool = False,
                others: str = "refuse") -> list[QuantLayer]:
    """The online-quantized linears of ``module`` (names prefixed with ``prefix``) whose methods declare the row
    protocol; a layer whose method does not is refused (``others="refuse"``: :class:`RowQuantError` naming the first)
    or left out (``"skip"``: ``quant.whole`` gathers it whole). Reads nothing. ``detach_layerwise``: undo vLLM's
    layerwise wrapping of their weight loaders once all were found (a model vLLM built: its rows are read here,
    never arrive whole)."""
    layers = []
    for name, sub in module.named_modules():
        if not is_online(sub):
            continue
        method = sub.quant_method
        missing = [attr for attr in ROW_PROTOCOL if not hasattr(method, attr)]
        full_name = prefix + name
        if others == "skip" and not declares_rows(method):
            continue
        if missing or method.scale_granularity not in GRANULARITIES:
            raise RowQuantError(
                f"hsdp_weight_load=rank_local quantizes each rank's rows with the scale the whole tensor gets; "
                f"{type(method).__name__} (layer {full_name}) does not declare how "
                f"({', '.join(missing) or f'scale_granularity {method.scale_granularity!r}'} missing; see "
                f"engine.quant.online): use hsdp_weight_load=full with this quantization")
        weight = sub._parameters.get("weight")
        if weight is None or weight.dim() != 2:
            raise RowQuantError(f"rank_local online quantization: layer {full_name} ({type(method).__name__}) has "
                                f"no 2-D weight ({None if weight is None else tuple(weight.shape)})")
        layers.append(QuantLayer(full_name, method, tuple(weight.shape), weight.dtype))
    if detach_layerwise:
        for layer in layers:
            compat.detach_layerwise_processing(module.get_submodule(layer.module.removeprefix(prefix)))
    return layers


def to_quantized_layout(module: nn.Module, layers: Sequence[QuantLayer], *, prefix: str = "") -> None:
    """Give each layer its final parameters on ``meta`` before FSDP2 shards them: an fp8 ``[out, in]`` weight
    (the same Parameter object, its attributes kept) and a ``weight_scale`` (``()`` or ``[out, 1]``, fp32)."""
    for layer in layers:
        owner = module.get_submodule(layer.module.removeprefix(prefix))
        weight = owner._parameters["weight"]
        if not weight.is_meta:
            raise RowQuantError(f"rank_local online quantization: {layer.weight} must still be on meta before "
                                f"sharding, it is on {weight.device}")
        fp8 = torch.empty(layer.shape, dtype=layer.method.quantized_dtype, device="meta")
        new = nn.Parameter(fp8, requires_grad=False)
        new.__dict__.update(weight.__dict__)
        torch.utils.swap_tensors(weight, new)
        scale_shape = () if layer.per_tensor else (layer.shape[0], 1)
        owner.register_parameter("weight_scale", nn.Parameter(torch.empty(scale_shape, device="meta"),
                                                              requires_grad=False))


def block_of(name: str, blocks: Sequence[str]) -> str:
    """The FSDP2 unit of ``blocks`` holding module ``name`` (the deepest; "" outside them)."""
    found = [b for b in blocks if name.startswith(b + ".")]
    return max(found, key=len) if found else ""


def shard_group(param: torch.Tensor):
    """The process group of the mesh dimension ``param``'s rows are split over (None: not sharded)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return None
    dims = [i for i, p in enumerate(param.placements) if type(p) is Shard and p.dim == 0]
    return param.device_mesh.get_group(dims[0]) if dims else None


def transient_rows(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor in ``dtype`` holding this rank's rows of ``param`` (same mesh and placements when it is
    a DTensor), for the read and the LoRA to land in before quantization."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return torch.empty(param.shape, dtype=dtype, device=param.device)
    local = torch.empty(param.to_local().shape, dtype=dtype, device=param.to_local().device)
    return DTensor.from_local(local, device_mesh=param.device_mesh, placements=param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def local_part(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _quantize_rows_into(layer: QuantLayer, rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        amax: torch.Tensor | None) -> None:
    """``rows`` (this rank's, load dtype) quantized by ``layer``'s method into its fp8 ``weight`` rows and ``scale``
    (per tensor: from the agreed ``amax``), row chunk by row chunk: elementwise per row, so chunks change no bit,
    they only bound the temporaries."""
    if layer.per_tensor:
        scale.copy_(layer.method.quantize_rows(rows[:0], amax)[1])
    for c in row_chunks(rows):
        statistic = amax if layer.per_tensor else layer.method.row_amax(rows[c])
        qrows, qscale = layer.method.quantize_rows(rows[c], statistic)
        weight[c].copy_(qrows)
        if not layer.per_tensor:
            scale[c].copy_(qscale)
        del qrows, qscale


def quantize_by_block(module: nn.Module, layers: Sequence[QuantLayer], *, targets: Mapping[str, torch.Tensor],
                      blocks: Sequence[str], read: Callable[[dict[str, torch.Tensor]], None],
                      fuse: Callable[[dict[str, torch.Tensor], Sequence[QuantLayer]], None],
                      prefix: str = "") -> QuantReport:
    """Block by block: transient rows of the block's quantized weights -> ``read(transients)`` (this rank's
    rows, keyed like ``targets``) -> ``fuse(transients, layers)`` (the LoRA) -> amaxes agreed per shard group
    (one ``all_reduce(MAX)``) -> fp8 rows and scales into the sharded ``targets`` -> ``install_rows``.
    ``blocks``: the FSDP2 unit names (layers outside them form one last group)."""
    import torch.distributed as dist

    report = QuantReport()
    groups: dict[str, list[QuantLayer]] = {}
    for layer in layers:
        groups.setdefault(block_of(layer.module, blocks), []).append(layer)
    with torch.no_grad():
        for block, members in groups.items():
            transients = {layer.weight: transient_rows(targets[layer.weight], layer.dtype) for layer in members}
            report.transient_peak_bytes = max(report.transient_peak_bytes, sum(
                local_part(t).numel() * local_part(t).element_size() for t in transients.values()))
            read(transients)
            fuse(transients, members)
            amax = {}
            for layer in members:  # per tensor; no rows here (uneven shards): 0 is neutral for a max of magnitudes
                if layer.per_tensor:
                    rows = local_part(transients[layer.weight])
                    amax[layer.weight] = torch.stack([layer.method.row_amax(rows[c]).reshape(()) for c in
                                                      row_chunks(rows)]).amax() if rows.numel() else torch.zeros(
                        (), dtype=torch.float32, device=rows.device)
            tensor_wide = [layer for layer in members if layer.per_tensor]
            group = shard_group(targets[tensor_wide[0].weight]) if tensor_wide else None
            if group is not None:
                packed = torch.stack([amax[layer.weight].reshape(()) for layer in tensor_wide])
                dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
                for layer, value in zip(tensor_wide, packed):
                    amax[layer.weight] = value.clone()
                report.collectives += 1
                report.reduced_bytes += packed.numel() * packed.element_size()
            for layer in members:
                weight, scale = local_part(targets[layer.weight]), local_part(targets[layer.scale])
                _quantize_rows_into(layer, local_part(transients[layer.weight]), weight, scale, amax.get(layer.weight))
                owner = module.get_submodule(layer.module.removeprefix(prefix))
                layer.method.install_rows(owner)
                setattr(owner, PROCESSED_ATTR, True)
                report.quantized_bytes += weight.numel() * weight.element_size() + scale.numel() * scale.element_size()
                report.names.append(layer.module)
            del transients
            report.blocks += 1
    report.layers = len(layers)
    report.per_tensor = sum(layer.per_tensor for layer in layers)
    logger.info("Quantized %d layers' own rows (%d per-tensor scales agreed in %d all_reduce(MAX) of %d bytes "
                "in all; %d per-channel) over %d blocks; fp8 rows + scales %.3f MiB, transient at most %.3f MiB",
                report.layers, report.per_tensor, report.collectives, report.reduced_bytes,
                report.layers - report.per_tensor, report.blocks, report.quantized_bytes / 2**20,
                report.transient_peak_bytes / 2**20)
    return report
