"""checkpoint.py: diffusers layouts resolved from folders written by diffusers, and every bad input rejected."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_diffusion_plugin.engine.errors import CheckpointError
from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource, resolve_checkpoint, resolve_component
from vllm_diffusion_plugin.engine.io.headers import read_safetensors_header

INDEX = "diffusion_pytorch_model.safetensors.index.json"


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("diffusion_pytorch_model-*.safetensors"))


def test_pipeline_defaults_to_its_transformers_in_order(tiny_wan_dir):
    sources = resolve_checkpoint(tiny_wan_dir)
    assert [s.name for s in sources] == ["transformer", "transformer_2"]
    for source in sources:
        weight_map = _index(source.folder)["weight_map"]
        assert isinstance(source, ComponentSource)
        assert source.format == "safetensors" and source.index == source.folder / INDEX
        assert source.config["_class_name"] == "WanTransformer3DModel"
        assert source.files == tuple(_shards(source.folder)) and len(source.files) >= 3
        assert set(source.tensors) == set(weight_map)
        assert all(source.tensors[k].file.name == v for k, v in weight_map.items())
        # load order: by file, then by position in the file
        order = [(source.files.index(i.file), i.offset) for i in source.tensors.values()]
        assert order == sorted(order)
        on_disk = sum(f.stat().st_size for f in source.files)
        assert 0.9 * on_disk < source.total_bytes < on_disk


def test_header_shapes_and_dtypes_match_the_tensors(tiny_flux_dir):
    from safetensors import safe_open

    [source] = resolve_checkpoint(tiny_flux_dir)
    for file in source.files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                assert (source.tensors[key].shape, source.tensors[key].dtype) == (tuple(t.shape), t.dtype)


def test_component_selection(tiny_wan_dir):
    assert [s.name for s in resolve_checkpoint(tiny_wan_dir, components=["transformer_2"])] == ["transformer_2"]
    with pytest.raises(CheckpointError, match=r"unknown component\(s\) \['vae'\]; available: \['transformer', "
                                              r"'transformer_2'\]"):
        resolve_checkpoint(tiny_wan_dir, components=["vae"])  # null in model_index.json
    with pytest.raises(CheckpointError, match=r"unknown component\(s\) \['nope'\]"):
        resolve_checkpoint(tiny_wan_dir, components=["transformer", "nope"])


def test_single_component_folder(tiny_flux_dir):
    [source] = resolve_checkpoint(tiny_flux_dir / "transformer")
    assert source.name == "transformer" and source.config["_class_name"] == "FluxTransformer2DModel"
    assert resolve_component(tiny_flux_dir / "transformer", name="dit").name == "dit"
    with pytest.raises(CheckpointError, match="single component folder"):
        resolve_checkpoint(tiny_flux_dir / "transformer", components=["transformer"])


def test_two_indexes_are_refused(tiny_flux_dir, copy_checkpoint):
    folder = copy_checkpoint(tiny_flux_dir) / "transformer"
    shutil.copy(folder / INDEX, folder / "model.safetensors.index.json")
    with pytest.raises(CheckpointError, match=r"two shard indexes, diffusion_pytorch_model.safetensors.index.json "
                                              r"and model.safetensors.index.json"):
        resolve_component(folder)


def test_missing_shard_named_in_index(tiny_flux_dir, copy_checkpoint):
    folder = copy_checkpoint(tiny_flux_dir) / "transformer"
    victim = _shards(folder)[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"shard {victim.name} is named in the index .* but missing"):
        resolve_component(folder)


@pytest.mark.parametrize("weight_map, message", [
    ({}, "weight_map is missing or empty"),
    (None, "weight_map is missing or empty"),
    ("../transformer_2/diffusion_pytorch_model-00001-of-00005.safetensors", "outside the component folder"),
    ("/etc/passwd", "outside the component folder"),
])
def test_bad_index_weight_map(tiny_wan_dir, copy_checkpoint, weight_map, message):
    folder = copy_checkpoint(tiny_wan_dir) / "transformer"
    index = _index(folder)
    if isinstance(weight_map, str):
        first = next(iter(index["weight_map"]))
        index["weight_map"][first] = weight_map
    else:
        index["weight_map"] = weight_map
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=message):
        resolve_component(folder)


def test_index_mapping_a_key_to_a_shard_without_it(tiny_flux_dir, copy_checkpoint):
    folder = copy_checkpoint(tiny_flux_dir) / "transformer"
    index = _index(folder)
    key, first = next(iter(index["weight_map"].items()))
    other = next(f.name for f in _shards(folder) if f.name != first)
    index["weight_map"][key] = other
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"maps 1 key\(s\) to {other}, which does not hold them .*{key}"):
        resolve_component(folder)


def test_index_is_authoritative_over_extra_files(tiny_flux_dir, copy_checkpoint):
    folder = copy_checkpoint(tiny_flux_dir) / "transformer"
    save_file({"stray": torch.zeros(3)}, str(folder / "leftover.safetensors"))
    source = resolve_component(folder)
    assert "stray" not in source.tensors and folder / "leftover.safetensors" not in source.files


def test_without_index_all_shards_are_used(tiny_wan_dir, copy_checkpoint):
    folder = copy_checkpoint(tiny_wan_dir) / "transformer"
    with_index = resolve_component(folder)
    (folder / INDEX).unlink()
    source = resolve_component(folder)
    assert source.index is None and source.files == with_index.files
    assert dict(source.tensors) == dict(with_index.tensors)


def test_stale_shard_family_is_refused(tiny_wan_dir, copy_checkpoint):
    folder = copy_checkpoint(tiny_wan_dir) / "transformer"
    (folder / INDEX).unlink()
    shards = _shards(folder)
    total = len(shards)
    shutil.copy(shards[0], folder / "diffusion_pytorch_model-00001-of-00002.safetensors")
    shutil.copy(shards[1], folder / "diffusion_pytorch_model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match=rf"two shard families with different totals, "
                                              rf"diffusion_pytorch_model-00001-of-00002.safetensors .* and "
                                              rf"diffusion_pytorch_model-00001-of-{total:05d}.safetensors.*stale"):
        resolve_component(folder)


def test_incomplete_family_without_index(tiny_wan_dir, copy_checkpoint):
    folder = copy_checkpoint(tiny_wan_dir) / "transformer"
    (folder / INDEX).unlink()
    _shards(folder)[1].unlink()
    with pytest.raises(CheckpointError, match=r"incomplete; missing shard number\(s\) \[2\]"):
        resolve_component(folder)


def test_duplicate_key_across_files_without_index(tiny_flux_dir, copy_checkpoint):
    folder = copy_checkpoint(tiny_flux_dir) / "transformer"
    (folder / INDEX).unlink()
    key = resolve_component(folder).tensors.keys().__iter__().__next__()
    save_file({key: torch.zeros(1)}, str(folder / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"key '{key}' is in both .* stale or duplicate"):
        resolve_component(folder)


def test_no_weight_files(tmp_path):
    (tmp_path / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: no weight files found \(tried "
                                              rf"diffusion_pytorch_model.safetensors.index.json.*\*.safetensors"):
        resolve_component(tmp_path)


def test_folder_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_component(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "absent" / "dir")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'config.json'}: cannot read the component config"):
        resolve_component(tmp_path)


def test_pickle_only_with_allow_pickle(tiny_checkpoint_factory):
    root = tiny_checkpoint_factory("flux", safe_serialization=False)  # .bin shards + .bin index by diffusers
    with pytest.raises(CheckpointError, match="only pickle weights .* pass allow_pickle=True"):
        resolve_checkpoint(root)
    [source] = resolve_checkpoint(root, allow_pickle=True)
    assert source.format == "pickle" and source.index.name == "diffusion_pytorch_model.bin.index.json"
    assert len(source.files) >= 3 and all(f.suffix == ".bin" for f in source.files)
    [reference] = resolve_checkpoint(tiny_checkpoint_factory("flux"))
    assert {k: (i.shape, i.dtype) for k, i in source.tensors.items()} == \
           {k: (i.shape, i.dtype) for k, i in reference.tensors.items()}


def test_safetensors_preferred_over_pickle(tiny_flux_dir, copy_checkpoint):
    folder = copy_checkpoint(tiny_flux_dir) / "transformer"
    torch.save({"w": torch.ones(2)}, folder / "diffusion_pytorch_model.bin")
    source = resolve_component(folder, allow_pickle=True)
    assert source.format == "safetensors" and "w" not in source.tensors


class _NotATensor:
    pass


def test_pickle_is_loaded_weights_only(tmp_path):
    (tmp_path / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    torch.save({"w": torch.ones(2), "payload": _NotATensor()}, tmp_path / "diffusion_pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model.bin: cannot load with "
                                              r"torch.load\(weights_only=True\)"):
        resolve_component(tmp_path, allow_pickle=True)


@pytest.mark.parametrize("damage", ["truncate_data", "truncate_header", "empty", "garbage"])
def test_corrupt_safetensors_named_at_resolve(tiny_wan_dir, copy_checkpoint, damage):
    folder = copy_checkpoint(tiny_wan_dir) / "transformer_2"
    victim = _shards(folder)[-1]
    data = victim.read_bytes()
    victim.write_bytes({"truncate_data": data[:-100], "truncate_header": data[:50], "empty": b"",
                        "garbage": b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"}[damage])
    with pytest.raises(CheckpointError, match=rf"{victim}: .*(truncated|corrupt|cannot read)"):
        resolve_checkpoint(folder.parent, components=["transformer_2"])


def test_header_reader_reports_dtype_it_cannot_load(tmp_path):
    header = json.dumps({"w": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    with pytest.raises(CheckpointError, match=rf"{path}: key 'w' has dtype X9"):
        read_safetensors_header(path)


def test_uncached_hub_id_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as hf_constants
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError, match=r"'no-such-org/no-such-model' is not a local path .* HF_HUB_OFFLINE=1 "
                                              r"is set and it is not in the local Hugging Face cache"):
        resolve_checkpoint("no-such-org/no-such-model")


@pytest.mark.parametrize("library, class_name, expected", [
    ("diffusers", "WanTransformer3DModel", True), ("diffusers", "FluxTransformer2DModel", True),
    ("diffusers", "QwenImageTransformer2DModel", True), ("diffusers", "CogVideoXTransformer3DModel", True),
    ("diffusers", "SD3Transformer2DModel", True), ("diffusers", "HunyuanDiT2DModel", True),
    ("diffusers", "PixArtTransformer2DModel", True),
    ("diffusers", "AutoencoderKL", False), ("diffusers", "AutoencoderKLWan", False),
    ("diffusers", "UNet2DConditionModel", False), ("diffusers", "FluxControlNetModel", False),
    ("diffusers", "FlowMatchEulerDiscreteScheduler", False),
    ("transformers", "T5EncoderModel", False), ("transformers", "UMT5EncoderModel", False),
    ("diffusers", "SomeFutureTransformer3DModel", True),  # unknown to this diffusers: its naming convention
    (None, None, False),
])
def test_dit_is_decided_by_the_class_not_the_folder_name(library, class_name, expected):
    from vllm_diffusion_plugin.engine.io.checkpoint import is_dit_class

    assert is_dit_class(library, class_name) is expected


def test_is_transformer_reads_the_component_class(tiny_wan_dir, tmp_path):
    from vllm_diffusion_plugin.engine.io.checkpoint import is_transformer

    renamed = tmp_path / "my-model"
    shutil.copytree(tiny_wan_dir / "transformer", renamed)
    assert is_transformer(resolve_component(renamed))
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text('{"_class_name": "AutoencoderKLWan"}')
    save_file({"w": torch.zeros(1)}, str(tmp_path / "vae" / "diffusion_pytorch_model.safetensors"))
    assert not is_transformer(resolve_component(tmp_path / "vae"))
