"""Faults during a load under vllm-omni (issue 36): a DiT shard truncated, or replaced by a file of the same size
(its old header, other bytes), after its header was read and before its bytes are, is named in one
``CheckpointChangedError`` -- never loaded as wrong weights.

The break is made right before the read: ``engine.weights.iterate_weights`` (``load_path.stream``: ``full`` and
``broadcast``'s rank 0) or ``engine.strategies.rank_local.read_bound_rows`` (``rank_local``), each wrapped to break
the component's first shard on its first call. ``full`` runs in this process (one rank), ``rank_local`` on 2 spawned
gloo ranks (vllm-omni loads ``rank_local`` at 1 rank as ``full``), each rank breaking its own copy of the checkpoint
(so each rank's stamp precedes its break: one folder shared would let a rank stamp another's break).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from omni_support import import_omni, load_pipeline

import_omni()  # skips this module where vllm-omni is not installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import run_distributed  # noqa: E402
from fault_cli import break_file  # noqa: E402

MODES = ("truncate", "replace")


def breaking(original, mode: str, broken: list):
    """``original(source, ...)`` that first breaks ``source``'s first shard, once per load (``broken`` records it)."""

    def wrapper(source, *args, **kwargs):
        if not broken and source.files:
            shard = sorted(source.files)[0]
            break_file(shard, mode)
            broken.append(shard)
        return original(source, *args, **kwargs)

    return wrapper


def expect_named(message: str, shard: Path, mode: str) -> None:
    assert f"{shard} changed while the load of " in message, message
    words = ("truncated",) if mode == "truncate" else ("replaced by another file", "rewritten in place")
    assert any(word in message for word in words), message


@pytest.mark.parametrize("mode", MODES)
def test_a_dit_shard_changed_during_the_full_load_is_named(omni_world, wan22, tmp_path, monkeypatch, mode):
    """Before: a truncated shard failed with torch's "Trying to resize storage that is not resizable" (the file
    unnamed); a replaced one loaded its zeros as the DiT's weights without a word."""
    from vllm_diffusion_plugin.engine import session as weights
    from vllm_diffusion_plugin.engine.errors import CheckpointChangedError

    root = tmp_path / "wan22"
    shutil.copytree(wan22.root, root)
    broken: list[Path] = []
    monkeypatch.setattr(weights, "iterate_weights", breaking(weights.iterate_weights, mode, broken))
    with pytest.raises(CheckpointChangedError) as info:
        load_pipeline(root, "WanPipeline", omni_world, {})
    assert broken and broken[0].parent == root / "transformer", broken
    expect_named(str(info.value), broken[0], mode)


def rank_local_worker(rank: int, world_size: int, root: str) -> dict:
    """Both faults, one after the other, each on this rank's own fresh copy of ``root``: the error's message."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_diffusion_plugin.doors.omni import apply_patches
    from vllm_diffusion_plugin.engine.strategies import rank_local
    from omni_support import hsdp_world

    import_omni()
    apply_patches()
    original, out = rank_local.read_bound_rows, {}
    for mode in MODES:
        copy = Path(root).parent / f"rank{rank}-{mode}" / "wan22"
        shutil.copytree(root, copy)
        broken: list[Path] = []
        rank_local.read_bound_rows = breaking(original, mode, broken)
        config = VllmConfig()
        try:
            with set_current_vllm_config(config):
                hsdp_world(world_size, rank)
                load_pipeline(copy, "WanPipeline", config, {"hsdp_weight_load": "rank_local"}, use_hsdp=True,
                              hsdp_shard_size=world_size)
            out[mode] = ("loaded", None, [str(p) for p in broken])
        except Exception as exc:  # noqa: BLE001 -- the message is what the test checks
            out[mode] = (type(exc).__name__, str(exc), [str(p) for p in broken])
        finally:
            rank_local.read_bound_rows = original
    return out


def test_a_dit_shard_changed_during_the_rank_local_load_is_named(omni, wan22, tmp_path, monkeypatch):
    """Before: ``rank_local`` re-read each header (unchanged) and ``pread`` the rows: the replaced file's zeros were
    loaded as the DiT's rows without a word; the truncated one failed, on the rank whose rows reach past the new end,
    with "unexpected end of file" -- and the other rank loaded."""
    monkeypatch.setenv("VLLM_DIFFUSION_OMNI_CPU", "1")
    root = tmp_path / "wan22"
    shutil.copytree(wan22.root, root)
    results = run_distributed(rank_local_worker, 2, args=(str(root),), timeout_s=600, start_method="spawn")
    for rank, result in enumerate(results):
        for mode in MODES:
            kind, message, broken = result[mode]
            assert kind == "CheckpointChangedError" and broken, (rank, mode, kind, message, broken)
            expect_named(message, Path(broken[0]), mode)
