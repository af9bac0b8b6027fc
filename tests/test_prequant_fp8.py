"""Pre-quantized FP8 checkpoints in diffusers layout (issue 37, part 2) through the engine every door uses.

Each checkpoint is a tiny Wan2.2 or Qwen-Image pipeline written by diffusers (``save_pretrained``, sharded with an
index), then quantized here as ModelOpt / vLLM write them, with safetensors itself: every linear of the blocks but
one (ModelOpt's ``exclude_modules``: it stays in the load dtype) becomes a ``float8_e4m3fn`` ``[out, in]`` weight
with an fp32 ``weight_scale`` -- 0-dim for ModelOpt ``FP8`` (plus a static 0-dim ``input_scale``) and vLLM's
serialized ``fp8``, ``[out]`` for ModelOpt ``FP8_PER_CHANNEL_PER_TOKEN`` -- and ``config.json`` gets the
``quantization_config`` vllm-omni reads.

What must hold: the FP8 bytes and scales land as they are in the FP8 layers online quantization ends with (nothing
dequantized and kept); ``rank_local`` reads ~1/S of the checkpoint per rank (<= 1.05x) and its shards are
bit-identical to ``full``'s rows, as are ``broadcast``'s; a LoRA is fused exactly (dequantize, add in fp32,
requantize; per-tensor scales agreed by ``all_reduce(MAX)``): every element within one FP8 step of the whole tensor
fused in one process; ``plan`` says the bytes read and held; everything else pre-quantized is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

FP8 = torch.float8_e4m3fn
FORMATS = {  # name -> (quantization_config, per channel, input_scale)
    "modelopt-fp8": ({"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["*ffn.net.2*",
                                                                                           "*img_mlp.net.2*"]},
                     False, True),
    "modelopt-fp8-per-channel": ({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN",
                                  "exclude_modules": ["*ffn.net.2*", "*img_mlp.net.2*"]}, True, False),
    "vllm-fp8": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, False, False),
    "modelopt-fp8-per-channel-column": ({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"},
                                        "column", False),  # [out, 1] scales, as some exporters write them
}
EXCLUDED = ("ffn.net.2", "img_mlp.net.2")
LORA_TARGETS = {"wan": ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
                "qwen-image": ("to_q", "to_k", "add_k_proj", "img_mlp.net.0.proj", "img_mlp.net.2")}


def fp8_linears(kind: str) -> list[str]:
    from vllm_diffusion_plugin.tiny.models import build_tiny_model

    return [name for name, m in build_tiny_model(kind).named_modules() if isinstance(m, torch.nn.Linear)
            and "blocks." in name and not name.endswith(EXCLUDED)]


def quantize_folder(folder: Path, kind: str, fmt: str, linears: set[str] | None = None) -> list[str]:
    """Rewrite a diffusers component folder as a pre-quantized one, shard by shard, with safetensors. Per channel,
    the scales go to the last shard (each weight is read before its scale: ``broadcast`` must hold its bucket);
    otherwise beside their weights (safetensors stores fp32 before fp8: the scale is read first)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config, per_channel, input_scale = FORMATS[fmt]
    linears = set(fp8_linears(kind)) if linears is None else linears
    index_path = folder / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(folder.glob("*.safetensors"))
    contents = {}
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            contents[shard] = {k: f.get_tensor(k) for k in f.keys()}
    for shard in shards:
        tensors = contents[shard]
        for key in [k for k in tensors if k.removesuffix(".weight") in linears and k.endswith(".weight")]:
            w = tensors[key].float()
            amax = w.abs().amax(dim=1) if per_channel else w.abs().amax()
            scale = (amax / torch.finfo(FP8).max).float()
            tensors[key] = (w / (scale[:, None] if per_channel else scale)).to(FP8)
            name = key.removesuffix(".weight")
            contents[shards[-1] if per_channel else shard][f"{name}.weight_scale"] = \
                scale[:, None] if per_channel == "column" else scale
            index["weight_map"][f"{name}.weight_scale"] = (shards[-1] if per_channel else shard).name
            if input_scale:
                tensors[f"{name}.input_scale"] = torch.tensor(0.05)
                index["weight_map"][f"{name}.input_scale"] = shard.name
    for shard, tensors in contents.items():
        save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = config
    (folder / "config.json").write_text(json.dumps(cfg))
    return sorted(linears)


