"""Online quantization under vllm-omni's ``rank_local`` (``doors/omni/rank_local.py``): each rank quantizes its own
rows of vllm-omni's quantized DiT linears with the scale the whole (stacked) tensor gets (``engine.quant_shards``).

vllm-omni builds its DiTs with the quant config's methods; an online method creates its weights on ``meta`` and
wraps their loaders so the layer is quantized once its last weight arrives. Here nothing arrives whole: the wrapping
is undone first (``compat.detach_layerwise_processing``) so the binding trace replays plain copies, then, per DiT,
the quantized weights get their fp8 layout on ``meta`` before vllm-omni shards them, and after the other tensors
are read and fused, block by block: this rank's rows of the quantized weights (q/k/v of a stacked ``to_qkv`` from
their three checkpoint tensors) land in transients, their LoRA deltas are fused there, the per-tensor amaxes are
agreed per shard group and the rows quantized into the fp8 shards. A method without the row protocol (vLLM's own
fp8, whose kernels this CPU-built project cannot check bit for bit) is refused before any weight is read, naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vllm_diffusion_plugin import compat
from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine import quant_shards

logger = init_logger(__name__)


def find_layers(modules: dict[str, nn.Module], dits: Sequence[Any]) -> dict[str, list[quant_shards.QuantLayer]]:
    """The online-quantized linears of each DiT (named in the pipeline), their layerwise wrapping undone; raises
    ``quant_shards.RowQuantError`` naming a method without the row protocol. Reads nothing."""
    found = {}
    for dit in dits:
        module = modules[dit.component]
        layers = quant_shards.find_layers(module, prefix=dit.prefix)
        for layer in layers:
            compat.detach_layerwise_processing(module.get_submodule(layer.module.removeprefix(dit.prefix)))
        found[dit.component] = layers
    return found


def split_deltas(deltas: Sequence[dict[str, Any]], bindings: Sequence[Any], modules: Any,
                 quantized: set[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(deltas into plain targets, deltas into quantized ones), per LoRA file, by where their weight rows go."""
    modules = set(modules)
    into = {}
    for binding in bindings:
        into.setdefault(binding.key, set()).add(binding.target)
    plain, quant = [], []
    for file in deltas:
        p, q = {}, {}
        for name, delta in file.items():
            key = f"{name}.weight" if name in modules else name
            (q if into.get(key, set()) & quantized else p)[name] = delta
        plain.append(p)
        quant.append(q)
    return plain, quant


def quantize_dit(dit: Any, module: nn.Module, layers: Sequence[quant_shards.QuantLayer], bindings: Sequence[Any],
                 targets: dict[str, torch.Tensor], deltas: Sequence[dict[str, Any]], device: torch.device):
    """Read, fuse and quantize this rank's rows of ``layers`` block by block; returns (checkpoint keys read,
    bytes read, ``FuseStats`` or None, ``QuantReport``)."""
    from torch.distributed.fsdp import FSDPModule

    from vllm_diffusion_plugin.engine.strategies.rank_local import fuse_bound_rows, read_bound_rows

    keys: set[str] = set()
    nbytes, fused = [0], []
    blocks = [dit.prefix + name for name, sub in module.named_modules() if name and isinstance(sub, FSDPModule)]

    def read(transients: dict[str, torch.Tensor]) -> None:
        mine = [b for b in bindings if b.target in transients]
        got, stats = read_bound_rows(dit.source, mine, transients, threads=dit.threads, staging=dit.staging(device))
        keys.update(got)
        nbytes[0] += stats.total_bytes

    def fuse(transients: dict[str, torch.Tensor], members: Sequence[quant_shards.QuantLayer]) -> None:
        if dit.fuser is None:
            return
        names = set(transients)
        mine = [b for b in bindings if b.target in names]
        weight_keys = {b.key for b in mine}
        _, subset = split_deltas(deltas, mine, dit.fuser.modules, names)
        subset = [f for f in subset if f]
        if not subset:
            return
        bias_keys = {k.removesuffix(".weight") + ".bias" for k in weight_keys}
        rows = mine + [b for b in bindings if b.key in bias_keys]
        fused.append(fuse_bound_rows({**targets, **transients}, rows, subset, modules=dit.fuser.modules,
                                     chunk_mb=dit.fuser.chunk_mb, check_finite=dit.fuser.check_finite,
                                     host_weights=dit.fuser.host_weights))

    report = quant_shards.quantize_by_block(module, layers, targets=targets, blocks=blocks, read=read, fuse=fuse,
                                            prefix=dit.prefix)
    total = None
    for stats in fused:
        total = stats if total is None else total + stats
    return keys, nbytes[0], total, report
