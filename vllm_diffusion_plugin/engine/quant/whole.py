"""Online quantization under ``rank_local`` for a method without the row protocol: each layer gathered whole.

``full`` runs a layer's quant method -- its own ``process_weights_after_loading`` -- on the whole layer, and FSDP2
then shards dim 0 of whatever it produced (made contiguous: vLLM's fp8 stores ``weight.t()``; a 0-dim scale is kept
whole on every rank). A method that declares the row protocol (``quant.online``) is run on each rank's rows with no
gather; any other is run here on the whole layer, so the result is ``full``'s by construction: the method's own code
quantizes and lays out, this module only decides what each rank keeps.

1. Before sharding (:func:`find_whole_layers`, :func:`to_whole_layout`): each layer's final parameters are learned by
   running the method's post-processing on a probe, a shallow copy of the layer holding ``meta`` tensors of its
   parameters' shapes and dtypes (nothing allocated, nothing computed). A method whose post-processing cannot run on
   ``meta`` (a kernel without a meta implementation, an ``.item()``) is probed once per distinct layer on a
   zero-filled copy on the load device instead (one layer's transient, which the plan counts anyway). The layer then
   gets those parameters on ``meta``, contiguous -- the same Parameter objects where they exist, attributes kept --
   and FSDP2 shards that layout.
2. After the local shards were allocated, block by block (:func:`gather_by_block`): this rank's rows of the inputs
   whose layout the method changes (the weight) are read into load-dtype transients and the LoRA fused into them
   (``read`` / ``fuse``, the callbacks of ``quant.online.quantize_by_block``); then layer by layer the shard group
   all-gathers every parameter of the layer into a whole transient layer on the device (the inputs the method keeps,
   e.g. the bias, from their own shards), the method post-processes it, and this rank keeps its dim-0 rows of each
   resulting parameter (``io.rows.shard_rows``: torch.chunk's split, as ``fully_shard`` cuts) copied into its FSDP2
   local shard; what else post-processing set on the layer (its "processed" marker, plain attributes, buffers) is set
   on the real one. The whole layer and its processed form are dropped before the next.

Transient per rank: one block's local rows of the read inputs (load dtype), plus one layer whole in the load dtype
and its processed form (``quant.plan.whole_bytes``). Traffic: each layer once per shard group, all-gathered.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from vllm_diffusion_plugin import compat
from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.errors import RowQuantError
from vllm_diffusion_plugin.engine.io.rows import local_rows, shard_rows
from vllm_diffusion_plugin.engine.postprocess import PROCESSED_ATTR
from vllm_diffusion_plugin.engine.quant.online import block_of, declares_rows, is_online, local_part, shard_group

logger = init_logger(__name__)

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
LAYER_WHOLE_ATTR = "_vllm_diffusion_layer_whole"
"""Set to True on a layer :func:`gather_by_block` post-processed whole (a LoRA swap refuses to re-finish it)."""
_OWN_STATE = ("_parameters", "_buffers", "_modules")


@dataclass(frozen=True)
class Layout:
    """A parameter's shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class WholeLayer:
    """One online-quantized layer whose method declares no row protocol, named as in the load's targets."""

    module: str
    """The layer's module name (``blocks.0.attn1.to_q``)."""
    method: Any
    inputs: Mapping[str, Layout]
    """Its own parameters as ``full`` loads them (the load dtype): what its post-processing takes."""
    outputs: Mapping[str, Layout]
    """Its own parameters after post-processing, contiguous: what FSDP2 shards."""
    kinds: Mapping[str, Any] = field(compare=False, repr=False, default_factory=dict)
    """Parameter name -> ``(class, attributes)`` of each input (None: registered as None), for the transient layer."""

    @property
    def read(self) -> tuple[str, ...]:
        """The inputs (full names) whose layout post-processing changes or drops: read into transients."""
        return tuple(f"{self.module}.{n}" for n, lay in self.inputs.items() if self.outputs.get(n) != lay)

    @property
    def added(self) -> tuple[str, ...]:
        """The outputs (full names) post-processing creates (``weight_scale``): no checkpoint holds them."""
        return tuple(f"{self.module}.{n}" for n in self.outputs if n not in self.inputs)


