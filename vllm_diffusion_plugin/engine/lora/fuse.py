"""Fusing normalized LoRA deltas into a module's weights: the device rule, the fast CPU path, integrity.

Device rule (DESIGN.md fix #1). ``resolve_compute_device()`` is called once per ``fuse_lora`` /
``unfuse_lora`` call, outside the per-parameter loop. Per weight:

- on an accelerator already -> fused there, in place, in row chunks;
- on the CPU with a usable accelerator (the probe allocation succeeded) -> on the side that is *faster on this
  host* (``host_side``): ``lora_host_weights="auto"`` times the CPU path and the through-device path once per
  process and dtype on a representative chunk (``side_timings``) and takes the faster -- an H200 host's 16 cores
  fused bf16 LoRA 5.8x faster than the through-device path, the seed's NPU host was the opposite; ``"cpu"`` and
  ``"device"`` decide without timing. Through the device, ``A`` and ``B`` go there once, weight rows go there in
  chunks of at most ``chunk_mb`` MiB through a page-locked buffer, are fused there and copied back into the CPU
  weight in place (no full-size delta ever reaches the host);
- else on the CPU.

An H2D copy or device matmul failure (OOM, driver error) falls back to the CPU path for that tensor, from
its first row not yet written back (chunks are written only after they were fully computed), with one
warning per call. Never a crash, never a wrong result.

Per weight, the CPU kernel choice and the integrity rule (no second pass over every weight) live in
``weight.py`` (``fuse_weight_``; ``fuse_factored_`` for LoKr / LoHa full deltas kept factored, which follow the
same device rule and fallback); every failure once a weight of the call was modified raises
``PartiallyFusedError`` (the load must be aborted). Errors name the LoRA file and component a delta came from
(``LoraDelta.origin``) when it is known.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine import platform
from vllm_diffusion_plugin.engine.io.staging import DeviceStaging, to_device
from vllm_diffusion_plugin.engine.lora.prepare import prepare_lora_files
from vllm_diffusion_plugin.engine.lora.types import FuseStats, LoraDelta
from vllm_diffusion_plugin.engine.lora.weight import (
    DeviceFailure,
    LoraFusionError,
    NonFiniteFusionError,
    PartiallyFusedError,
    Workspace,
    add_full,
    cpu_kernel,
    factor_maxima,
    fuse_factored_,
    fuse_weight_,
    lora_bound,
)
from vllm_diffusion_plugin.engine.progress import progress_bar

logger = init_logger(__name__)

__all__ = ["FuseStats", "HostSide", "LoraFusionError", "NonFiniteFusionError", "PartiallyFusedError", "cpu_kernel",
           "forget_side_timings", "fuse_lora", "fuse_lora_files", "fuse_prepared", "fuse_weight_", "host_side",
           "record_side_timings", "resolve_compute_device", "side_timings", "unfuse_lora"]


def resolve_compute_device() -> torch.device | None:
    """The local accelerator if a probe allocation on it succeeds, else None (compute on the CPU).

    A lookup alone proves nothing (``cuda:N`` is named even without a GPU), hence ``usable_device``.
    """
    device = platform.local_device()
    if device.type == "cpu":
        return None
    return platform.usable_device(device)


# ---- which side fuses host-resident weights ---------------------------------------------------------------------
@dataclass(frozen=True)
class HostSide:
    """Where the host-resident weights of one dtype are fused (``device`` None: on the CPU), and why."""

    device: torch.device | None
    why: str


_SIDE_TIMINGS: dict[tuple[str, torch.dtype], tuple[float, float]] = {}
_PROBE_SHAPE = (1024, 5120, 64)  # weight rows, columns, rank: a chunk of an A14B-width layer, a rank-64 LoRA


def record_side_timings(device: torch.device | str, dtype: torch.dtype, *, cpu_s: float, device_s: float) -> None:
    """Take these as this process's timings of the two paths for ``dtype`` on ``device`` (what ``side_timings``
    measures once; tests inject them)."""
    _SIDE_TIMINGS[(str(torch.device(device)), dtype)] = (cpu_s, device_s)


def forget_side_timings() -> None:
    """Measure again on the next call of ``side_timings``."""
    _SIDE_TIMINGS.clear()


def side_timings(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """``(cpu seconds, through-device seconds)`` to fuse a rank-64 LoRA into a 1024 x 5120 host chunk of ``dtype``:
    best of 3 after a warm-up, measured once per process (a path that fails counts as infinitely slow)."""
    key = (str(device), dtype)
    if key not in _SIDE_TIMINGS:
        rows, cols, rank = _PROBE_SHAPE
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(rows, cols, generator=gen).to(dtype)
        delta = LoraDelta((torch.randn(rank, cols, generator=gen) * 0.01).to(dtype),
                          (torch.randn(rows, rank, generator=gen) * 0.01).to(dtype), 1.0)
        timed = []
        for compute in (None, device):
            runs = []
            try:
                for _ in range(4):  # the first run warms up (kernel selection, buffers)
                    start = time.perf_counter()
                    fuse_weight_(weight, delta, sign=1, compute_device=compute, chunk_rows=rows, bounded=True,
                                 workspace=Workspace())
                    platform.synchronize(device)
                    runs.append(time.perf_counter() - start)
            except Exception as exc:  # e.g. out of memory on a full device: that side is not an option
                logger.info("LoRA side probe on %s failed (%s: %s)", compute or "cpu", type(exc).__name__, exc)
            timed.append(min(runs[1:]) if len(runs) == 4 else math.inf)
        _SIDE_TIMINGS[key] = (timed[0], timed[1])
        logger.info("LoRA fusion into host-resident %s weights, %dx%d rank %d: cpu %.2f ms, through %s %.2f ms",
                    dtype, rows, cols, rank, timed[0] * 1e3, device, timed[1] * 1e3)
    return _SIDE_TIMINGS[key]


def host_side(accelerator: torch.device | None, dtype: torch.dtype, preference: str = "auto") -> HostSide:
    """Where host-resident ``dtype`` weights are fused: ``preference`` (``lora_host_weights``) ``cpu`` or
    ``device`` decides; ``auto`` takes the faster side by ``side_timings``. No usable accelerator: the CPU."""
    if preference not in ("auto", "cpu", "device"):
        raise ValueError(f"lora_host_weights must be auto, cpu or device, got {preference!r}")
    if accelerator is None:
        return HostSide(None, "cpu: no usable accelerator")
    if preference != "auto":
        return HostSide(accelerator if preference == "device" else None,
                        f"{accelerator if preference == 'device' else 'cpu'}: lora_host_weights={preference}")
    cpu_s, device_s = side_timings(accelerator, dtype)
    faster = device_s < cpu_s
    return HostSide(accelerator if faster else None,
                    f"{accelerator if faster else 'cpu'}: measured faster for host "
                    f"{str(dtype).removeprefix('torch.')} weights (cpu {cpu_s * 1e3:.2f} ms, through {accelerator} "
                    f"{device_s * 1e3:.2f} ms per {_PROBE_SHAPE[0]}x{_PROBE_SHAPE[1]} rank-{_PROBE_SHAPE[2]} chunk)")


# ---- the module-level API ------------------------------------------------------------------------------
def _from_file(exc: Exception, delta: LoraDelta) -> Exception:
    """``exc`` (same type) naming the LoRA file and component of ``delta`` first, when known and not yet named,
    and the file keys the delta came from."""
    if not delta.origin or delta.origin in str(exc):
        return exc
    keys = f" (LoRA keys {', '.join(delta.source_keys[:4])})" if delta.source_keys else ""
    return type(exc)(f"{delta.origin}: {exc}{keys}")


def _is_factored(full_delta) -> bool:
    return full_delta is not None and not isinstance(full_delta, torch.Tensor)


def _target(module: nn.Module, modules: Mapping, params: Mapping, name: str, delta: LoraDelta) -> tuple:
    """``(name, weight, bias, delta)`` for one target, after every check that needs no arithmetic."""
    owner = modules.get(name)
    weight = getattr(owner, "weight", None) if owner is not None else params.get(name)
    bias = getattr(owner, "bias", None) if owner is not None else None
    if not isinstance(weight, torch.Tensor):
        raise LoraFusionError(f"LoRA target {name} is not a module with a weight nor a parameter of "
                              f"{type(module).__name__}")
    if type(weight.data) is not torch.Tensor or weight.device.type == "meta":
        raise LoraFusionError(f"{name}.weight is a {type(weight.data).__name__} on {weight.device}: fuse LoRA "
                              f"on plain materialized tensors, before sharding")
    if delta.A is not None and (weight.dim() != 2 or tuple(weight.shape) != (delta.B.shape[0], delta.A.shape[1])):
        raise LoraFusionError(f"{name}.weight is {tuple(weight.shape)} but B @ A is "
                              f"({delta.B.shape[0]}, {delta.A.shape[1]})")
    if delta.full_delta is not None and delta.full_delta.shape != weight.shape:
        raise LoraFusionError(f"{name}: full delta {tuple(delta.full_delta.shape)} vs weight {tuple(weight.shape)}")
    if delta.bias_delta is not None and (bias is None or delta.bias_delta.shape != bias.shape):
        raise LoraFusionError(f"{name}: bias delta {tuple(delta.bias_delta.shape)} but the module's bias is "
                              f"{None if bias is None else tuple(bias.shape)}")
    if _is_factored(delta.full_delta):
        bad = [i for i, t in enumerate(delta.full_delta.factors()) if not bool(torch.isfinite(t).all())]
        if bad:  # factors are small; a non-finite one would only be found after rows were written
            raise NonFiniteFusionError(f"the LoKr/LoHa delta for {name}.weight has non-finite factors (keys "
                                       f"{', '.join(delta.source_keys) or '?'}); nothing was written")
    return name, weight, bias, delta


def _targets(module: nn.Module, deltas: Mapping[str, LoraDelta]) -> list[tuple]:
    """Resolve and check every target before any write (names, shapes, devices, finite factors, bounds)."""
    modules, params = dict(module.named_modules()), dict(module.named_parameters())
    out = []
    for name, delta in deltas.items():
        try:
            out.append(_target(module, modules, params, name, delta))
        except LoraFusionError as exc:
            raise _from_file(exc, delta) from exc
    with_ab = [(name, weight, delta) for name, weight, _, delta in out if delta.A is not None]
    maxima = factor_maxima([delta for *_, delta in with_ab])
    bounded = {name: lora_bound(delta, weight.dtype, name, m) for (name, weight, delta), m in zip(with_ab, maxima)}
    return [(*target, bounded.get(target[0], False)) for target in out]


def _factors_moved(targets: list[tuple], max_bytes: int) -> Iterator[tuple]:
    """``targets`` in order, the host-resident ``A`` / ``B`` of weights on an accelerator moved there first, in
    batches of at most ``max_bytes`` through pinned staging (``staging.DeviceStaging``): one pageable copy per factor
    would block the host until the device reached it, serializing 800 copies with 400 fusions on a Wan2.2 expert."""
    batch: list[tuple] = []
    stagings: dict[torch.device, DeviceStaging | None] = {}

    def flush() -> Iterator[tuple]:
        device = batch[0][1].device
        if device not in stagings:
            stagings[device] = DeviceStaging.open(device, max_bytes=min(max_bytes, 64 << 20))
        moved = iter(to_device((f for t in batch for f in (t[3].A, t[3].B)), device, stagings[device]))
        for name, weight, bias, delta, bounded in batch:
            yield name, weight, bias, dataclasses.replace(delta, A=next(moved), B=next(moved)), bounded
        batch.clear()

    for target in targets:
        weight, delta = target[1], target[3]
        movable = (weight.device.type != "cpu" and delta.A is not None and delta.A.device.type == "cpu"
                   and delta.B.device.type == "cpu")
        if batch and (not movable or weight.device != batch[0][1].device
                      or sum(t[3].A.nbytes + t[3].B.nbytes for t in batch) + delta.A.nbytes > max_bytes):
            yield from flush()
        if movable:
            batch.append(target)
        else:
            yield target
    if batch:
        yield from flush()


def _apply_deltas(module: nn.Module, deltas: Mapping[str, LoraDelta], *, sign: int, chunk_mb: int,
                  check_finite: bool, log: bool = True, on_target: Callable[[], object] | None = None,
                  host_weights: str = "auto") -> FuseStats:
    """The one loop behind ``fuse_lora`` (sign=+1) and ``unfuse_lora`` (sign=-1)."""
    start = time.perf_counter()
    if chunk_mb <= 0:
        raise ValueError(f"chunk_mb must be positive, got {chunk_mb}")
    targets = _targets(module, deltas)
    accelerator = resolve_compute_device()  # once per call, shared by fuse and unfuse
    sides: dict[torch.dtype, HostSide] = {}  # per dtype of the host weights met, decided once per call
    workspace, warned = Workspace(), False
    used_accel, kernels_used = None, set()
    params = fallbacks = 0

    def rows_kernel(kernel: Callable[..., str], name: str, weight: torch.Tensor) -> None:
        """``kernel(compute_device=..., row_start=...)`` on the device rule's device, the CPU path from the first
        row not written back after an accelerator failure."""
        nonlocal used_accel, warned, fallbacks
        if weight.device.type != "cpu":
            device = weight.device
        else:
            if weight.dtype not in sides:
                sides[weight.dtype] = host_side(accelerator, weight.dtype, host_weights)
            device = sides[weight.dtype].device
        try:
            used = kernel(compute_device=device)
        except DeviceFailure as failure:
            fallbacks += 1
            if failure.rows_done:
                used_accel = used_accel or str(device)
            if not warned:
                warned = True
                logger.warning("LoRA fusion on %s failed for %s.weight %s (%s: %s); using the CPU path for it "
                               "(rows %d: onward) and for any later failure in this call", device, name,
                               tuple(weight.shape), type(failure.cause).__name__,
                               str(failure.cause).splitlines()[0], failure.rows_done)
            used = kernel(compute_device=None, row_start=failure.rows_done)
        if used == "device":
            used_accel = used_accel or str(device)
        else:
            kernels_used.add(used)

    with torch.no_grad():
        for name, weight, bias, delta, bounded in _factors_moved(targets, chunk_mb << 20):
            try:
                if delta.A is not None or _is_factored(delta.full_delta):  # 2-D weights fused by row chunks
                    chunk_rows = max(1, (chunk_mb << 20) // max(1, weight.shape[1] * weight.element_size()))
                if delta.A is not None:
                    rows_kernel(functools.partial(fuse_weight_, weight, delta, sign=sign, chunk_rows=chunk_rows,
                                                  name=name, workspace=workspace, bounded=bounded,
                                                  check_finite=check_finite), name, weight)
                    params += 1
                if _is_factored(delta.full_delta):
                    rows_kernel(functools.partial(fuse_factored_, weight, delta.full_delta, sign=sign,
                                                  chunk_rows=chunk_rows, name=name, workspace=workspace),
                                name, weight)
                    params += 1 if delta.A is None else 0
                elif delta.full_delta is not None:
                    add_full(weight, delta.full_delta, sign, f"{name}.weight")
                    params += 1 if delta.A is None else 0  # the weight is counted once
                if delta.bias_delta is not None:
                    add_full(bias, delta.bias_delta, sign, f"{name}.bias")
                    params += 1
                if on_target is not None:
                    on_target()
            except PartiallyFusedError as exc:
                raise _from_file(exc, delta) from exc
            except Exception as exc:
                if params:
                    raise _from_file(PartiallyFusedError(
                        f"LoRA fusion failed at {name} after {params} tensors of {type(module).__name__} were "
                        f"modified ({exc}); the module is partially fused, abort the load"), delta) from exc
                if isinstance(exc, LoraFusionError):
                    raise _from_file(exc, delta) from exc
                raise
    rule = "; ".join(side.why for side in sides.values()) if accelerator is not None and sides else None
    stats = FuseStats(used_accel or "cpu", "+".join(sorted(kernels_used)) or None, len(targets), params, fallbacks,
                      time.perf_counter() - start, rule)
    (logger.info if log else logger.debug)(
                "%s %d LoRA targets (%d tensors) of %s: compute %s, cpu kernel %s, %d fallbacks, %.2f s%s",
                "Fused" if sign > 0 else "Unfused", stats.targets, stats.params, type(module).__name__,
                stats.compute_device, stats.cpu_kernel, stats.fallbacks, stats.seconds,
                f"; host weights: {rule}" if rule else "")
    return stats


def fuse_lora(module: nn.Module, deltas: Mapping[str, LoraDelta], *, chunk_mb: int = 256,
              check_finite: bool = False, log: bool = True, on_target: Callable[[], object] | None = None,
              host_weights: str = "auto") -> FuseStats:
    """Add every delta to ``module``'s weights in place (see the module doc for the device rule, where
    ``host_weights`` -- ``lora_host_weights`` -- decides for host-resident weights, and what ``check_finite`` adds
    to the integrity checks that always run). ``log=False``: the summary line goes to DEBUG (callers fusing tensor
    by tensor log their own); ``on_target`` is called after each target (progress)."""
    return _apply_deltas(module, deltas, sign=+1, chunk_mb=chunk_mb, check_finite=check_finite, log=log,
                         on_target=on_target, host_weights=host_weights)


def unfuse_lora(module: nn.Module, deltas: Mapping[str, LoraDelta], *, chunk_mb: int = 256,
                check_finite: bool = False, host_weights: str = "auto") -> FuseStats:
    """Subtract what ``fuse_lora`` added (exact up to the weight dtype's rounding)."""
    return _apply_deltas(module, deltas, sign=-1, chunk_mb=chunk_mb, check_finite=check_finite,
                         host_weights=host_weights)


def fuse_lora_files(
    module: nn.Module,
    paths_and_scales: Iterable[tuple[str | Path, float]] | Mapping[str | Path, float],
    *,
    strict: bool = True,
    chunk_mb: int = 256,
    packed_modules: Mapping[str, Sequence[str]] | None = None,
    check_finite: bool = False,
    component: str | None = None,
    host_weights: str = "auto",
) -> FuseStats:
    """Load, normalize and validate every LoRA file first (``prepare_lora_files``; ``component`` names the module
    in its messages), then fuse them in order."""
    items = list(paths_and_scales.items() if isinstance(paths_and_scales, Mapping) else paths_and_scales)
    return fuse_prepared(module, prepare_lora_files(module, items, strict=strict, packed_modules=packed_modules,
                                                    component=component),
                         chunk_mb=chunk_mb, check_finite=check_finite, host_weights=host_weights)


def fuse_prepared(module: nn.Module, prepared: Sequence, *, chunk_mb: int = 256, check_finite: bool = False,
                  progress: bool | None = None, name: str = "", host_weights: str = "auto") -> FuseStats:
    """Fuse already validated LoRA files (``prepare.PreparedLora``, in order) into ``module``; a progress bar
    over targets per ``progress.progress_bar``."""
    bar = progress_bar(total=sum(len(lora.deltas) for lora in prepared), unit="targets", progress=progress,
                       desc=f"Fusing LoRA into {name or type(module).__name__}")
    try:
        return _fuse_in_order(module, prepared, chunk_mb, check_finite, bar.update if bar is not None else None,
                              host_weights)
    finally:
        if bar is not None:
            bar.close()


def _fuse_in_order(module: nn.Module, prepared: Sequence, chunk_mb: int, check_finite: bool, on_target,
                   host_weights: str) -> FuseStats:
    total = None
    for i, lora in enumerate(prepared):
        try:
            stats = fuse_lora(module, lora.deltas, chunk_mb=chunk_mb, check_finite=check_finite, on_target=on_target,
                              host_weights=host_weights)
        except Exception as exc:
            if i == 0 or isinstance(exc, PartiallyFusedError):
                raise
            raise PartiallyFusedError(f"fusing {lora.path} failed after {i} LoRA file(s) were fused ({exc}); the "
                                      f"module is partially fused, abort the load") from exc
        logger.info("Fused LoRA %s into %s (%d targets)", lora.path, type(module).__name__, stats.targets)
        total = stats if total is None else total + stats
    return total or FuseStats("cpu", None, 0, 0, 0, 0.0)
