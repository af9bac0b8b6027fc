"""Diffusers checkpoint layouts: which files hold a component's weights, validated before anything is read.

A *pipeline* folder has ``model_index.json`` and one subfolder per component (``transformer/``,
``transformer_2/``, ``vae/`` ...); a *component* folder has ``config.json`` plus weight files. Rules:

- An index (``diffusion_pytorch_model.safetensors.index.json``, ``model.safetensors.index.json`` or the
  ``.bin`` equivalents) is the authoritative shard manifest: only the files and keys it names are used. Two
  indexes of one format in a folder, an empty ``weight_map``, an entry pointing outside the folder, a shard
  it names that is missing, or a key it maps to a file that does not hold it: each is an error.
- Without an index every ``*.safetensors`` file is used; shards of one family with different ``-of-N``
  totals (stale shards), an incomplete family, or one key in two files: each is an error.
- Pickle files (``.bin``, ``.pt``) are used only with ``allow_pickle=True`` and only when no safetensors are
  present; they are read with ``torch.load(weights_only=True)``.
- Every header is read and checked at resolve time (``headers``), so a truncated or corrupt file fails here.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any, Literal

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine.errors import CheckpointError, PickleRefusedError
from vllm_diffusion_plugin.engine.io.diffusers_classes import class_module
from vllm_diffusion_plugin.engine.io.headers import TensorInfo, read_pickle_manifest, read_safetensors_header

logger = init_logger(__name__)

SAFETENSORS_INDEX_NAMES = ("diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json")
PICKLE_INDEX_NAMES = ("diffusion_pytorch_model.bin.index.json", "pytorch_model.bin.index.json",
                      "model.bin.index.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<index>\d+)-of-(?P<total>\d+)\.(?P<ext>[A-Za-z]+)$")


@dataclass(frozen=True)
class ComponentSource:
    """Where one component's weights live, validated: the loader reads exactly ``files`` / ``tensors``."""

    name: str
    """"transformer", "transformer_2", ... or the folder name for a single component folder."""
    folder: Path
    files: tuple[Path, ...]
    """Weight files in load order (shard number order; deterministic)."""
    format: Literal["safetensors", "pickle"]
    index: Path | None
    """The index file that is the shard manifest, or None when the folder has none."""
    config: Mapping[str, Any]
    """The component's ``config.json`` (``_class_name`` names the diffusers class)."""
    tensors: Mapping[str, TensorInfo] = field(default_factory=dict, repr=False)
    """Every key to load -> its file, shape and dtype, in load order (file order, then offset order)."""

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data that loading this component reads."""
        return sum(info.nbytes for info in self.tensors.values())

    def keys_in(self, file: Path) -> list[str]:
        """The keys read from ``file``, in the order they are stored."""
        return [key for key, info in self.tensors.items() if info.file == file]


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read {what}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return data


def _safe_relative(folder: Path, entry: Any, index: Path) -> Path:
    """The index entry as a path inside ``folder``; lexical check (HF cache snapshots are symlinks)."""
    if not isinstance(entry, str) or not entry:
        raise CheckpointError(f"{index}: weight_map entry {entry!r} is not a file name")
    pure = PurePosixPath(entry.replace("\\", "/"))
    if pure.is_absolute() or ".." in pure.parts or re.match(r"^[A-Za-z]:", entry):
        raise CheckpointError(f"{index}: weight_map names {entry!r}, which is outside the component folder "
                              f"{folder}; refusing to read it")
    return folder.joinpath(*pure.parts)


def _manifest_from_index(folder: Path, index: Path, reader) -> tuple[tuple[Path, ...], dict[str, TensorInfo]]:
    weight_map = _read_json(index, "the shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: weight_map is missing or empty; the index names no weights")
    by_file: dict[Path, list[str]] = {}
    for key, entry in weight_map.items():
        by_file.setdefault(_safe_relative(folder, entry, index), []).append(key)
    files = tuple(sorted(by_file, key=_shard_sort_key))
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{index}: shard {file.name} is named in the index "
                                  f"({len(by_file[file])} keys) but missing from {folder}")
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        header = reader(file)
        wanted = set(by_file[file])
        absent = sorted(wanted - header.keys())
        if absent:
            raise CheckpointError(f"{index}: maps {len(absent)} key(s) to {file.name}, which does not hold "
                                  f"them (stale shard?): {', '.join(absent[:5])}")
        tensors.update((key, info) for key, info in header.items() if key in wanted)
        extra = len(header) - len(wanted)
        if extra:
            logger.warning("%s holds %d key(s) that the index %s maps elsewhere or not at all; they are "
                           "not loaded.", file, extra, index.name)
    return files, tensors


def _shard_sort_key(path: Path) -> tuple:
    match = _SHARD_RE.match(path.name)
    if match:
        return (match["prefix"], int(match["total"]), int(match["index"]), path.name)
    return (path.stem, 0, 0, path.name)


def _manifest_from_files(folder: Path, files: list[Path], reader) -> tuple[tuple[Path, ...], dict[str, TensorInfo]]:
    families: dict[str, dict[int, list[Path]]] = {}
    for file in files:
        match = _SHARD_RE.match(file.name)
        if match:
            families.setdefault(match["prefix"], {}).setdefault(int(match["total"]), []).append(file)
    for prefix, totals in families.items():
        if len(totals) > 1:
            names = " and ".join(f"{sorted(fs)[0].name} (-of-{total:05d}, {len(fs)} files)"
                                 for total, fs in sorted(totals.items()))
            raise CheckpointError(f"{folder}: two shard families with different totals, {names}: stale shards "
                                  f"from an earlier save? Remove one family or add an index naming the shards")
        ((total, shard_files),) = totals.items()
        present = {int(_SHARD_RE.match(f.name)["index"]) for f in shard_files}
        missing = sorted(set(range(1, total + 1)) - present)
        if missing:
            raise CheckpointError(f"{folder}: shard family {prefix}-*-of-{total:05d} is incomplete; missing "
                                  f"shard number(s) {missing}")
    ordered = tuple(sorted(files, key=_shard_sort_key))
    tensors: dict[str, TensorInfo] = {}
    for file in ordered:
        for key, info in reader(file).items():
            if key in tensors:
                raise CheckpointError(f"{folder}: key {key!r} is in both {tensors[key].file.name} and "
                                      f"{file.name}; stale or duplicate weight files")
            tensors[key] = info
    return ordered, tensors


def _find_index(folder: Path, names: Sequence[str]) -> Path | None:
    found = [folder / name for name in names if (folder / name).is_file()]
    if len(found) > 1:
        raise CheckpointError(f"{folder}: two shard indexes, {found[0].name} and {found[1].name}; "
                              f"cannot tell which manifest is current")
    return found[0] if found else None


def resolve_component(folder: str | os.PathLike, *, name: str | None = None,
                      allow_pickle: bool = False) -> ComponentSource:
    """Validate one component folder (``config.json`` + weights) and describe what loading it reads."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"component folder {folder} does not exist")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder}: no config.json; not a diffusers component folder")
    config = _read_json(config_path, "the component config")
    name = name or folder.name
    index = _find_index(folder, SAFETENSORS_INDEX_NAMES)
    safetensors_files = sorted(folder.glob("*.safetensors"))
    if index is not None:
        fmt, (files, tensors) = "safetensors", _manifest_from_index(folder, index, read_safetensors_header)
    elif safetensors_files:
        fmt, (files, tensors) = "safetensors", _manifest_from_files(folder, safetensors_files,
                                                                    read_safetensors_header)
    else:
        pickle_index = _find_index(folder, PICKLE_INDEX_NAMES)
        pickle_files = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
        if not pickle_files and pickle_index is None:
            tried = ", ".join([*SAFETENSORS_INDEX_NAMES, "*.safetensors", *PICKLE_INDEX_NAMES,
                               *(f"*{s}" for s in PICKLE_SUFFIXES)])
            raise CheckpointError(f"{folder}: no weight files found (tried {tried})")
        if not allow_pickle:
            raise PickleRefusedError(folder, (pickle_index or pickle_files[0]).name)
        fmt = "pickle"
        if pickle_index is not None:
            index = pickle_index
            files, tensors = _manifest_from_index(folder, index, read_pickle_manifest)
        else:
            files, tensors = _manifest_from_files(folder, pickle_files, read_pickle_manifest)
    if not tensors:
        raise CheckpointError(f"{folder}: the weight files {[f.name for f in files]} hold no tensors")
    logger.debug("Resolved %s: %d %s file(s), %d tensors, %.3f GB (index: %s)", folder, len(files), fmt,
                 len(tensors), sum(t.nbytes for t in tensors.values()) / 1e9, index.name if index else None)
    return ComponentSource(name=name, folder=folder, files=files, format=fmt, index=index,
                           config=MappingProxyType(config), tensors=MappingProxyType(tensors))