def write_fp8_pipeline(root: Path, kind: str, fmt: str) -> Path:
    from vllm_diffusion_plugin.tiny.models import PIPELINES, write_tiny_pipeline

    write_tiny_pipeline(root, kind, dtype=torch.bfloat16)
    for component in PIPELINES[kind][2]:
        quantize_folder(root / component, kind, fmt)
    return root


def write_lora(path: Path, kind: str) -> Path:
    from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora

    return write_tiny_lora(path, build_tiny_model(kind), seed=4, targets=LORA_TARGETS[kind])


@pytest.fixture(scope="module", ids=lambda p: f"{p[0]}-{p[1]}",
                params=[("wan", f) for f in FORMATS if "column" not in f] + [("qwen-image", f) for f in (
                    "modelopt-fp8", "modelopt-fp8-per-channel", "modelopt-fp8-per-channel-column")])
def fp8_pipeline(request, tmp_path_factory) -> tuple[str, str, str, str]:
    kind, fmt = request.param
    root = write_fp8_pipeline(tmp_path_factory.mktemp(f"{kind}-{fmt}"), kind, fmt)
    return kind, fmt, str(root), str(write_lora(root.parent / "lora.safetensors", kind))


def _file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# ---- one process: the FP8 bytes as they are, forward equal to the dequantized model ---------------------------
def test_one_process_reads_the_fp8_bytes_and_scales_as_they_are(fp8_pipeline):
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.quant.layer import Fp8Linear
    from vllm_diffusion_plugin.engine.session import load_components

    kind, fmt, root, _ = fp8_pipeline
    loaded = load_components(root, options=LoadOptions(), device=torch.device("cpu"), dtype=torch.bfloat16)
    for name, module in loaded.modules.items():
        stored = _file_tensors(Path(root) / name)
        fp8 = {n for n, m in module.named_modules() if isinstance(m, Fp8Linear)}
        assert fp8 == set(fp8_linears(kind)), (name, sorted(fp8 ^ set(fp8_linears(kind)))[:5])
        state = module.state_dict()
        assert set(state) == set(stored), sorted(set(state) ^ set(stored))[:5]
        for key, value in stored.items():  # FP8 weights and fp32 scales bit for bit; the rest as diffusers casts
            if value.dtype == FP8 or key.endswith("_scale"):
                assert state[key].dtype == value.dtype and torch.equal(_bits(state[key]), _bits(value)), key
            else:
                assert torch.equal(state[key], value.to(state[key].dtype)), key
        assert all(not n.endswith(EXCLUDED) or m.weight.dtype == torch.bfloat16 for n, m in module.named_modules()
                   if isinstance(m, torch.nn.Linear))
        entry = next(c for c in loaded.report.components if c.name == name)
        assert entry.bytes_read == sum(v.numel() * v.element_size() for v in stored.values()), name


def test_the_fp8_layers_forward_is_the_dequantized_models(tmp_path):
    """Wan2.2: our FP8 DiT's forward against diffusers' own model holding the dequantized weights."""
    import diffusers

    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.session import load_components
    from vllm_diffusion_plugin.engine.quant.fp8 import dequantize

    root = write_fp8_pipeline(tmp_path / "wan", "wan", "modelopt-fp8-per-channel")
    ours = load_components(root, options=LoadOptions(), components=["transformer"], device=torch.device("cpu"),
                           dtype=torch.float32).modules["transformer"]
    stored = _file_tensors(root / "transformer")
    config = {k: v for k, v in json.loads((root / "transformer" / "config.json").read_text()).items()
              if not k.startswith("_") and k != "quantization_config"}
    reference = diffusers.WanTransformer3DModel(**config).eval()
    state = {k: v.float() for k, v in stored.items() if not k.endswith("_scale")}
    for key in [k for k in stored if k.endswith(".weight_scale")]:
        weight = key.replace("weight_scale", "weight")
        state[weight] = dequantize(stored[weight], stored[key].reshape(-1, 1))
    reference.load_state_dict(state)
    gen = torch.Generator().manual_seed(7)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 4, 4, generator=gen), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 8, 16, generator=gen), return_dict=False)
    with torch.no_grad():
        assert torch.allclose(ours(**inputs)[0], reference(**inputs)[0], atol=1e-5, rtol=1e-5)


