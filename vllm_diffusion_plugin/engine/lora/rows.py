"""LoRA deltas fused into this rank's rows of their targets (``hsdp_weight_load=rank_local``): ``W[rows] += s *
B[key rows] @ A`` through ``io.rows.RowBinding`` s, so no rank ever holds a full-size weight or delta; the device
rule and the checks are ``fuse.fuse_lora``'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vllm_diffusion_plugin.engine.errors import DistributedLoadError
from vllm_diffusion_plugin.engine.io.rows import RowBinding, bound_local_rows, identity_bindings
from vllm_diffusion_plugin.engine.lora.fuse import fuse_lora


class LocalShards(nn.Module):
    """This rank's rows of LoRA target weights (and biases) as plain parameters sharing FSDP's local storage,
    named like the targets, so ``lora.fuse_lora`` fuses them with its own device rule and checks."""

    def add(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        owner: nn.Module = self
        for part in name.split("."):
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        owner.register_parameter("weight", nn.Parameter(weight.detach(), requires_grad=False))
        if bias is not None:
            owner.register_parameter("bias", nn.Parameter(bias.detach(), requires_grad=False))


def fuse_bound_rows(targets: Mapping[str, torch.Tensor], bindings: Sequence[RowBinding],
                    files: Sequence[dict[str, Any]], *, modules: Iterable[str], chunk_mb: int,
                    check_finite: bool = False, host_weights: str = "auto"):
    """Fuse LoRA deltas (keyed by checkpoint module names) into this rank's rows of their bound targets:
    ``W[rows] += s * B[key rows] @ A`` (and the same key rows of bias / full deltas), file after file.

    ``modules``: the checkpoint's module names (a delta target that is not one is a bare parameter). Returns
    the summed ``FuseStats`` or None."""
    modules = set(modules)
    by_key: dict[str, list[RowBinding]] = {}
    for binding in bindings:
        by_key.setdefault(binding.key, []).append(binding)

    unbound = [name for deltas in files for name in deltas
               if (f"{name}.weight" if name in modules else name) not in by_key]
    if unbound:
        raise DistributedLoadError(f"LoRA targets {unbound[:10]}: their checkpoint tensors go into no parameter")

    def bound(key: str) -> list[tuple[torch.Tensor, int]]:
        found = [bound_local_rows(b, targets[b.target]) for b in by_key.get(key, ())]
        return [f for f in found if f is not None]

    total = None
    for deltas in files:
        shadow, sliced = LocalShards(), {}
        for name, delta in deltas.items():
            weight_key = f"{name}.weight" if name in modules else name
            biases = {} if delta.bias_delta is None else {row: view for view, row in bound(f"{name}.bias")}
            for i, (w_local, first) in enumerate(bound(weight_key)):
                rows = slice(first, first + (w_local.shape[0] if w_local.dim() else 1))
                b_local = None
                if delta.bias_delta is not None:
                    b_local = biases.get(first)
                    if b_local is None or b_local.shape[0] != w_local.shape[0]:
                        raise DistributedLoadError(f"{name}: this rank holds weight rows {rows.start}:{rows.stop} "
                                                   f"but not the same bias rows; cannot fuse the bias delta locally")
                target = name if i == 0 else f"{name}_{i}"
                shadow.add(target, w_local, b_local)
                sliced[target] = dataclasses.replace(
                    delta, B=None if delta.B is None else delta.B[rows],
                    bias_delta=None if delta.bias_delta is None else delta.bias_delta[rows],
                    full_delta=None if delta.full_delta is None else delta.full_delta[rows])
        stats = fuse_lora(shadow, sliced, chunk_mb=chunk_mb, check_finite=check_finite, host_weights=host_weights)
        total = stats if total is None else total + stats
    return total


def fuse_local_rows(module: nn.Module, files: Sequence[dict[str, Any]], *, chunk_mb: int,
                    check_finite: bool = False, host_weights: str = "auto"):
    """``fuse_bound_rows`` for a diffusers module, whose parameter names are its checkpoint keys."""
    targets = dict(module.named_parameters())
    return fuse_bound_rows(targets, identity_bindings(targets, targets), files,
                           modules=(name for name, _ in module.named_modules()), chunk_mb=chunk_mb,
                           check_finite=check_finite, host_weights=host_weights)
