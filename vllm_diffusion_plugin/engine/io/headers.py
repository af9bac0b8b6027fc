"""Safetensors and pickle headers: every tensor's file, offset, shape and dtype, with no data byte read.

A truncated, corrupt or unsupported file fails here naming the file; the headers let a load validate a whole
checkpoint against a module, and a reader find a tensor's rows, before it copies a byte.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from vllm_diffusion_plugin.engine.errors import CheckpointError
from vllm_diffusion_plugin.engine.io.threads import bounded

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


# safetensors dtype strings -> torch dtypes (only the ones this torch build has)
SAFETENSORS_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    name: getattr(torch, attr) for name, attr in (
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
        ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"),
        ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("BOOL", "bool"),
        ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu"),
        ("C64", "complex64"),
    ) if hasattr(torch, attr)
})


@dataclass(frozen=True)
class TensorInfo:
    """One checkpoint tensor as its file's header describes it (no data read)."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0
    """Start of the tensor's bytes in the file's data section (safetensors); 0 for pickle files."""

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Key -> TensorInfo from a safetensors header, in data order; only the header bytes are read, waited for at
    most the read timeout (``threads.bounded``: a store that stopped answering is named, not waited on forever).

    Raises CheckpointError naming ``path`` for a truncated, corrupt or unsupported file.
    """
    return bounded(f"{path} (reading its header)", _read_header, path)


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, shorter than its 8-byte "
                                      f"header length); the file is truncated or empty")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path}: corrupt safetensors header (declares {header_len} header bytes, "
                                      f"file has {size} bytes); the file is truncated or not safetensors")
            header = json.loads(f.read(header_len))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read the safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start, data_end, infos = 8 + header_len, 0, {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype_name, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header entry for key {key!r}: {entry!r}") from exc
        if dtype_name not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: key {key!r} has dtype {dtype_name}, which this torch build "
                                  f"cannot load (known: {', '.join(SAFETENSORS_DTYPES)})")
        info = TensorInfo(file=path, shape=tuple(int(d) for d in shape), dtype=SAFETENSORS_DTYPES[dtype_name],
                          offset=int(start))
        if end - start != info.nbytes:
            raise CheckpointError(f"{path}: corrupt header: key {key!r} has shape {list(info.shape)} "
                                  f"{dtype_name} ({info.nbytes} bytes) but spans {end - start} bytes")
        infos[key] = info
        data_end = max(data_end, int(end))
    if data_start + data_end > size:
        raise CheckpointError(f"{path}: truncated safetensors file: its header says the data ends at byte "
                              f"{data_start + data_end}, the file has {size} bytes")
    # The library's own checks (overlaps, gaps, alignment) on top of ours; it too reads only the header.
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as exc:
        raise CheckpointError(f"{path}: invalid safetensors file: {exc}") from exc
    return dict(sorted(infos.items(), key=lambda item: item[1].offset))


def read_pickle_manifest(path: Path) -> dict[str, TensorInfo]:
    """Key -> TensorInfo from a pickle checkpoint via ``torch.load(weights_only=True, mmap=True)``."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot load with torch.load(weights_only=True): {exc}") from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a state dict of tensors (got {type(state).__name__})")
    return {key: TensorInfo(file=path, shape=tuple(t.shape), dtype=t.dtype) for key, t in state.items()}
