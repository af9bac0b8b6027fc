"""The FP8 arithmetic every quantized path shares: quantize with a scale, dequantize, and a LoRA delta fused exactly
into FP8 rows (``checkpoints`` and ``fuse`` apply it to the FP8 checkpoints a load reads).

A ModelOpt / vLLM-serialized FP8 weight is ``q`` (``float8_e4m3fn``, ``[out, in]``) with a scale: one per tensor
(0-dim) or one per output channel (``[out, 1]``); its value is ``q * scale``. Adding a LoRA delta exactly means
dequantizing, adding in fp32 and requantizing with a scale recomputed from the fused tensor -- the old scale may
no longer cover the fused amax, and reusing it would clip:

    w = q.float() * scale + delta           (fp32)
    scale' = amax(|w|) / 448                (per channel: each row's; per tensor: the whole tensor's)
    q' = fp8(clamp(w / scale'))

Per channel, a rank's rows carry their own amax. Per tensor, the ranks holding the rows agree on the whole
tensor's amax with one ``all_reduce(MAX)`` (``agree``), as ``quant_shards`` does for online quantization; the
result is then bit-identical to fusing the whole tensor in one process, and every element is within one FP8 step
(at its magnitude, times ``scale'``) of the exact fp32 sum.

What vllm-omni's distill-LoRA loader does to such a parameter (``diffusion/lora/loader.py``:
``params.add_(delta.to(params.dtype))``) is :func:`storage_unit_add`: the delta rounded to FP8 and added to the
stored ``q`` with no scale, i.e. as if it were in units of ``scale``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q * scale`` in fp32 (``scale``: 0-dim or ``[rows, 1]``)."""
    return q.float() * scale.float()


def fuse_fp8_rows(q: torch.Tensor, scale: torch.Tensor, delta: torch.Tensor, *, per_tensor: bool,
                  agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q', scale')``: ``delta`` (these rows, any float dtype) fused exactly into FP8 rows ``q`` with ``scale``.
    ``agree(amax)`` (per tensor, sharded rows): the whole tensor's amax from this rank's, e.g. :func:`max_over`.
    Computed over row chunks (:func:`row_chunks`): the fused rows are never whole in fp32 (per tensor they are
    computed twice, for the amax and for the quantization); elementwise per row, so no bit changes."""
    if tuple(delta.shape) != tuple(q.shape):
        raise ValueError(f"LoRA delta {tuple(delta.shape)} does not fit the FP8 rows {tuple(q.shape)}")
    if not per_tensor and tuple(scale.shape) != (q.shape[0], 1):
        raise ValueError(f"per-channel scale {tuple(scale.shape)} does not fit the FP8 rows {tuple(q.shape)}: "
                         f"expected ({q.shape[0]}, 1)")
    if per_tensor and scale.numel() != 1:
        raise ValueError(f"per-tensor scale has {scale.numel()} elements, expected one")
    scale = scale.reshape(()) if per_tensor else scale

    def fused(rows: slice) -> torch.Tensor:
        return dequantize(q[rows], scale if per_tensor else scale[rows]) + delta[rows].float()

    chunks = row_chunks(q)
    new_q = torch.empty(q.shape, dtype=dtype, device=q.device)
    if per_tensor:
        amax = torch.stack([fused(c).abs().amax() for c in chunks]).amax() if q.numel() else \
            torch.zeros((), device=q.device)
        if agree is not None:
            amax = agree(amax)
        _check_finite(amax)
        for c in chunks:
            new_q[c] = quantize(fused(c), amax, dtype)[0]
        return new_q, quantize(q[:0].float(), amax, dtype)[1]
    new_scale = torch.empty(scale.shape, dtype=torch.float32, device=q.device)
    for c in chunks:
        rows = fused(c)
        amax = rows.abs().amax(dim=1, keepdim=True)
        _check_finite(amax)
        new_q[c], new_scale[c] = quantize(rows, amax, dtype)
    return new_q, new_scale


def _check_finite(amax: torch.Tensor) -> None:
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("fusing the LoRA into the FP8 weight gave non-finite values; nothing was changed")


CHUNK_ELEMENTS = 1 << 18
"""Elements of the row chunks the FP8 statistic and (re)quantization run over (bounds their fp32 temporaries)."""


def row_chunks(rows: torch.Tensor) -> list[slice]:
    """Row slices of ``rows`` (``[rows, ...]``) of about :data:`CHUNK_ELEMENTS` elements each (at least one row)."""
    step = max(1, CHUNK_ELEMENTS // max(1, rows[0].numel() if rows.dim() and rows.shape[0] else 1))
    return [slice(i, i + step) for i in range(0, rows.shape[0], step)]


def quantize(rows: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``rows`` quantized to ``dtype`` with ``scale = amax / max(dtype)`` (``amax``: 0-dim, or
    ``[rows, 1]``). The one rounding every FP8 path here shares: online quantization (whole tensors or a rank's
    rows) and the requantization after a LoRA fusion."""
    info = torch.finfo(dtype)
    scale = amax.clamp(min=1e-12) / info.max
    return (rows / scale).clamp(info.min, info.max).to(dtype), scale


def max_over(group=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``agree`` for :func:`fuse_fp8_rows`: the max of every rank's amax in ``group`` (one ``all_reduce(MAX)``
    of 4 bytes)."""
    import torch.distributed as dist

    def agree(amax: torch.Tensor) -> torch.Tensor:
        value = amax.detach().float().reshape(1).clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return value.reshape(())

    return agree


def fp8_step(values: torch.Tensor, dtype: torch.dtype = FP8) -> torch.Tensor:
    """The spacing of ``dtype`` at each of ``values`` (FP8 units): the distance to the next representable
    magnitude (subnormal spacing below the smallest normal)."""
    info = torch.finfo(dtype)
    mantissa = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
    magnitude = values.abs().float().clamp(min=info.smallest_normal)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa)


def storage_unit_add(q: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """What ``params.add_(delta.to(params.dtype))`` asks of an FP8 parameter, computed where the kernel exists
    (torch has no FP8 ``add_`` on the CPU): the delta rounded to FP8 and added to the stored values, the sum
    rounded to FP8 -- no scale anywhere, so the delta counts as ``delta * scale``."""
    return (q.float() + delta.to(q.dtype).float()).to(q.dtype)