def is_dit_class(library: str | None, class_name: str | None) -> bool:
    """Whether a component of class ``class_name`` (from ``library``) is a diffusion transformer (a DiT).

    The one rule for "is this a DiT", decided by what the component is, never by its folder name: a diffusers
    model class (a ``ModelMixin``) that diffusers files under ``diffusers.models.transformers`` -- Wan, FLUX,
    Qwen-Image, CogVideoX, SD3, HunyuanDiT, PixArt, Z-Image ... -- and not its autoencoders, UNets or
    controlnets, nor a ``transformers`` text encoder. A class this diffusers does not know (a newer model)
    falls back to diffusers' naming convention (``...Transformer...Model`` / ``...DiT...``).
    """
    if library != "diffusers" or not class_name:
        return False
    return _is_dit_class_name(class_name)


@functools.lru_cache(maxsize=None)
def _is_dit_class_name(class_name: str) -> bool:
    try:
        import diffusers
    except ImportError as exc:
        raise CheckpointError(f"telling whether {class_name} is a DiT needs diffusers: "
                              f"pip install \"vllm-diffusion-plugin[cli]\"") from exc
    module = class_module(class_name)
    if module is not None:  # a model diffusers lists: its module says, nothing imported
        return module.startswith("diffusers.models.transformers.")
    try:
        cls = getattr(diffusers, class_name)
    except (AttributeError, ImportError, RuntimeError):
        cls = None
    if not isinstance(cls, type):
        return ("Transformer" in class_name and class_name.endswith("Model")) or "DiT" in class_name
    return issubclass(cls, diffusers.ModelMixin) and cls.__module__.startswith("diffusers.models.transformers.")


