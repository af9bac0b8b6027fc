"""The bucket plan of a ``broadcast`` load: the tensors the checkpoint fills, in read order, cut into flat
single-dtype buckets; every rank derives the same plan from the headers and its skeleton, and the ranks compare its
digest before a byte is sent."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    """A run of one tensor's flattened elements inside a bucket."""

    key: str
    start: int
    """First element of the key's flattened tensor in this segment."""
    length: int
    offset: int
    """Where the segment starts in the bucket (elements of the bucket's dtype)."""


@dataclass(frozen=True)
class Bucket:
    """One broadcast: a flat run of elements of a single dtype."""

    dtype: torch.dtype
    numel: int
    segments: tuple[Segment, ...]
    ready_after: int
    """Index (in the plan's key order) of the key after whose read (and fusion) the bucket can be sent."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_buckets(entries: Sequence[tuple[str, int, torch.dtype]], *, bucket_bytes: int) -> list[Bucket]:
    """Cut ``(key, numel, dtype)`` entries (in read order) into single-dtype buckets of <= ``bucket_bytes``.

    One bucket per dtype is open at a time; it is emitted when full (``ready_after`` = the key that filled
    it), the rest at the end (``ready_after`` = the last key), in order of each dtype's first appearance.
    Deterministic: every rank computes the same plan from the same headers and skeleton.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    open_: dict[torch.dtype, list[Segment]] = {}
    fill: dict[torch.dtype, int] = {}
    plan: list[Bucket] = []
    for index, (key, numel, dtype) in enumerate(entries):
        cap = max(1, bucket_bytes // dtype.itemsize)
        segments = open_.setdefault(dtype, [])
        pos = 0
        while pos < numel:
            take = min(cap - fill.get(dtype, 0), numel - pos)
            segments.append(Segment(key, pos, take, fill.get(dtype, 0)))
            fill[dtype] = fill.get(dtype, 0) + take
            pos += take
            if fill[dtype] == cap:
                plan.append(Bucket(dtype, cap, tuple(segments), index))
                segments.clear()
                fill[dtype] = 0
    for dtype, segments in open_.items():
        if segments:
            plan.append(Bucket(dtype, fill[dtype], tuple(segments), len(entries) - 1))
    return plan


def plan_digest(plan: Sequence[Bucket]) -> str:
    """A short hash of the plan (keys, dtypes, element ranges), compared across ranks in the handshake."""
    h = hashlib.sha1()
    for bucket in plan:
        h.update(f"{bucket.dtype}|{bucket.numel}|{bucket.ready_after}|".encode())
        for s in bucket.segments:
            h.update(f"{s.key}:{s.start}:{s.length}:{s.offset};".encode())
    return h.hexdigest()[:16]