def test_modelopts_legacy_hf_quant_config_json_is_read(tmp_path):
    """ModelOpt's ``hf_quant_config.json`` (``producer`` + ``quantization.quant_algo``) instead of a
    ``quantization_config`` in config.json."""
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.quant.layer import Fp8Linear
    from vllm_diffusion_plugin.engine.session import load_components
    from vllm_diffusion_plugin.engine.save import save_components

    root = write_fp8_pipeline(tmp_path / "wan", "wan", "modelopt-fp8")
    for component in ("transformer", "transformer_2"):
        cfg = json.loads((root / component / "config.json").read_text())
        cfg.pop("quantization_config")
        (root / component / "config.json").write_text(json.dumps(cfg))
        (root / component / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.19.0"},
             "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["*ffn.net.2*"]}}))
    loaded = load_components(root, options=LoadOptions(), device=torch.device("cpu"), dtype=torch.bfloat16)
    for module in loaded.modules.values():
        assert {n for n, m in module.named_modules() if isinstance(m, Fp8Linear)} == set(fp8_linears("wan"))
    save_components(loaded, tmp_path / "saved")  # its config.json carries the quantization config: read back
    saved = load_components(tmp_path / "saved" / "transformer", options=LoadOptions(), device=torch.device("cpu"),
                            dtype=torch.bfloat16).modules["transformer"]
    assert {n for n, m in saved.named_modules() if isinstance(m, Fp8Linear)} == set(fp8_linears("wan"))
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(saved.state_dict().values(),
                                                                loaded.modules["transformer"].state_dict().values()))


