"""Loaded components written as diffusers folders: sharded ones gathered, each written atomically.

:func:`save_component` writes a module or state dict as a diffusers component folder (``config.json``,
``diffusion_pytorch_model-0000i-of-0000N.safetensors`` shards and the safetensors index) that diffusers'
``from_pretrained`` loads, into a hidden sibling folder renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.io.checkpoint import SAFETENSORS_INDEX_NAMES, ComponentSource
from vllm_diffusion_plugin.engine.platform import World
from vllm_diffusion_plugin.engine.progress import progress_bar
from vllm_diffusion_plugin.engine.quant.checkpoints import saved_config
from vllm_diffusion_plugin.engine.report import LoadReport

logger = init_logger(__name__)


WEIGHTS_PATTERN = "diffusion_pytorch_model{suffix}.safetensors"


INDEX_NAME = SAFETENSORS_INDEX_NAMES[0]


_CONFIG_DROP = ("_name_or_path", "_use_default_values", "_ignore_files")


def _prepare_state_dict(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state dict entry {key!r} is a {type(value).__name__}, not a tensor")
        if type(value).__name__ == "DTensor" or hasattr(value, "device_mesh"):
            raise TypeError(f"state dict entry {key!r} is a sharded DTensor; gather it first (e.g. torch.distributed"
                            f".checkpoint.state_dict.get_model_state_dict(model, options=StateDictOptions("
                            f"full_state_dict=True, cpu_offload=True))) and save from one rank")
        if value.is_meta:
            raise ValueError(f"state dict entry {key!r} {list(value.shape)} is on the meta device: it holds no data")
        tensor = value.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if tensor.numel() and storage in seen:
            tensor = tensor.clone()  # tied weights / views of one storage: safetensors refuses shared memory
        seen.add(tensor.untyped_storage().data_ptr())
        out[key] = tensor
    return out


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _rename_into_place(tmp: Path, out_dir: Path) -> None:
    """``tmp`` renamed to ``out_dir``; an ``out_dir`` already there is moved aside first and removed after."""
    if out_dir.exists():
        backup = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        out_dir.rename(backup)
        tmp.rename(out_dir)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        tmp.rename(out_dir)


def save_component(module_or_state_dict: nn.Module | Mapping[str, torch.Tensor], config: Mapping[str, Any] | None,
                   out_dir: str | os.PathLike, *, max_shard_size: int | str = "2GB",
                   overwrite: bool = False, progress: bool | None = None) -> Path:
    """Write a diffusers component folder (config.json + safetensors shards + index) atomically.

    ``config`` is the component's config (must carry ``_class_name``); None takes a diffusers module's
    own ``.config``. The state dict must be full (gathered) tensors. Shards follow diffusers' names and
    ``max_shard_size`` rule; an index is written even for a single shard. ``out_dir`` must not exist
    unless ``overwrite``; on any failure no output folder (and no partial one) is left behind. ``progress``:
    a bar over the bytes written (``progress.progress_bar``).
    """
    out_dir = Path(out_dir)
    if isinstance(module_or_state_dict, nn.Module):
        if config is None and hasattr(module_or_state_dict, "config"):
            config = {**module_or_state_dict.config, "_class_name": type(module_or_state_dict).__name__}
        module_or_state_dict = module_or_state_dict.state_dict()
    if config is None or not config.get("_class_name"):
        raise ValueError(f"save_component({out_dir}): the config needs a _class_name naming the diffusers class")
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists; pass overwrite=True to replace it")
    state = _prepare_state_dict(module_or_state_dict)
    if not state:
        raise ValueError(f"save_component({out_dir}): the state dict is empty")
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(state, filename_pattern=WEIGHTS_PATTERN, max_shard_size=max_shard_size)
    names = {name: name for name in split.filename_to_tensors}
    if not split.is_sharded:
        names = {name: WEIGHTS_PATTERN.format(suffix="-00001-of-00001") for name in names}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    bar = progress_bar(total=sum(t.nbytes for t in state.values()), desc=f"Saving {out_dir.name}", progress=progress)
    try:
        _write_json(tmp / "config.json", {k: v for k, v in dict(config).items() if k not in _CONFIG_DROP})
        for name, keys in split.filename_to_tensors.items():
            path = tmp / names[name]
            save_file({key: state[key] for key in keys}, str(path), metadata={"format": "pt"})
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            if bar is not None:
                bar.update(sum(state[key].nbytes for key in keys))
        weight_map = {key: names[name] for key, name in split.tensor_to_filename.items()}
        _write_json(tmp / INDEX_NAME, {"metadata": dict(split.metadata), "weight_map": weight_map})
        _rename_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    total = sum(t.nbytes for t in state.values())
    logger.info("Saved %d tensors (%.3f GB) of %s in %d shard(s) to %s", len(state), total / 1e9,
                config["_class_name"], len(names), out_dir)
    return out_dir


def gather_full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor] | None:
    """The full (unsharded) state dict on CPU, one tensor at a time.

    Every rank must call this (``DTensor.full_tensor()`` is a collective). With ``rank0_only`` only global
    rank 0 keeps the tensors and gets the dict; other ranks get None.
    """
    dtensor = DTensor
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] | None = {} if keep else None
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, dtensor) and tensor.dtype.is_floating_point and tensor.element_size() == 1:  # FP8:
            full = dtensor.from_local(tensor.to_local().view(torch.uint8), tensor.device_mesh, tensor.placements,
                                      shape=tensor.shape, stride=tensor.stride()).full_tensor().view(tensor.dtype)
        else:  # (gathered as its bytes above: gloo all-gathers no FP8)
            full = tensor.full_tensor() if isinstance(tensor, dtensor) else tensor
        if out is not None:
            out[name] = full.detach().to("cpu", copy=True)
        del full
    return out


@dataclass
class LoadedComponents:
    """The loaded modules by component name, their sources and this rank's report."""

    modules: dict[str, nn.Module]
    sources: dict[str, ComponentSource]
    report: LoadReport
    shard_reports: dict[str, object] = field(default_factory=dict)
    progress: bool | None = None
    """Progress bars for ``save_components`` (as ``load_components`` got)."""


def save_components(loaded: LoadedComponents, out_dir: str | os.PathLike | None) -> list[Path]:
    """Write every loaded component as a diffusers folder ``out_dir/<name>`` holding its final (fused, gathered)
    weights; sharded modules are gathered collectively and written by rank 0 (other ranks may pass None)."""
    rank = World.current().rank
    if rank == 0 and out_dir is None:
        raise ValueError("save_components: rank 0 needs an output folder")
    written = []
    for name, module in loaded.modules.items():
        with loaded.report.phase("save"):
            if name in loaded.shard_reports:
                state = gather_full_state_dict(module, rank0_only=True)
            else:
                state = {k: v.detach().cpu() for k, v in module.state_dict().items()} if rank == 0 else None
            if rank == 0:
                config = saved_config(loaded.sources[name])  # an FP8 folder stays readable as one
                written.append(save_component(state, config, Path(out_dir) / name, progress=loaded.progress))
                logger.info("Saved %s (%d tensors) to %s", name, len(state), written[-1])
    return written
