"""Cold loads on the CPU: weights view a copy-on-write mapping of their safetensors file (``map_private``).

Untouched weights then cost no copy and no fresh memory; LoRA fusion writes copy only the pages they touch
and never reach the checkpoint file. The pipeline loads DiTs this way.
"""

from __future__ import annotations

import hashlib

import torch
from safetensors.torch import load_file

from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint, resolve_component
from vllm_diffusion_plugin.engine.config import LoadOptions
from vllm_diffusion_plugin.engine.lora.specs import LoraSpec
from vllm_diffusion_plugin.engine.session import load_components
from vllm_diffusion_plugin.engine.skeleton import build_component
from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora
from vllm_diffusion_plugin.engine.weights import load_into_module


def digests(files) -> dict:
    return {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def file_state(source) -> dict[str, torch.Tensor]:
    state = {}
    for file in source.files:
        state.update(load_file(file))
    return state


def test_map_private_weights_view_their_file_and_writes_never_reach_it(tiny_wan_dir):
    source = resolve_component(tiny_wan_dir / "transformer")
    before = digests(source.files)
    module = build_component(source, dtype=torch.float32, device="cpu")
    load_into_module(module, source=source, map_private=True)
    expected = file_state(source)
    state = module.state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected.items())
    # every parameter views one of the shards' mappings (no copies into storage of its own)
    storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    assert len(storages) <= len(source.files) < len(list(module.parameters()))
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(-3.0).add_(1.0)
    assert digests(source.files) == before  # copy-on-write: the file is untouched
    again = build_component(source, dtype=torch.float32, device="cpu")
    load_into_module(again, source=source, map_private=True)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in expected.items())


def test_map_private_copies_where_the_dtype_differs(tiny_wan_dir):
    source = resolve_component(tiny_wan_dir / "transformer")  # an fp32 checkpoint into a bf16 module
    module = build_component(source, dtype=torch.bfloat16, device="cpu")
    load_into_module(module, source=source, map_private=True)
    expected = file_state(source)
    for name, tensor in module.state_dict().items():
        if name in expected and tensor.dtype == torch.bfloat16:
            assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_pipeline_fuses_lora_into_mapped_weights_without_touching_the_checkpoint(tiny_wan_dir, tmp_path):
    lora = write_tiny_lora(tmp_path / "lora.safetensors", build_tiny_model("wan", seed=5), seed=5)
    files = [s.files for s in resolve_checkpoint(tiny_wan_dir, components=["transformer"])][0]
    before = digests(files)
    plain = load_components(tiny_wan_dir, options=LoadOptions(), components=["transformer"],
                            device=torch.device("cpu"), dtype=torch.float32)
    fused = load_components(tiny_wan_dir, options=LoadOptions(), components=["transformer"],
                            device=torch.device("cpu"), dtype=torch.float32, lora_specs=[LoraSpec(lora)])
    assert fused.report.components[0].lora_keys_fused > 0
    assert digests(files) == before
    base, merged = plain.modules["transformer"].state_dict(), fused.modules["transformer"].state_dict()
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert changed and all(k.endswith("weight") for k in changed)  # the fused weights, in memory only
    reloaded = load_components(tiny_wan_dir, options=LoadOptions(), components=["transformer"],
                               device=torch.device("cpu"), dtype=torch.float32)
    assert all(torch.equal(reloaded.modules["transformer"].state_dict()[k], v) for k, v in base.items())