# ---- refused by name, before any weight byte is read ---------------------------------------------------------
@pytest.mark.parametrize("config, extra_key, match", [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, None, r"ModelOpt NVFP4 checkpoint"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, None, r"ModelOpt mixed precision checkpoint"),
    ({"quant_method": "gguf", "compute_dtype": "bfloat16"}, None, r"quantization method 'gguf'"),
    ({"quant_method": "torchao", "quant_type": "float8wo"}, None, r"quantization method 'torchao'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None, r"block-wise FP8 \(weight_block_size"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "pre_quant_scale", r"pre_quant_scale \(AWQ"),
    (None, None, r"FP8 tensors .* but no quantization config"),
], ids=["nvfp4", "mixed", "gguf", "torchao", "block-fp8", "pre_quant_scale", "fp8-without-config"])
def test_what_stays_refused_is_refused_by_name_before_any_read(tmp_path, monkeypatch, config, extra_key, match):
    from safetensors.torch import save_file

    from vllm_diffusion_plugin.engine import weights
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.session import load_components
    from vllm_diffusion_plugin.engine.errors import PreQuantError

    root = write_fp8_pipeline(tmp_path / "wan", "wan", "modelopt-fp8")
    folder = root / "transformer"
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization_config")
    if config is not None:
        cfg["quantization_config"] = config
    (folder / "config.json").write_text(json.dumps(cfg))
    if extra_key:  # one more shard holding what AWQ / SmoothQuant exports add to a layer
        save_file({f"blocks.0.attn1.to_q.{extra_key}": torch.ones(24)}, str(folder / "extra.safetensors"))
        index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
        index["weight_map"][f"blocks.0.attn1.to_q.{extra_key}"] = "extra.safetensors"
        (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    monkeypatch.setattr(weights, "iterate_weights", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(PreQuantError, match=match) as caught:
        load_components(root, options=LoadOptions(), device=torch.device("cpu"), dtype=torch.bfloat16)
    assert "\n" not in str(caught.value) and "transformer" in str(caught.value)


# ---- 2 gloo ranks: full, broadcast and rank_local with a LoRA --------------------------------------------------
def local_params(modules) -> dict[str, tuple]:
    """Every parameter's local rows of ``modules`` (a rank's): ``name -> (rows, is FP8, start, stop)``, FP8 rows as
    bytes (torch cannot unpickle FP8 across the ranks' pipe)."""
    from vllm_diffusion_plugin.engine.io.rows import local_rows

    params = {}
    for name, module in modules.items():
        for pname, param in module.named_parameters():
            local, start, stop = local_rows(pname, param)
            local = local.detach().contiguous()
            params[f"{name}.{pname}"] = (local.view(torch.uint8) if local.dtype == FP8 else local.clone(),
                                         local.dtype == FP8, start, stop)
    return params


def strategies_worker(rank: int, world_size: int, root: str, lora: str, replicate: int = 1) -> dict:
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec
    from vllm_diffusion_plugin.engine.session import load_components
    from vllm_diffusion_plugin.engine.plan import plan_load
    from vllm_diffusion_plugin.engine.strategies import broadcast

    # buckets of 2 KiB: a tiny DiT's tensors go out in many, as a real one's do
    broadcast.open_channel = lambda options, device: broadcast.BroadcastChannel(
        timeout_s=options.hsdp_broadcast_timeout_s, bucket_bytes=2048, device=device)
    out = {"forward_diff": {}}
    specs = [LoraSpec(Path(lora))]
    whole = load_components(root, options=LoadOptions(), device=torch.device("cpu"), dtype=torch.bfloat16,
                            lora_specs=specs).modules  # unsharded, in this process: the forward's reference
    for strategy in ("full", "broadcast", "rank_local"):
        got = load_components(root, options=LoadOptions(hsdp_weight_load=strategy), device=torch.device("cpu"),
                              dtype=torch.bfloat16, hsdp=HSDPConfig(replicate_size=replicate), lora_specs=specs)
        if "Wan" in type(whole["transformer"]).__name__:  # FSDP2 all-gathers the FP8 weights and scales
            gen = torch.Generator().manual_seed(7)
            inputs = dict(hidden_states=torch.randn(1, 4, 2, 4, 4, generator=gen).to(torch.bfloat16),
                          timestep=torch.tensor([500]), return_dict=False,
                          encoder_hidden_states=torch.randn(1, 8, 16, generator=gen).to(torch.bfloat16))
            with torch.no_grad():
                for name, module in got.modules.items():
                    out["forward_diff"][(strategy, name)] = (module(**inputs)[0].float() -
                                                             whole[name](**inputs)[0].float()).abs().max().item()
        report = got.report.to_dict()
        out[strategy] = {"params": local_params(got.modules), "fused": report["lora_keys_fused"],
                         "bytes_read": {c["name"]: c["bytes_read"] for c in report["components"]},
                         "held": {c["name"]: c["param_bytes_local"] for c in report["components"]},
                         "total": {n: s.total_bytes for n, s in got.sources.items()}}
    plan = plan_load(root, options=LoadOptions(), lora_specs=specs, world_size=world_size,
                     hsdp=HSDPConfig(replicate_size=replicate), dtype=torch.bfloat16)
    out["plan"] = {(r.strategy, c.name): (c.bytes_read, c.held) for r in plan.ranks if r.rank == rank
                   for c in r.components}
    return out


def whole_reference(root: Path, lora: str, kind: str) -> dict[str, tuple]:
    """Every FP8 layer fused in one process on the whole tensor: the LoRA's delta in fp32, dequantize, add,
    requantize (``quant_fuse.fuse_fp8_rows`` without any agreement); with the exact fp32 sum."""
    from safetensors.torch import load_file

    from vllm_diffusion_plugin.engine.quant.fp8 import dequantize, fuse_fp8_rows
    from vllm_diffusion_plugin.tiny.models import PIPELINES

    factors = load_file(lora)
    out = {}
    for component in PIPELINES[kind][2]:
        stored = _file_tensors(root / component)
        for name in fp8_linears(kind):
            a = factors.get(f"transformer.{name}.lora_A.weight")
            if a is None:
                continue
            b, alpha = factors[f"transformer.{name}.lora_B.weight"], factors[f"transformer.{name}.alpha"]
            delta = (b.float() @ a.float()) * (float(alpha) / a.shape[0])
            q, scale = stored[f"{name}.weight"], stored[f"{name}.weight_scale"]
            per_tensor = scale.dim() == 0
            new_q, new_scale = fuse_fp8_rows(q, scale if per_tensor else scale.reshape(-1, 1), delta,
                                             per_tensor=per_tensor)
            exact = dequantize(q, scale if per_tensor else scale.reshape(-1, 1)).double() + delta.double()
            out[f"{component}.{name}"] = (new_q, new_scale.reshape(scale.shape), exact)
    return out


@pytest.mark.multiproc
def test_two_ranks_every_strategy_reads_and_fuses_fp8_exactly(fp8_pipeline):
    from vllm_diffusion_plugin.engine.quant.fp8 import dequantize, fp8_step

    kind, fmt, root, lora = fp8_pipeline
    results = run_distributed(strategies_worker, 2, args=(root, lora), timeout_s=500)
    reference = whole_reference(Path(root), lora, kind)
    assert reference
    for result in results:
        for strategy in ("full", "broadcast", "rank_local"):
            result[strategy]["params"] = {k: (t.view(FP8) if fp8 else t, start, stop)
                                          for k, (t, fp8, start, stop) in result[strategy]["params"].items()}
    for rank, result in enumerate(results):
        assert all(diff <= 1e-5 for diff in result["forward_diff"].values()), (rank, result["forward_diff"])
        assert result["forward_diff"] or kind != "wan"
        full = result["full"]["params"]
        for strategy in ("broadcast", "rank_local"):
            got = result[strategy]["params"]
            assert set(got) == set(full)
            different = [k for k, (t, start, stop) in got.items() if (start, stop) != full[k][1:] or
                         t.dtype != full[k][0].dtype or not torch.equal(_bits(t), _bits(full[k][0]))]
            assert not different, (rank, strategy, different[:6])
            fused = result[strategy]["fused"]  # broadcast: rank 0 fuses, the others receive
            assert result["full"]["fused"] > 0 and fused == (0 if strategy == "broadcast" and rank else
                                                             result["full"]["fused"]), (rank, strategy, fused)
        for layer, (new_q, new_scale, exact) in reference.items():
            q, start, stop = full[f"{layer}.weight"]
            scale = full[f"{layer}.weight_scale"][0]
            assert q.dtype == FP8, layer  # nothing dequantized and kept
            per_tensor = scale.dim() == 0
            column = (lambda s: s) if per_tensor else (lambda s: s.reshape(-1, 1))
            ours = dequantize(q, column(scale)).double()
            ref_scale = new_scale if per_tensor else new_scale[start:stop]
            want = dequantize(new_q[start:stop], column(ref_scale)).double()
            step = fp8_step(new_q[start:stop]).double() * column(ref_scale).double()
            assert bool(((ours - want).abs() <= step).all()), (rank, layer, ((ours - want).abs() / step).max())
            assert bool(((ours - exact[start:stop]).abs() <= step).all()), (rank, layer)
        for name, read in result["rank_local"]["bytes_read"].items():
            total = result["rank_local"]["total"][name]
            print(f"\n[{kind} {fmt}] rank {rank} {name}: rank_local read {read} of {total} bytes "
                  f"({read / (total / 2):.3f}x of 1/S); full {result['full']['bytes_read'][name]}", flush=True)
            assert read <= 1.05 * total / 2, (rank, name, read, total)
            assert result["full"]["bytes_read"][name] == total
            for strategy in ("full", "rank_local"):
                planned_read, planned_held = result["plan"][(strategy, name)]
                assert planned_read == result[strategy]["bytes_read"][name], (rank, strategy, name)
                assert planned_held == result[strategy]["held"][name], (rank, strategy, name, planned_held,
                                                                        result[strategy]["held"][name])


def test_plan_counts_fp8_bytes_read_and_held(tmp_path):
    """One rank: the plan of an FP8 checkpoint reads and holds its FP8 bytes (1 byte per weight), not bf16's."""
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.session import load_components
    from vllm_diffusion_plugin.engine.plan import plan_load

    root = write_fp8_pipeline(tmp_path / "wan", "wan", "modelopt-fp8")
    plan = plan_load(root, options=LoadOptions(), world_size=1, dtype=torch.bfloat16)
    component = next(c for r in plan.ranks if r.strategy == "full" for c in r.components if c.name == "transformer")
    stored = _file_tensors(root / "transformer")
    on_disk = sum(v.numel() * v.element_size() for v in stored.values())
    loaded = load_components(root, options=LoadOptions(), components=["transformer"], device=torch.device("cpu"),
                             dtype=torch.bfloat16)
    held = sum(p.numel() * p.element_size() for p in loaded.modules["transformer"].parameters())
    fp8 = sum(v.numel() for v in stored.values() if v.dtype == FP8)
    print(f"\n[plan] read {component.bytes_read} (on disk {on_disk}), held {component.held} (loaded {held}; "
          f"{fp8} bytes of it FP8 weights)", flush=True)
    assert component.bytes_read == on_disk and component.held == held, (component.bytes_read, component.held,
                                                                        on_disk, held)


# ---- the CLI: vllm-diffusion load, as a user runs it ------------------------------------------------------------
@pytest.mark.multiproc
def test_cli_rank_local_two_ranks_fuses_and_saves_an_fp8_checkpoint(tmp_path):
    """``vllm-diffusion load --nproc 2 --hsdp-weight-load rank_local --lora ... --save-fused``: each rank reads ~half
    of the FP8 checkpoint; the saved folder is an FP8 checkpoint again (same quantization_config) whose every FP8
    element is within one FP8 step of the whole-tensor reference fusion."""
    import subprocess
    import sys

    from vllm_diffusion_plugin.engine.quant.fp8 import dequantize, fp8_step

    root = write_fp8_pipeline(tmp_path / "wan", "wan", "modelopt-fp8-per-channel")
    lora = write_lora(tmp_path / "lora.safetensors", "wan")
    out = tmp_path / "fused"
    proc = subprocess.run([sys.executable, "-m", "vllm_diffusion_plugin.doors.cli", "load", str(root), "--nproc", "2",
                           "--hsdp-weight-load", "rank_local", "--lora", str(lora), "--device", "cpu",
                           "--save-fused", str(out), "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    total = sum(v.numel() * v.element_size() for c in ("transformer", "transformer_2")
                for v in _file_tensors(root / c).values())
    for rank in report["ranks"]:
        assert rank["bytes_read"] <= 1.05 * total / 2, (rank, total)
    reference = whole_reference(root, str(lora), "wan")
    for component in ("transformer", "transformer_2"):
        saved = _file_tensors(out / component)
        config = json.loads((out / component / "config.json").read_text())
        assert config["quantization_config"]["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN"
        for layer, (new_q, new_scale, exact) in reference.items():
            if not layer.startswith(component + "."):
                continue
            name = layer.removeprefix(component + ".")
            q, scale = saved[f"{name}.weight"], saved[f"{name}.weight_scale"]
            assert q.dtype == FP8 and scale.shape == new_scale.shape, layer
            step = fp8_step(new_q).double() * new_scale.reshape(-1, 1).double()
            ours = dequantize(q, scale.reshape(-1, 1)).double()
            assert bool(((ours - dequantize(new_q, new_scale.reshape(-1, 1)).double()).abs() <= step).all()), layer
            assert bool(((ours - exact).abs() <= step).all()), layer


def test_cli_refuses_nvfp4_in_one_line_before_any_rank_starts(tmp_path):
    import subprocess
    import sys

    root = write_fp8_pipeline(tmp_path / "wan", "wan", "modelopt-fp8")
    cfg = json.loads((root / "transformer_2" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    (root / "transformer_2" / "config.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "vllm_diffusion_plugin.doors.cli", "load", str(root), "--nproc", "2",
                           "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("vllm-diffusion: error:")]
    assert len(lines) == 1 and "transformer_2" in lines[0] and "ModelOpt NVFP4 checkpoint" in lines[0], proc.stderr


@pytest.mark.multiproc
@pytest.mark.parametrize("replicate", [1, 2], ids=["shard4", "replicate2-shard2"])
def test_four_ranks_uneven_rows_and_a_lora_with_bias_and_full_deltas(tmp_path, replicate):
    """ModelOpt FP8 per tensor at S = 4 on rows that split 8/8/8/6 (an FFN of 30), and at (2, 2) where each replica
    agrees on the scales in its own shard group, with a LoRA carrying A/B pairs,
    a bias delta on an FP8 layer, a bias-only delta, and full deltas on bf16 parameters: ``broadcast``'s and
    ``rank_local``'s parameters bit-identical to ``full``'s rows on every rank, the sharded forward equal to the
    unsharded one (four ranks agreeing on each per-tensor scale, one of them holding 6 rows)."""
    from test_distributed_load import write_rich_lora, write_uneven_wan

    root = write_uneven_wan(tmp_path / "uneven")
    lora = write_rich_lora(tmp_path / "rich_lora.safetensors", root)
    for component in ("transformer", "transformer_2"):
        quantize_folder(root / component, "wan", "modelopt-fp8")
    results = run_distributed(strategies_worker, 4, args=(str(root), str(lora), replicate), timeout_s=600)
    for rank, result in enumerate(results):
        assert result["forward_diff"] and all(d <= 1e-5 for d in result["forward_diff"].values()), rank
        full = {k: (t.view(FP8) if fp8 else t, start, stop) for k, (t, fp8, start, stop) in
                result["full"]["params"].items()}
        assert any(t.dtype == FP8 for t, _, _ in full.values())
        for strategy in ("broadcast", "rank_local"):
            got = {k: (t.view(FP8) if fp8 else t, start, stop) for k, (t, fp8, start, stop) in
                   result[strategy]["params"].items()}
            different = [k for k, (t, start, stop) in got.items() if (start, stop) != full[k][1:] or
                         t.dtype != full[k][0].dtype or not torch.equal(_bits(t), _bits(full[k][0]))]
            assert not different, (rank, strategy, different[:6])
        # rank_local counts the targets this rank holds rows of (scale_shift_table's one row: rank 0 alone)
        assert 0 < result["rank_local"]["fused"] <= result["full"]["fused"], rank
