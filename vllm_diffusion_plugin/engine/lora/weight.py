"""One weight: ``W[rows] += s * B @ A`` in place, in row chunks, on the CPU or an accelerator, with the CPU
kernel choice and the integrity rule. ``fuse.py`` applies it to every LoRA target of a module (device rule).

CPU rule (``cpu_kernel(dtype)``). A bf16/fp16 GEMM on a CPU without fast low-precision kernels takes
seconds per 5120^2 layer (the 22 min per Wan2.2 transformer seen on a Kunpeng host), so:

- ``"native"``: in-place ``W.addmm_(B, A, alpha=s)`` in the weight's dtype, row chunk by row chunk, when
  oneDNN is available and enabled *and* a one-time micro-probe (cached per process, per dtype and oneDNN
  state) shows that dtype's GEMM within 2x of the fp32 one; used only when ``A``/``B`` share the weight's
  dtype and ``|s| * r * max|A| * max|B|`` cannot overflow it;
- ``"fp32-chunks"`` otherwise: rows upcast into one reused fp32 buffer, ``addmm_`` there, checked (when
  the integrity rule below asks), written back (no fresh full-size temporaries; buffers are reused across the weights of a call).

Integrity without a second pass over every weight. A fused weight ``W + s * B @ A`` can be non-finite only
through (1) a non-finite ``A``, ``B`` or ``s``, (2) an overflow of the delta, or (3) a bad base weight (NaN/inf,
or within the delta's bound of the dtype's max). Per target, before any weight of the call is written
(``lora_bound``):

1. ``max|A|``, ``max|B|`` and ``s`` are read (A and B are small): non-finite -> ``NonFiniteFusionError``
   naming the factor, nothing written;
2. the bound ``|s| * r * max|A| * max|B|`` (no entry of the delta exceeds it) is compared with half the
   weight dtype's max: a weight whose bound may overflow goes through the fp32 path, every chunk checked
   before it is written (``NonFiniteFusionError`` naming the rows);
3. a bounded delta cannot turn a finite base weight of magnitude below ``max / 2`` non-finite, so a bounded
   target is fused in place with no check: NaN/inf in the base weight stays NaN/inf exactly where it was
   (fusion neither creates nor spreads it; the unfused model carries it too). ``check_finite=True``
   (``lora_check_finite`` / ``VLLM_DIFFUSION_LORA_CHECK_FINITE``) checks every fused chunk anyway, which
   also catches (3) -- one extra reduction over each weight.

The device path follows the same rule: a bounded target in the weight's dtype is fused with an in-place
``addmm_`` (the HBM floor: each weight byte read and written once); the others in fp32, checked. A check
failing after rows were written raises ``PartiallyFusedError`` (the load must be aborted), as does any
failure once a weight of the call was modified.

A LoKr / LoHa delta (``lycoris.FactoredDelta``) goes through the same row loops (``fuse_factored_``): its rows
are materialized in fp32 where the fusion runs, chunk by chunk, and every chunk is checked before it is written
(no bound is derived for it), so no full-size delta exists anywhere.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine import platform
from vllm_diffusion_plugin.engine.lora.types import LoraDelta

logger = init_logger(__name__)

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_CPU_CHUNK_BYTES = 5 << 20  # fp32 rows per CPU chunk: ~5 MiB stays cache-resident between addmm_ and check


class LoraFusionError(RuntimeError):
    """Fusion failed before any weight of this call was modified."""


class NonFiniteFusionError(LoraFusionError):
    """A fused weight would hold NaN or inf."""


class PartiallyFusedError(LoraFusionError):
    """Fusion failed after some weights were modified: the module is partially fused; abort the load."""


class DeviceFailure(Exception):
    """The accelerator failed (H2D copy or matmul) for one CPU weight; ``rows_done`` rows were written back."""

    def __init__(self, rows_done: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.rows_done, self.cause = rows_done, cause


# ---- CPU kernel choice ---------------------------------------------------------------------------------
_FAST_LOWP: dict[tuple[torch.dtype, bool], bool] = {}


def _lowp_gemm_is_fast(dtype: torch.dtype) -> tuple[bool, float, float]:
    """One-thread micro-probe: ``(fast, best ms in dtype, best ms in fp32)`` for ``C(256x1024) += B(256x64) @ A``.

    One thread, best of several runs, so other processes on the host barely move the ratio; a slow
    (scalar) kernel is 50-300x slower than fp32, a fast one is faster than fp32, hence the 2x threshold.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        operands = [torch.randn(shape, generator=gen) for shape in ((256, 1024), (256, 64), (64, 1024))]

        def best_ms(dt: torch.dtype, reps: int, give_up: float = math.inf) -> float:
            c, b, a = (t.to(dt) for t in operands)
            c.addmm_(b, a, alpha=1e-3)  # warm-up: oneDNN primitive creation
            best = math.inf
            for _ in range(reps):
                start = time.perf_counter()
                c.addmm_(b, a, alpha=1e-3)
                best = min(best, (time.perf_counter() - start) * 1e3)
                if best > give_up:
                    break
            return best

        fp32 = best_ms(torch.float32, 5)
        low = best_ms(dtype, 5, give_up=20 * fp32)
    finally:
        torch.set_num_threads(threads)
    return low <= 2.0 * fp32, low, fp32


