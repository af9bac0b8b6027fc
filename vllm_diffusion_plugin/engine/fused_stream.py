"""A component's checkpoint stream with its LoRA fused into each tensor as it passes, for a model that maps the
checkpoint onto its parameters itself (vllm-omni's DiTs: their ``load_weights`` renames, and stacks q/k/v).

The deltas are resolved against a ``meta`` skeleton of the component's own diffusers class, so they are keyed by
*checkpoint* names: fusing before the model's name mapping and stacking is exact (``W_q + s B_q A_q`` is stacked
like ``W_q``) and needs no knowledge of the model's packing. An FP8 weight of a pre-quantized checkpoint is fused
exactly (``quant.fuse.fuse_fp8_layers``: every file's delta summed in fp32, added once, requantized once) and its
new scale handed on right after it, the checkpoint's own scale dropped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource
from vllm_diffusion_plugin.engine.lora.fuse import fuse_lora
from vllm_diffusion_plugin.engine.lora.prepare import prepare_lora_files
from vllm_diffusion_plugin.engine.quant.checkpoints import fp8_layers
from vllm_diffusion_plugin.engine.quant.fuse import fuse_fp8_layers
from vllm_diffusion_plugin.engine.skeleton import build_component


@dataclass
class StreamFuser:
    """Fuses LoRA deltas (keyed by checkpoint module names) into checkpoint tensors as they stream past.

    ``deltas`` holds one mapping per LoRA file, applied in order (several files for one DiT stack, as in
    ``lora.fuse_lora_files``). A targeted tensor is copied before it is changed (never the reader's buffer). An FP8
    weight of a pre-quantized checkpoint (``fp8_layers``) is fused exactly and hands on its new scale
    (:meth:`items`)."""

    deltas: list[dict[str, Any]]
    modules: frozenset[str]
    """Module names of the component's diffusers class (a target not among them is a bare parameter)."""
    dtype: torch.dtype
    chunk_mb: int
    check_finite: bool = False
    host_weights: str = "auto"
    stats: Any = None
    seconds: float = 0.0
    fp8_layers: frozenset[str] = frozenset()
    """Module names whose checkpoint weight is FP8 with a ``weight_scale`` (``quant.checkpoints.fp8_layers``)."""
    _by_tensor: dict[str, list[tuple[Any, str]]] = field(default_factory=dict)
    _scales: dict[str, torch.Tensor] = field(default_factory=dict)
    _replaced: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for name, delta, part in delta_tensors(self.deltas, self.modules):
            self._by_tensor.setdefault(name, []).append((delta, part))

    def tensor_names(self) -> set[str]:
        """The checkpoint tensors its deltas change (before the stream consumed any)."""
        return {name for name, _, _ in delta_tensors(self.deltas, self.modules)}

    def fp8_scale_keys(self) -> list[str]:
        """The ``weight_scale`` keys of the FP8 layers a LoRA targets: read before the stream (:meth:`items`)."""
        return sorted(f"{n.removesuffix('.weight')}.weight_scale" for n, hits in self._by_tensor.items()
                      if n.removesuffix(".weight") in self.fp8_layers and any(p == "weight" for _, p in hits))

    def items(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """What to hand on for checkpoint tensor ``name``: itself, LoRA fused; for an FP8 weight a LoRA targets,
        the fused FP8 weight and then its new scale; a targeted FP8 layer's own scale is dropped."""
        if name.endswith(".weight_scale") and name.removesuffix(".weight_scale") in self._replaced:
            return  # its weight's new scale is (or will be) handed on right after that weight
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in self._scales:
            q, scale = self._fuse_fp8(name, tensor, self._scales.pop(module))
            yield name, q
            yield f"{module}.weight_scale", scale
            return
        yield name, self(name, tensor)

    def read_fp8_scales(self, scales: Iterable[tuple[str, torch.Tensor]]) -> None:
        for key, scale in scales:
            self._scales[key.removesuffix(".weight_scale")] = scale.clone()
        self._replaced = frozenset(self._scales)

    def _fuse_fp8(self, name: str, q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every file's delta of FP8 weight ``name`` fused into private copies of it and its scale by the engine's
        exact FP8 fusion (``quant.fuse.fuse_fp8_layers``: summed in fp32, added once, requantized once)."""
        start = time.perf_counter()
        module = name.removesuffix(".weight")
        scale_key = f"{module}.weight_scale"
        targets = {name: q.clone(), scale_key: scale.to(q.device, copy=True)}
        files = [{module: dataclasses.replace(delta, bias_delta=None)} for delta, _ in self._by_tensor.pop(name)]
        stats = fuse_fp8_layers(targets, files, modules=self.modules, chunk_mb=self.chunk_mb,
                                check_finite=self.check_finite, host_weights=self.host_weights)
        if stats is not None:
            self.stats = stats if self.stats is None else self.stats + stats
        self.seconds += time.perf_counter() - start
        return targets[name], targets[scale_key]

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        hits = self._by_tensor.pop(name, None)
        if hits is None:
            return tensor
        start = time.perf_counter()
        # the model's precision when floating (as a fusion into the module would), and always a private copy
        tensor = tensor.to(self.dtype, copy=True) if tensor.is_floating_point() else tensor.clone()
        for delta, part in hits:
            if part == "bias":
                with torch.no_grad():
                    tensor.add_(delta.bias_delta.to(tensor.dtype))
                continue
            tensor = self._add(tensor, delta)
        self.seconds += time.perf_counter() - start
        return tensor

    def _add(self, tensor: torch.Tensor, delta: Any) -> torch.Tensor:
        """``tensor`` (a weight, owned here) with ``delta``'s weight part added in place by our fusion and device
        rule; counts its ``FuseStats``."""
        holder = nn.Module()
        holder.weight = nn.Parameter(tensor, requires_grad=False)
        stats = fuse_lora(holder, {"": dataclasses.replace(delta, bias_delta=None)}, chunk_mb=self.chunk_mb,
                          check_finite=self.check_finite, log=False, host_weights=self.host_weights)
        self.stats = stats if self.stats is None else self.stats + stats
        return holder.weight.data

    def check_consumed(self, component: str) -> None:
        if self._scales:
            raise ValueError(f"FP8 weights of {component} a LoRA targets were not among its checkpoint tensors: "
                             f"{sorted(self._scales)[:10]}")
        if self._by_tensor:
            raise ValueError(f"LoRA targets of {component} not found among its checkpoint tensors: "
                             f"{sorted(self._by_tensor)[:10]}")


def delta_tensors(deltas: Iterable[Mapping[str, Any]],
                  modules: Container[str]) -> Iterator[tuple[str, Any, str]]:
    """``(checkpoint tensor, delta, "weight" | "bias")`` for every part of every file's deltas (keyed by checkpoint
    module names; a target that is no module in ``modules`` is a bare parameter), in file order."""
    for per_file in deltas:
        for target, delta in per_file.items():
            if delta.A is not None or delta.full_delta is not None:  # a module's weight, or a bare parameter
                yield (f"{target}.weight" if target in modules else target), delta, "weight"
            if delta.bias_delta is not None:
                yield f"{target}.bias", delta, "bias"


def lora_fuser(source: ComponentSource, lora_files: Sequence[tuple[str, float]], *, dtype: torch.dtype, strict: bool,
               chunk_mb: int, check_finite: bool = False, host_weights: str = "auto") -> StreamFuser | None:
    """The fuser of ``source``'s stream for ``lora_files`` (path, scale), every file read and checked against the
    component's skeleton built on ``meta`` (before any weight is read); None without any."""
    if not lora_files:
        return None
    skeleton = build_component(source, dtype=dtype, device="meta")
    prepared = prepare_lora_files(skeleton, lora_files, strict=strict, component=source.name)
    fp8 = fp8_layers(source)
    return StreamFuser([lora.deltas for lora in prepared], modules=frozenset(n for n, _ in skeleton.named_modules()),
                       dtype=dtype, chunk_mb=chunk_mb, check_finite=check_finite, host_weights=host_weights,
                       fp8_layers=frozenset(fp8.layers) if fp8 is not None else frozenset())
