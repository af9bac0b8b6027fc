"""Shared fixtures: tiny diffusers checkpoints written by diffusers itself (no hub access).

The builders live in ``vllm_diffusion_plugin.tiny.models`` (also used by ``vllm-diffusion demo``);
these fixtures cache what they write per test session.

Session-scoped, read-only by convention (copy before mutating, e.g. with ``copy_checkpoint``):

- ``tiny_wan_dir``: a Wan2.2-style pipeline folder: ``model_index.json``, ``transformer/`` and
  ``transformer_2/`` (``WanTransformer3DModel``, different weights), each saved with diffusers'
  ``save_pretrained(max_shard_size=...)`` so it has an index and >= 3 shards. fp32.
- ``tiny_flux_dir``: the same for ``FluxTransformer2DModel`` (``transformer/`` only).
- ``tiny_checkpoint_factory(kind, *, dtype=torch.float32, seed=0, safe_serialization=True)``: builds (once
  per argument set) and returns such a pipeline folder; ``kind`` is "wan" or "flux".
- ``tiny_model_inputs(kind, dtype=torch.float32)``: forward kwargs for the tiny models (deterministic).
- ``copy_checkpoint(src) -> Path``: a private copy under the test's tmp_path, safe to break.

Every parameter is filled with seeded random values (none left at 0/1 by the default init), so a weight
that a loader forgets to load is visible in an equality check.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from vllm_diffusion_plugin.tiny.models import TINY_CONFIGS, build_tiny_model, write_tiny_pipeline

__all__ = ["TINY_CONFIGS", "build_tiny_model", "model_inputs", "write_tiny_pipeline"]


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory) -> Callable[..., Path]:
    cache: dict[tuple, Path] = {}

    def make(kind: str, *, dtype: torch.dtype = torch.float32, seed: int = 0,
             safe_serialization: bool = True) -> Path:
        key = (kind, dtype, seed, safe_serialization)
        if key not in cache:
            tag = f"{kind}-{str(dtype).removeprefix('torch.')}-s{seed}{'' if safe_serialization else '-bin'}"
            cache[key] = write_tiny_pipeline(tmp_path_factory.mktemp(tag), kind, dtype=dtype, seed=seed,
                                             safe_serialization=safe_serialization)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_wan_dir(tiny_checkpoint_factory) -> Path:
    return tiny_checkpoint_factory("wan")


@pytest.fixture(scope="session")
def tiny_flux_dir(tiny_checkpoint_factory) -> Path:
    return tiny_checkpoint_factory("flux")


@pytest.fixture
def copy_checkpoint(tmp_path) -> Callable[[Path], Path]:
    def copy(src: Path) -> Path:
        dst = tmp_path / f"copy-{src.name}"
        shutil.copytree(src, dst)
        return dst

    return copy


def model_inputs(kind: str, dtype: torch.dtype = torch.float32) -> dict:
    gen = torch.Generator().manual_seed(7)
    if kind == "wan":
        cfg = TINY_CONFIGS["wan"]
        return dict(hidden_states=torch.randn(1, cfg["in_channels"], 2, 4, 4, generator=gen).to(dtype),
                    timestep=torch.tensor([500]),
                    encoder_hidden_states=torch.randn(1, 8, cfg["text_dim"], generator=gen).to(dtype),
                    return_dict=False)
    cfg = TINY_CONFIGS["flux"]
    return dict(hidden_states=torch.randn(1, 16, cfg["in_channels"], generator=gen).to(dtype),
                encoder_hidden_states=torch.randn(1, 8, cfg["joint_attention_dim"], generator=gen).to(dtype),
                pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=gen).to(dtype),
                timestep=torch.tensor([0.5], dtype=dtype),
                img_ids=torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                                   indexing="ij"), -1).reshape(16, 3),
                txt_ids=torch.zeros(8, 3), return_dict=False)


@pytest.fixture(scope="session")
def tiny_model_inputs() -> Callable[..., dict]:
    return model_inputs