@dataclass
class WholeReport:
    """What :func:`gather_by_block` did on this rank."""

    layers: int = 0
    blocks: int = 0
    gathered_bytes: int = 0
    """Bytes of the whole layers this rank assembled (load dtype)."""
    transient_peak_bytes: int = 0
    """A block's local rows plus the largest whole layer and its processed form, at most."""
    names: list[str] = field(default_factory=list)


def _kinds(layer: nn.Module) -> dict[str, Any]:
    return {name: None if p is None else (type(p), dict(p.__dict__)) for name, p in layer._parameters.items()}


def _param(kind: tuple[type, Mapping], data: torch.Tensor) -> nn.Parameter:
    """``data`` as a parameter of ``kind``'s class, with its attributes (vLLM's ``weight_loader``, ``output_dim``)."""
    cls, attributes = kind
    new = cls.__new__(cls, data) if cls is not nn.Parameter and issubclass(cls, nn.Parameter) else \
        nn.Parameter(data, requires_grad=False)
    new.__dict__.update(attributes)
    new.requires_grad_(False)
    return new


def _transient_layer(layer: nn.Module, kinds: Mapping[str, Any], data: Mapping[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of ``layer`` whose own parameters are ``data`` (by name, as ``kinds`` describes them); buffers
    and submodules shared. Its method post-processes it; the real layer is not touched."""
    twin = copy.copy(layer)
    twin._parameters = {n: None if kind is None else _param(kind, data[n]) for n, kind in kinds.items()}
    twin._buffers, twin._modules = dict(layer._buffers), dict(layer._modules)
    return twin


def _post_process(layer: nn.Module, twin: nn.Module) -> dict[str, Layout]:
    with torch.no_grad():
        layer.quant_method.process_weights_after_loading(twin)
    return {n: Layout(tuple(p.shape), p.dtype) for n, p in twin._parameters.items() if p is not None}


def probe_layout(layer: nn.Module, *, name: str, device: torch.device | str) -> dict[str, Layout]:
    """The parameters ``layer``'s method leaves after post-processing it, from a probe on ``meta`` (or, where its
    post-processing cannot run there, once on a zero-filled probe on ``device``)."""
    kinds = _kinds(layer)
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in layer._parameters.items() if p is not None}
    try:
        return _post_process(layer, _transient_layer(layer, kinds, {n: torch.empty(s, dtype=d, device="meta")
                                                                    for n, (s, d) in shapes.items()}))
    except Exception as exc:  # noqa: BLE001 -- a kernel without a meta implementation, an .item(), ...
        logger.info("%s: %s.process_weights_after_loading cannot run on meta (%s: %s); probing its layout on a "
                    "zero-filled copy on %s", name, type(layer.quant_method).__name__, type(exc).__name__, exc, device)
    return _post_process(layer, _transient_layer(layer, kinds, {n: torch.zeros(s, dtype=d, device=device)
                                                                for n, (s, d) in shapes.items()}))


def find_whole_layers(module: nn.Module, *, prefix: str = "", device: torch.device | str = "cpu",
                      detach_layerwise: bool = False) -> list[WholeLayer]:
    """The online-quantized layers of ``module`` whose methods declare no row protocol, with the layout their
    post-processing gives (:func:`probe_layout`, once per distinct layer). Reads nothing. ``detach_layerwise``:
    vLLM's layerwise wrapping undone first (their rows are read here, never arrive whole)."""
    layers, probed = [], {}
    for name, sub in module.named_modules():
        if not is_online(sub) or declares_rows(sub.quant_method):
            continue
        if detach_layerwise:
            compat.detach_layerwise_processing(sub)
        inputs = {n: Layout(tuple(p.shape), p.dtype) for n, p in sub._parameters.items() if p is not None}
        if "weight" not in inputs:
            raise RowQuantError(f"rank_local online quantization: layer {prefix + name} "
                                f"({type(sub.quant_method).__name__}) has no weight")
        key = (type(sub), type(sub.quant_method), repr(sorted(vars(sub.quant_method).items())),
               tuple(inputs.items()), tuple(k for k, v in sub._parameters.items() if v is None))
        if key not in probed:
            probed[key] = probe_layout(sub, name=prefix + name, device=device)
        layers.append(WholeLayer(prefix + name, sub.quant_method, inputs, probed[key], _kinds(sub)))
    return layers


def _give(param: nn.Parameter, data: torch.Tensor) -> None:
    """``data`` under the same ``param`` object (class and attributes kept)."""
    cls = type(param)
    new = cls.__new__(cls, data) if cls is not nn.Parameter else nn.Parameter(data, requires_grad=False)
    new.__dict__.update(param.__dict__)
    new.requires_grad_(False)
    torch.utils.swap_tensors(param, new)


def to_whole_layout(module: nn.Module, layers: Sequence[WholeLayer], *, prefix: str = "") -> None:
    """Give each layer the parameters its post-processing leaves, on ``meta`` and contiguous, before FSDP2 shards
    them: changed ones keep their Parameter objects, new ones are registered, dropped ones become None."""
    for layer in layers:
        owner = module.get_submodule(layer.module.removeprefix(prefix))
        for name, out in layer.outputs.items():
            param = owner._parameters.get(name)
            if param is not None and not param.is_meta:
                raise RowQuantError(f"rank_local online quantization: {layer.module}.{name} must still be on meta "
                                    f"before sharding, it is on {param.device}")
            if param is not None and (tuple(param.shape), param.dtype) == (out.shape, out.dtype):
                continue
            data = torch.empty(out.shape, dtype=out.dtype, device="meta")
            if param is None:
                owner.register_parameter(name, nn.Parameter(data, requires_grad=False))
            else:
                _give(param, data)
        for name in set(layer.inputs) - set(layer.outputs):
            owner.register_parameter(name, None)


def _gather(rows: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The whole tensor of ``rows`` (a Shard(0) DTensor: its shard group's all-gather, padded to torch.chunk's
    chunk; a plain or replicated tensor: as it is)."""
    group = shard_group(rows)
    local = local_part(rows)
    if group is None or not layout.shape:
        return local
    size = dist.get_world_size(group)
    chunk = -(-layout.shape[0] // size)
    padded = local
    if local.shape[0] != chunk:
        padded = torch.zeros((chunk, *local.shape[1:]), dtype=local.dtype, device=local.device)
        padded[:local.shape[0]] = local
    out = torch.empty((chunk * size, *local.shape[1:]), dtype=local.dtype, device=local.device)
    _ALL_GATHER(out, padded.contiguous(), group=group)
    return out[:layout.shape[0]]


def rows_like(layout: Layout, like: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """An empty tensor of ``layout`` holding this rank's rows of it, split as ``like`` (a Shard(0) DTensor of the
    same mesh) is; whole where ``like`` is None."""
    if like is None or not layout.shape:
        return torch.empty(layout.shape, dtype=layout.dtype, device=device)
    mesh, placements = like.device_mesh, like.placements
    dim = next(i for i, p in enumerate(placements) if getattr(p, "dim", None) == 0)
    start, stop = shard_rows(layout.shape[0], size=mesh.size(dim), index=mesh.get_local_rank(dim))
    local = torch.empty((stop - start, *layout.shape[1:]), dtype=layout.dtype, device=local_part(like).device)
    stride = torch.empty(layout.shape, device="meta").stride()
    return DTensor.from_local(local, device_mesh=mesh, placements=placements, run_check=False,
                              shape=torch.Size(layout.shape), stride=stride)


def _finish(owner: nn.Module, layer: WholeLayer, targets: Mapping[str, torch.Tensor],
            transients: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """``layer`` gathered whole, post-processed by its method, this rank's rows of each result kept in its shards;
    returns (the whole inputs' bytes, those plus the results')."""
    whole = {n: _gather(transients.get(f"{layer.module}.{n}", targets.get(f"{layer.module}.{n}")), lay)
             for n, lay in layer.inputs.items()}
    gathered = sum(t.numel() * t.element_size() for t in whole.values())
    twin = _transient_layer(owner, layer.kinds, whole)
    got = _post_process(owner, twin)
    if got != dict(layer.outputs):
        raise RowQuantError(f"{layer.module}: {type(layer.method).__name__}.process_weights_after_loading gave "
                            f"{ {n: (lay.shape, str(lay.dtype)) for n, lay in got.items()} } on the whole layer, "
                            f"its probe { {n: (lay.shape, str(lay.dtype)) for n, lay in layer.outputs.items()} }")
    produced = 0
    for name in layer.outputs:
        result = twin._parameters[name].detach().contiguous()
        produced += result.numel() * result.element_size()
        local, start, stop = local_rows(f"{layer.module}.{name}", targets[f"{layer.module}.{name}"])
        local.copy_(result[start:stop] if result.dim() else result)
    for key, value in twin.__dict__.items():  # the processed marker, plain attributes the method set
        if key not in _OWN_STATE and owner.__dict__.get(key, twin) is not value:
            owner.__dict__[key] = value
    for key, value in twin._buffers.items():
        if owner._buffers.get(key) is not value:
            owner._buffers[key] = value
    setattr(owner, PROCESSED_ATTR, True)
    setattr(owner, LAYER_WHOLE_ATTR, True)
    return gathered, gathered + produced


def gather_by_block(module: nn.Module, layers: Sequence[WholeLayer], *, targets: Mapping[str, torch.Tensor],
                    blocks: Sequence[str], read: Callable[[dict[str, torch.Tensor]], None],
                    fuse: Callable[[dict[str, torch.Tensor], Sequence[WholeLayer]], None],
                    prefix: str = "") -> WholeReport:
    """Block by block: transient rows of the block's read inputs -> ``read(transients)`` (this rank's rows, keyed
    like ``targets``) -> ``fuse(transients, layers)`` (the LoRA) -> per layer: gathered whole, post-processed by its
    method, this rank's rows of the results into the sharded ``targets``. ``blocks``: the FSDP2 unit names."""
    report = WholeReport()
    groups: dict[str, list[WholeLayer]] = {}
    for layer in layers:
        groups.setdefault(block_of(layer.module, blocks), []).append(layer)
    with torch.no_grad():
        for members in groups.values():
            transients = {}
            for layer in members:
                outs = [targets[f"{layer.module}.{n}"] for n in layer.outputs]
                like = next((t for t in outs if shard_group(t) is not None), None)
                device = local_part(outs[0]).device
                for key in layer.read:
                    transients[key] = rows_like(layer.inputs[key.rsplit(".", 1)[1]], like, device)
            rows = sum(local_part(t).numel() * local_part(t).element_size() for t in transients.values())
            read(transients)
            fuse(transients, members)
            for layer in members:
                owner = module.get_submodule(layer.module.removeprefix(prefix))
                gathered, transient = _finish(owner, layer, targets, transients)
                report.gathered_bytes += gathered
                report.transient_peak_bytes = max(report.transient_peak_bytes, rows + transient)
                report.names.append(layer.module)
                for key in layer.read:
                    rows -= local_part(transients[key]).numel() * local_part(transients[key]).element_size()
                    del transients[key]
            report.blocks += 1
    report.layers = len(layers)
    logger.info("Post-processed %d online-quantized layers whole (their methods declare no row protocol) over %d "
                "blocks: %.3f MiB gathered from the shard group's rows, transient at most %.3f MiB",
                report.layers, report.blocks, report.gathered_bytes / 2**20, report.transient_peak_bytes / 2**20)
    return report


def quant_path(rows: Sequence[Any], whole: Sequence[WholeLayer]) -> str | None:
    """What a component's report says ran: ``rows`` (the row protocol), ``layer-whole`` or both; None unquantized."""
    return "+".join(name for name, found in (("rows", rows), ("layer-whole", whole)) if found) or None