def cpu_kernel(dtype: torch.dtype) -> str:
    """``"native"`` when in-place GEMM in ``dtype`` is fast on this CPU, else ``"fp32-chunks"`` (see module doc)."""
    if dtype not in _LOW_PRECISION:
        return "fp32-chunks"
    onednn = bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)
    key = (dtype, onednn)
    if key not in _FAST_LOWP:
        fast = False
        if onednn:
            fast, low, fp32 = _lowp_gemm_is_fast(dtype)
            logger.info("CPU %s GEMM probe: %.3f ms vs fp32 %.3f ms -> LoRA CPU kernel %s", dtype, low, fp32,
                        "native" if fast else "fp32-chunks")
        _FAST_LOWP[key] = fast
    return "native" if _FAST_LOWP[key] else "fp32-chunks"


# ---- one weight --------------------------------------------------------------------------------------------
@dataclass
class Workspace:
    """Buffers reused across the weights of one call (no full-size temporaries per layer)."""

    buffers: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    pinned: torch.Tensor | None = None
    """Page-locked bytes host rows cross to and from an accelerator through (``pinned_like``)."""
    pinned_failed: bool = False

    def rows(self, n: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < n * cols:
            buf = self.buffers[dtype] = torch.empty(n * cols, dtype=dtype)
        return buf[: n * cols].view(n, cols)

    def pinned_like(self, t: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """A page-locked host tensor shaped like ``t`` (reused), or None when pinned memory cannot be had for
        ``device`` (then rows cross from pageable memory, as before)."""
        nbytes = t.numel() * t.element_size()
        if self.pinned is None or self.pinned.numel() < nbytes:
            if self.pinned_failed:
                return None
            try:
                self.pinned = platform.pinned_empty(nbytes, device)
            except Exception as exc:
                self.pinned_failed = True
                logger.info("No page-locked staging for LoRA rows on %s (%s): rows cross from pageable memory",
                            device, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                return None
        return self.pinned[:nbytes].view(t.dtype).view(t.shape)


def _finite(t: torch.Tensor, dst_dtype: torch.dtype) -> bool:
    """Whether ``t`` is finite and fits ``dst_dtype``; one reduction, exact."""
    low, high = torch.aminmax(t)
    low, high = float(low), float(high)  # NaN propagates through aminmax
    limit = torch.finfo(dst_dtype).max
    return -limit <= low and high <= limit


def _abs_maxima(factors: list[torch.Tensor], device: torch.device) -> list[float]:
    """``max|t|`` of each tensor (NaN if it holds a NaN, inf if an inf), with one read-back.

    On an accelerator one fused ``_foreach_norm`` (a single launch over every factor). On the CPU one
    ``aminmax`` per factor instead: ``_foreach_norm(inf)`` takes a slow generic path there (1.7 ms for a
    rank-64, 5120-wide bf16 pair vs 0.06 ms -- 20% of the in-place fusion of that 5120^2 layer)."""
    if device.type != "cpu":
        norms = torch._foreach_norm(factors, math.inf)
        if len({n.dtype for n in norms}) == 1:  # one launch for the stack and one cast, not one cast per factor
            return torch.stack(norms).float().tolist()
        return torch.stack([n.float() for n in norms]).tolist()
    values = []
    for t in factors:  # read back per factor: a CPU read-back is no sync, and stacking costs more ops than it saves
        low, high = (end.item() for end in torch.aminmax(t)) if t.numel() else (0.0, 0.0)
        values.append(math.nan if math.isnan(low) or math.isnan(high) else max(-low, high))
    return values


def factor_maxima(deltas: Sequence[LoraDelta]) -> list[tuple[float, float]]:
    """``(max|A|, max|B|)`` of every delta (NaN if any entry is NaN): one read-back per device, not two device
    syncs per target (400 of them would cost more than fusing on a GPU)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, delta in enumerate(deltas):
        by_device.setdefault(delta.A.device, []).append(i)
    maxima: list[tuple[float, float]] = [(0.0, 0.0)] * len(deltas)
    for device, indices in by_device.items():
        factors = [t for i in indices for t in (deltas[i].A, deltas[i].B.to(device))]
        values = _abs_maxima(factors, device)
        for k, i in enumerate(indices):
            maxima[i] = (values[2 * k], values[2 * k + 1])
    return maxima


def lora_bound(delta: LoraDelta, dtype: torch.dtype, name: str, maxima: tuple[float, float] | None = None) -> bool:
    """Cases 1 and 2 of the module doc: raises on a non-finite ``A``/``B``/scale (nothing written); returns
    whether the delta is bounded well inside ``dtype`` (no entry above half its max), i.e. needs no check."""
    amax_a, amax_b = maxima or factor_maxima([delta])[0]
    bad = [what for what, value in (("lora_A", amax_a), ("lora_B", amax_b), ("scale", delta.scale))
           if not math.isfinite(value)]
    if bad:
        raise NonFiniteFusionError(f"{delta.origin + ': ' if delta.origin else ''}the LoRA for {name}.weight has "
                                   f"non-finite {' and '.join(bad)} (keys {', '.join(delta.source_keys) or '?'}); "
                                   f"nothing was written")
    return abs(delta.scale) * delta.rank * amax_a * amax_b < torch.finfo(dtype).max / 2


def fuse_weight_(
    weight: torch.Tensor,
    delta: LoraDelta,
    *,
    sign: int,
    compute_device: torch.device | None,
    chunk_rows: int,
    name: str = "",
    row_start: int = 0,
    workspace: Workspace | None = None,
    bounded: bool | None = None,
    check_finite: bool = False,
) -> str:
    """``weight[row_start:] += sign * delta.scale * B @ A`` in place, in row chunks; returns the kernel used.

    ``compute_device``: where the matmul runs -- the weight's own device, or an accelerator for a CPU
    weight, or None for the CPU path. ``bounded``: ``lora_bound``'s answer (computed here when None);
    ``check_finite``: check every chunk (module doc). Raises ``DeviceFailure`` when the accelerator fails for a
    CPU weight (``rows_done`` rows were written back), ``NonFiniteFusionError`` before writing a non-finite
    chunk, ``PartiallyFusedError`` when this weight was partly written and cannot be completed.
    """
    if bounded is None:
        bounded = lora_bound(delta, weight.dtype, name)
    alpha = sign * delta.scale
    rows = weight.shape[0]
    same_dtype = delta.A.dtype == delta.B.dtype == weight.dtype
    if compute_device is not None and compute_device.type != "cpu":
        in_place = same_dtype and bounded and not check_finite
        if (in_place and row_start == 0 and chunk_rows >= rows and weight.device == compute_device
                and delta.A.device == delta.B.device == compute_device):
            # the common case on a device (weight and factors there, one chunk): one kernel, each weight byte read
            # and written once, and no Python around it -- per-target overhead, not the kernel, bounds this path
            weight.addmm_(delta.B, delta.A, alpha=alpha)
            return "device"
        return _fuse_on_device(weight, _ab_update(delta, alpha), compute_device, chunk_rows, name, row_start,
                               workspace or Workspace(), in_place=in_place, check=not in_place)
    workspace = workspace or Workspace()
    kernel = cpu_kernel(weight.dtype)
    if kernel == "native" and not (same_dtype and bounded):
        kernel = "fp32-chunks"  # exactness first: mixed dtypes or a possible overflow use the fp32 path
    if kernel == "native":
        for r0 in range(row_start, rows, chunk_rows):
            r1 = min(rows, r0 + chunk_rows)
            chunk = weight[r0:r1]
            chunk.addmm_(delta.B[r0:r1], delta.A, alpha=alpha)
            if check_finite and not _finite(chunk, weight.dtype):  # bounded delta: the base rows were not finite
                raise PartiallyFusedError(f"{name}.weight rows {r0}:{r1} are NaN/inf after fusing (is the base "
                                          f"weight finite?); the module is partially fused, abort the load")
        return kernel
    _fuse_cpu_fp32(weight, _ab_update(delta, alpha), chunk_rows, name, row_start, workspace,
                   check=check_finite or not bounded)
    return kernel


def fuse_factored_(weight: torch.Tensor, delta, *, sign: int, compute_device: torch.device | None, chunk_rows: int,
                   name: str = "", row_start: int = 0, workspace: Workspace | None = None) -> str:
    """``weight[row_start:] += sign * delta`` for a ``lycoris.FactoredDelta``: its rows are materialized in fp32 on
    ``compute_device`` (the weight's own device or an accelerator; None: the CPU), chunk by chunk, each chunk
    checked before it is written. Raises as ``fuse_weight_``; returns ``"device"`` or ``"fp32-chunks"``."""
    def prepare(device: torch.device, dtype: torch.dtype):
        rows = delta.rows_on(device, dtype)
        return lambda acc, r0, r1: acc.add_(rows(r0, r1), alpha=sign)

    if compute_device is not None and compute_device.type != "cpu":
        return _fuse_on_device(weight, prepare, compute_device, chunk_rows, name, row_start,
                               workspace or Workspace(), in_place=False, check=True)
    _fuse_cpu_fp32(weight, prepare, chunk_rows, name, row_start, workspace or Workspace(), check=True)
    return "fp32-chunks"


def _ab_update(delta: LoraDelta, alpha: float):
    """``prepare(device, dtype) -> update(acc, r0, r1)``: ``acc += alpha * B[r0:r1] @ A`` with the factors there."""
    def prepare(device: torch.device, dtype: torch.dtype):
        a, b = delta.A.to(device=device, dtype=dtype), delta.B.to(device=device, dtype=dtype)
        return lambda acc, r0, r1: acc.addmm_(b[r0:r1], a, alpha=alpha)

    return prepare


def _fuse_cpu_fp32(weight: torch.Tensor, prepare, chunk_rows: int, name: str, row_start: int, workspace: Workspace,
                   *, check: bool) -> None:
    """The CPU ``fp32-chunks`` kernel: rows upcast into one reused buffer, updated, checked, written back."""
    compute = torch.promote_types(weight.dtype, torch.float32)
    update = prepare(torch.device("cpu"), compute)
    rows = weight.shape[0]
    step = max(1, min(chunk_rows, _CPU_CHUNK_BYTES // max(1, weight.shape[1] * 4)))
    for r0 in range(row_start, rows, step):
        r1 = min(rows, r0 + step)
        buf = workspace.rows(r1 - r0, weight.shape[1], compute)
        buf.copy_(weight[r0:r1])
        update(buf, r0, r1)
        if check and not _finite(buf, weight.dtype):
            _raise_non_finite(name, r0, r1, written=r0 > 0)  # rows before row_start: fused on the device
        weight[r0:r1].copy_(buf)


def _raise_non_finite(name: str, r0: int, r1: int, *, written: bool) -> None:
    message = f"fusing the LoRA into {name}.weight would make rows {r0}:{r1} NaN/inf"
    if written:
        raise PartiallyFusedError(f"{message}; earlier rows were already fused: the module is partially fused, "
                                  f"abort the load")
    raise NonFiniteFusionError(f"{message}; nothing of this weight was written")


def _fuse_on_device(weight, prepare, device, chunk_rows, name, row_start, workspace, *, in_place, check) -> str:
    """Fuse on ``device``: for a weight living there, rows in place; else rows staged H2D through the workspace's
    page-locked buffer, fused, copied back through it.
    ``prepare(device, dtype)`` moves the factors there and returns ``update(acc, r0, r1)``. ``in_place``: the
    update in the weight's dtype straight into the (staged) rows, unchecked (a bounded delta, module doc); else
    in fp32, each chunk checked before it is written."""
    on_host = weight.device.type == "cpu"
    rows, done = weight.shape[0], row_start
    compute = weight.dtype if in_place else torch.promote_types(weight.dtype, torch.float32)
    try:
        update = prepare(device, compute)
    except Exception as exc:
        if on_host:
            raise DeviceFailure(done, exc) from exc
        raise
    for r0 in range(row_start, rows, chunk_rows):
        r1 = min(rows, r0 + chunk_rows)
        try:
            staged = _to_device(weight[r0:r1], device, workspace) if on_host else weight[r0:r1]
            if in_place:
                acc = staged
            else:
                acc = staged.to(compute) if staged.dtype != compute else staged if on_host else staged.clone()
            update(acc, r0, r1)
            result = acc.to(weight.dtype) if acc.dtype != weight.dtype else acc
            ok = not check or _finite(result, weight.dtype)
        except Exception as exc:
            if on_host:
                raise DeviceFailure(done, exc) from exc
            if done > 0 or in_place:
                raise PartiallyFusedError(f"{name}.weight failed on {device} after rows 0:{done} "
                                          f"were fused: {exc}; abort the load") from exc
            raise
        if not ok:
            _raise_non_finite(name, r0, r1, written=done > 0)
        if on_host or not in_place:  # in place on the device: the rows are already written
            try:
                _to_host(result, weight[r0:r1], device, workspace) if on_host else weight[r0:r1].copy_(result)
            except Exception as exc:
                raise PartiallyFusedError(f"copying fused rows {r0}:{r1} of {name}.weight back from {device} "
                                          f"failed ({exc}); the weight may be half-written, abort the load") from exc
        done = r1
    return "device"


def _to_device(rows: torch.Tensor, device: torch.device, workspace: Workspace) -> torch.Tensor:
    """Host rows on ``device``: copied into the page-locked buffer, then to the device without blocking."""
    pinned = workspace.pinned_like(rows, device)
    if pinned is None:
        return rows.to(device)
    pinned.copy_(rows)
    return pinned.to(device, non_blocking=True)


def _to_host(result: torch.Tensor, rows: torch.Tensor, device: torch.device, workspace: Workspace) -> None:
    """Device ``result`` into the host ``rows``, through the page-locked buffer (the H2D copy from it was issued
    before on the same stream, so it has completed by then)."""
    pinned = workspace.pinned_like(rows, device)
    if pinned is None:
        rows.copy_(result)
        return
    pinned.copy_(result, non_blocking=True)
    platform.synchronize(device)
    rows.copy_(pinned)


def add_full(target: torch.Tensor, delta: torch.Tensor, sign: int, name: str) -> None:
    """``target += sign * delta`` (bias or full delta), checked before writing."""
    compute = torch.promote_types(target.dtype, torch.float32)
    result = target.to(compute) + sign * delta.to(device=target.device, dtype=compute)
    if not _finite(result, target.dtype):
        raise NonFiniteFusionError(f"adding the LoRA full/bias delta to {name} would make it NaN/inf")
    target.copy_(result)