def is_transformer(source: ComponentSource) -> bool:
    """Whether a resolved component is a DiT (``is_dit_class`` on its ``config.json`` ``_class_name``)."""
    class_name = source.config.get("_class_name")
    return is_dit_class("diffusers" if isinstance(class_name, str) else None, class_name)


def pipeline_components(model_index: Mapping[str, Any]) -> list[str]:
    """Component names a ``model_index.json`` declares (entries ``[library, class]`` that are not null)."""
    return sorted(key for key, value in model_index.items()
                  if not key.startswith("_") and isinstance(value, (list, tuple)) and len(value) == 2
                  and value[0] is not None and value[1] is not None)


def resolve_checkpoint(path_or_id: str | os.PathLike, *, components: Sequence[str] | None = None,
                       allow_pickle: bool = False, revision: str | None = None) -> list[ComponentSource]:
    """Resolve a pipeline folder, a component folder or a Hugging Face Hub id to validated sources.

    For a pipeline the default components are its DiTs (``is_dit_class`` on the ``model_index.json``
    entries, sorted by name: transformer, transformer_2); ``components`` picks others. A hub id (a string
    that is not an existing path) is fetched with ``huggingface_hub.snapshot_download``, only the files of
    the requested components; ``HF_HUB_OFFLINE=1`` restricts that to the local cache.
    """
    path = Path(path_or_id)
    if not path.exists():
        path = _download(str(path_or_id), components=components, allow_pickle=allow_pickle, revision=revision)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder; expected a diffusers pipeline or component folder")
    model_index_path = path / "model_index.json"
    if not model_index_path.is_file():
        if components:
            raise CheckpointError(f"{path} is a single component folder (no model_index.json); components "
                                  f"{list(components)} cannot be selected from it")
        return [resolve_component(path, allow_pickle=allow_pickle)]
    model_index = _read_json(model_index_path, "the pipeline index")
    available = pipeline_components(model_index)
    if components is None:
        selected = [name for name in available if is_dit_class(*model_index[name])]
        if not selected:
            raise CheckpointError(f"{model_index_path}: no transformer component; available: {available}")
    else:
        selected = list(dict.fromkeys(components))
        unknown = [name for name in selected if name not in available]
        if unknown:
            raise CheckpointError(f"{model_index_path}: unknown component(s) {unknown}; available: {available}")
    return [resolve_component(path / name, name=name, allow_pickle=allow_pickle) for name in selected]


def _looks_like_path(text: str) -> bool:
    """A local path rather than a hub id (``ORG/NAME``): absolute, ``./``/``~``, deeper than ORG/NAME, no ``/``
    at all, or under a folder that exists here (``checkpoints/wan`` when ``checkpoints/`` exists)."""
    if os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") != 1 or "\\" in text:
        return True
    return Path(text.split("/", 1)[0]).is_dir()


def _download(repo_id: str, *, components: Sequence[str] | None, allow_pickle: bool,
              revision: str | None) -> Path:
    if _looks_like_path(repo_id):
        raise CheckpointError(f"checkpoint folder {repo_id} does not exist (resolved: {Path(repo_id).absolute()})")
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    weights = ["*.safetensors", "*.json"] + ([f"*{s}" for s in PICKLE_SUFFIXES] if allow_pickle else [])

    def fetch(patterns: list[str]) -> Path:
        try:
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                          local_files_only=offline))
        except Exception as exc:
            hint = (" HF_HUB_OFFLINE=1 is set and it is not in the local Hugging Face cache." if offline else "")
            raise CheckpointError(f"{repo_id!r} is not a local path and could not be fetched from the "
                                  f"Hugging Face Hub (revision {revision or 'main'}).{hint} "
                                  f"({type(exc).__name__}: {exc})") from exc

    root = fetch(["model_index.json", "config.json", "*.index.json"])
    if (root / "model_index.json").is_file():
        index = _read_json(root / "model_index.json", "the pipeline index")
        names = components or [n for n in pipeline_components(index) if is_dit_class(*index[n])]
        return fetch(["model_index.json"] + [f"{name}/{pattern}" for name in names for pattern in weights])
    return fetch(weights)
