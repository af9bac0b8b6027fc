"""``vllm serve DIR --omni --load-format diffusion-hsdp``: the flag reaches vllm-omni's diffusion workers, options
come from ``--additional-config diffusion_hsdp``, and vllm-omni's own Wan2.2 pipeline loads its two DiTs
through our path (one LoRA each), against the real vllm-omni 0.30 classes:

- the API-server side: vllm-omni's ``extract_diffusion_stage_config_kwargs`` (what ``build_diffusion_config``
  calls) and ``OmniDiffusionConfig``;
- the worker side: ``DiffusersPipelineLoader(LoadConfig(), od_config)`` exactly as the diffusion model runner
  builds it, and its ``load_model`` building vllm-omni's ``Wan22Pipeline`` (fused ``to_qkv``, its own name
  mapping) from a tiny runnable Wan2.2 folder saved by diffusers, on vllm-omni's CPU platform
  (``VLLM_DIFFUSION_OMNI_CPU=1``) with its parallel state initialized in-process (gloo, one rank).
"""

from __future__ import annotations

import glob
import inspect
import logging
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from omni_support import FAMILIES, OneDitPipeline, build_family_dit, captured_logs, import_omni

from vllm_diffusion_plugin.doors.omni import _patching, patch_serve_flag
from vllm_diffusion_plugin.doors.omni.serve_options import UNSUPPORTED_KEYS
from vllm_diffusion_plugin.engine.lora import LoraFormatError
from vllm_diffusion_plugin.testing import omni_facts
from vllm_diffusion_plugin.testing.bad_loras import KINDS as ALL_BAD_LORA_KINDS
from vllm_diffusion_plugin.testing.bad_loras import write_bad_lora

BAD_LORA_KINDS = [k for k in ALL_BAD_LORA_KINDS if k != "overflow at fusion"]  # shows only while fusing

import_omni()  # skips this module where vllm-omni is not installed

FLAG = "diffusion-hsdp"


def stage_fields(**engine_args):
    """vllm-omni's own projection of a diffusion stage's engine arguments (API server, build_diffusion_config)."""
    from vllm_omni.config.omni_config import extract_diffusion_stage_config_kwargs

    engine_args.setdefault("model", "/nonexistent-model")
    engine_args.setdefault("dtype", "float32")
    return extract_diffusion_stage_config_kwargs(engine_args, stage_id=0)


def runner_loader(od_config):
    """The loader as vllm-omni's diffusion model runner builds it (``diffusion_model_runner.py``: ``LoadConfig()``)."""
    from vllm.config.load import LoadConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    return DiffusersPipelineLoader(LoadConfig(), od_config=od_config)


# --- 1. the flag reaches the loader ------------------------------------------------------------------------
def test_the_flag_reaches_the_loader_the_runner_builds(omni):
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.worker import diffusion_model_runner

    assert "LoadConfig()" in inspect.getsource(diffusion_model_runner)  # the runner still drops everything
    od_config = OmniDiffusionConfig(**stage_fields(load_format=FLAG))
    assert runner_loader(od_config).load_config.load_format == FLAG
    plain = OmniDiffusionConfig(**stage_fields(load_format="auto"))
    assert runner_loader(plain).load_config.load_format == "auto"  # other formats: untouched


def test_without_our_units_the_flag_is_dropped(omni):
    """What stock vllm-omni does (the originals under our wrappers): the worker loads with 'auto'."""
    from vllm.config.load import LoadConfig
    from vllm_omni.diffusion.data import OmniDiffusionConfig

    from vllm_omni.config import omni_config

    fields = omni_config.extract_diffusion_stage_config_kwargs.__wrapped__(
        {"model": "/nonexistent-model", "dtype": "float32", "load_format": FLAG}, stage_id=0)
    loader = omni.Loader.__new__(omni.Loader)
    omni.Loader.__init__.__wrapped__(loader, LoadConfig(), OmniDiffusionConfig(**fields))
    assert loader.load_config.load_format == "auto"


# --- 2. options: --additional-config diffusion_hsdp, refused early and by name -----------------------------
@pytest.mark.parametrize(("options", "error", "match"), [
    ({"lora_paths": ["x"]}, ValueError, r"Unknown key\(s\) 'lora_paths' in --additional-config diffusion_hsdp"),
    ({"lora_scale": "high"}, TypeError, r"--additional-config diffusion_hsdp key 'lora_scale' must be a number"),
    ({"hsdp_weight_load": "pre_sharded"}, ValueError, r"hsdp_weight_load must be one of full, broadcast, "
                                                      r"rank_local"),
    ({"hsdp_block_pattern": "blocks"}, ValueError, r"key 'hsdp_block_pattern' .* has no effect under vllm-omni"),
    ({"lora_path": "transformer=/nonexistent/high.safetensors"}, FileNotFoundError,
     r"LoRA file /nonexistent/high.safetensors does not exist"),
    ("not-an-object", TypeError, r"must be a JSON object"),
])
def test_bad_options_stop_the_api_server_naming_the_key(omni, options, error, match):
    with pytest.raises(error, match=match):
        stage_fields(load_format=FLAG, additional_config={"diffusion_hsdp": options})


def test_a_lora_for_a_component_the_folder_lacks_stops_the_api_server(omni, wan22):
    options = {"lora_path": [f"transformer={wan22.high}", f"transformer_3={wan22.low}"]}
    with pytest.raises(ValueError, match=r"'transformer_3=.*' names component 'transformer_3', which .*"
                                         r"model_index.json does not list; its components: .*transformer_2"):
        stage_fields(model=str(wan22.root), load_format=FLAG, additional_config={"diffusion_hsdp": options})
    with pytest.raises(ValueError, match="empty component name"):
        stage_fields(model=str(wan22.root), load_format=FLAG,
                     additional_config={"diffusion_hsdp": {"lora_path": [f"={wan22.high}"]}})


@pytest.mark.parametrize("kind", list(BAD_LORA_KINDS))
def test_a_bad_lora_stops_the_api_server_naming_its_file_component_and_key(omni, wan22, kind, tmp_path):
    # checked against the DiT's meta skeleton in the API server, before any worker builds its pipeline
    bad = tmp_path / "low_noise.safetensors"
    key = write_bad_lora(kind, wan22.low, bad)
    options = {"lora_path": [f"transformer={wan22.high}", f"transformer_2={bad}"]}
    with pytest.raises(LoraFormatError) as caught:
        stage_fields(model=str(wan22.root), load_format=FLAG, additional_config={"diffusion_hsdp": options})
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"LoRA file {bad} for transformer_2 (WanTransformer3DModel)")
    assert key is None or key in message, message
    assert str(wan22.high) not in message


def test_the_unknown_key_message_lists_only_keys_that_work_under_vllm_omni(omni):
    with pytest.raises(ValueError, match=r"known keys: allow_pickle, ") as caught:
        stage_fields(load_format=FLAG, additional_config={"diffusion_hsdp": {"lora_paths": ["x"]}})
    listed = str(caught.value).rpartition("known keys: ")[2]
    assert "lora_path" in listed and "hsdp_weight_load" in listed
    assert not any(key in listed for key in UNSUPPORTED_KEYS), listed


def test_options_without_the_flag_and_uncarried_combinations_are_refused(omni):
    with pytest.raises(ValueError, match="'diffusion_hsdp' is read only with --load-format diffusion-hsdp"):
        stage_fields(load_format="auto", additional_config={"diffusion_hsdp": {"lora_scale": 0.5}})
    with pytest.raises(ValueError, match="cannot be combined with: vllm-omni's enable_layerwise_offload"):
        stage_fields(load_format=FLAG, enable_layerwise_offload=True)
    with pytest.raises(ValueError, match="cannot be combined with: vllm-omni's --diffusion-load-format diffusers"):
        stage_fields(load_format=FLAG, diffusion_load_format="diffusers")
    # vLLM's own online fp8 (no row protocol) with rank_local: carried since issue 50, each layer gathered whole
    stage_fields(load_format=FLAG, quantization="fp8",
                 additional_config={"diffusion_hsdp": {"hsdp_weight_load": "rank_local"}})


@pytest.mark.parametrize("ours, upstream", [({"hsdp_weight_load": "broadcast"}, {}),
                                             ({}, {"enable_broadcast_weight_load": True})])
def test_broadcast_with_upstreams_pre_sharded_is_refused_in_one_line_naming_both(omni, ours, upstream):
    """Either broadcast switch with vllm-omni's ``pre_sharded`` (0.31+) would hand the load to upstream's own
    pre-sharded path (a crash on stacked q/k/v, a LoRA not fused): refused before any worker starts."""
    from vllm_diffusion_plugin.doors.omni.serve_options import check_supported, omni_options

    fields = {"hsdp_weight_load_strategy": "pre_sharded", **upstream}
    named = "hsdp_weight_load='broadcast'" if ours else "vllm-omni's --enable-broadcast-weight-load"
    match = f"cannot be combined with: {named} together with vllm-omni's --hsdp-weight-load-strategy pre_sharded"
    with pytest.raises(ValueError, match=re.escape(match)) as caught:
        check_supported(omni_options({"diffusion_hsdp": ours}), fields)
    assert "\n" not in str(caught.value)
    check_supported(omni_options({"diffusion_hsdp": ours}), upstream)  # each alone is fine
    check_supported(omni_options({}), {"hsdp_weight_load_strategy": "pre_sharded"})
    if omni_facts.has_pre_sharded():  # vllm-omni 0.31+: through the API server's own projection of the stage
        with pytest.raises(ValueError, match=re.escape(match)):
            stage_fields(load_format=FLAG, additional_config={"diffusion_hsdp": ours}, **fields)


def test_vllm_omnis_broadcast_switch_maps_onto_our_strategy(omni):
    from vllm_diffusion_plugin.doors.omni.serve_options import omni_options, weight_load_strategy

    assert weight_load_strategy(omni_options({}), {"enable_broadcast_weight_load": True}) == "broadcast"
    assert weight_load_strategy(omni_options({}), {}) == "full"
    assert weight_load_strategy(omni_options({}), {"hsdp_weight_load_strategy": "pre_sharded"}) == "rank_local"
    ours = omni_options({"diffusion_hsdp": {"hsdp_weight_load": "broadcast"}})
    assert weight_load_strategy(ours, {}) == "broadcast"


def test_env_fallbacks_apply_and_the_json_wins(omni, monkeypatch):
    from vllm_diffusion_plugin.doors.omni.serve_options import omni_options

    monkeypatch.setenv("VLLM_DIFFUSION_LORA_SCALE", "0.25")
    monkeypatch.setenv("VLLM_DIFFUSION_HSDP_WEIGHT_LOAD", "broadcast")
    options = omni_options({"diffusion_hsdp": {"lora_scale": 2}})
    assert (options.lora_scale, options.hsdp_weight_load) == (2.0, "broadcast")


# --- 1b. an unrecognized vllm-omni with the flag stops the server; without it, a warning ------------------
def test_an_unrecognized_shape_stops_startup_only_when_the_flag_was_given(omni, monkeypatch):
    monkeypatch.setattr(_patching, "_status", dict(_patching._status))
    changed = types.ModuleType(patch_serve_flag.TARGET)  # a vllm-omni without the function we wrap
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "/m", "--omni"])
    assert _patching.run_unit(patch_serve_flag, changed).startswith("skipped: ")
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "/m", "--omni", "--load-format", FLAG])
    with pytest.raises(_patching.LoadFormatUnavailable, match="--load-format diffusion-hsdp was given, but "
                                                              "vllm-omni .* patch `serve-flag`.*Refusing to start"):
        _patching.run_unit(patch_serve_flag, changed)
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "/m", f"--load_format={FLAG}"])
    assert _patching.load_format_requested()
    _patching._status["load-path"] = "skipped: test"  # a worker-side unit the API server checks for the workers
    with pytest.raises(_patching.LoadFormatUnavailable, match="patch `load-path` needs \\(skipped: test\\)"):
        stage_fields(load_format=FLAG)


def test_the_flag_is_found_in_a_vllm_config_file_too(tmp_path):
    """``vllm serve --config FILE`` (vLLM expands the YAML into arguments): the flag there counts as given."""
    ours, other, broken = tmp_path / "ours.yaml", tmp_path / "other.yaml", tmp_path / "broken.yaml"
    ours.write_text(f"model: /m\nomni: true\nload-format: {FLAG}\n")
    other.write_text("model: /m\nload_format: auto\n")
    broken.write_text("model: [unclosed\n")
    assert _patching.load_format_requested(["vllm", "serve", "--config", str(ours)])
    assert _patching.load_format_requested(["vllm", "serve", f"--config={ours}"])
    assert not _patching.load_format_requested(["vllm", "serve", "--config", str(other)])
    assert not _patching.load_format_requested(["vllm", "serve", "--config", str(broken)])
    assert not _patching.load_format_requested(["vllm", "serve", "--config", str(tmp_path / "missing.yaml")])


# --- 3. vllm-omni's Wan2.2 pipeline loads its DiTs through our path ----------------------------------------
def load_wan22(world, root: Path, **fields):
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.forward_context import set_forward_context

    od_config = OmniDiffusionConfig(**stage_fields(model=str(root), model_class_name="WanPipeline", **fields))
    loader = runner_loader(od_config)
    with set_forward_context(vllm_config=world, omni_diffusion_config=od_config), \
            captured_logs("vllm_diffusion_plugin.doors.omni.patch_load_path", logging.INFO) as logs:
        model = loader.load_model(load_device="cpu", load_format="default", device=torch.device("cpu"))
    return model, logs


def checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for file in glob.glob(str(folder / "*.safetensors")):
        state.update(load_file(file))
    return state


def reference(base: dict[str, torch.Tensor], lora: Path, scale: float) -> dict[str, torch.Tensor]:
    """``W + scale * alpha / r * B @ A`` in float64 for every LoRA target (diffusers names)."""
    from safetensors.torch import load_file

    tensors, out = load_file(str(lora)), {k: v.double() for k, v in base.items()}
    for key in tensors:
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
            A, B = tensors[key].double(), tensors[key.replace("lora_A", "lora_B")].double()
            alpha = tensors[key.replace("lora_A.weight", "alpha")].item()
            out[f"{module}.weight"] += scale * alpha / A.shape[0] * B @ A
    return out


def omni_view(model_dit, name: str, rows: int) -> torch.Tensor:
    """The rows of vllm-omni's parameter that hold the diffusers weight ``name`` (q/k/v stacked in to_qkv)."""
    params = dict(model_dit.named_parameters())
    for i, part in enumerate(("to_q", "to_k", "to_v")):
        if f".attn1.{part}." in name:
            return params[name.replace(f".attn1.{part}.", ".attn1.to_qkv.")][i * rows:(i + 1) * rows]
    name = name.replace(".to_out.0.", ".to_out.").replace(".ffn.net.0.", ".ffn.net_0.")
    return params[name.replace(".ffn.net.2.", ".ffn.net_2.")]


@pytest.mark.parametrize("door", ["diffusion_hsdp", "vllm_omni_distill"])
def test_wan22_loads_through_our_path_with_one_lora_per_dit(omni_world, wan22, door):
    if door == "diffusion_hsdp":
        fields = {"additional_config": {"diffusion_hsdp": {
            "lora_path": [f"transformer={wan22.high}", f"transformer_2={wan22.low}@0.5"]}}}
        scales = (1.0, 0.5)
    else:  # vllm-omni's own distilled-LoRA options go through our fusion (by position, as vllm-omni assigns)
        fields = {"lora_backend": "distill", "lora_path": [str(wan22.high), str(wan22.low)]}
        scales = (1.0, 1.0)
    model, logs = load_wan22(omni_world, wan22.root, load_format=FLAG, **fields)

    for component, lora, scale in zip(("transformer", "transformer_2"), (wan22.high, wan22.low), scales):
        base = checkpoint(wan22.root / component)
        expected = reference(base, lora, scale)
        dit = getattr(model, component)
        fused = 0
        for name, want in expected.items():
            if name == "scale_shift_table":
                continue
            got = omni_view(dit, name, rows=want.shape[0]).double()
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"{component}.{name}")
            fused += not torch.equal(want, base[name].double())
        assert fused == 2 * 2 * 4  # 2 blocks x 2 attentions x (to_q, to_k, to_v, to_out.0)
        report = [m for m in logs.messages(logging.INFO) if m.startswith(f"diffusion-hsdp load report: component={component} ")]
        assert len(report) == 1, logs.messages
        assert f"bytes_read={sum(t.numel() * t.element_size() for t in base.values())} " in report[0]
        assert " lora_targets=16 lora_device=cpu " in report[0]
        assert " rank=0 world_size=1 strategy=full " in report[0]
    if door == "vllm_omni_distill":
        assert model.lora_is_fused  # vllm-omni's own fusion is skipped: the LoRA is not applied twice


def test_a_missing_weight_is_an_error_naming_it(omni_world, wan22, tmp_path):
    import json
    import shutil

    root = tmp_path / "wan22"
    shutil.copytree(wan22.root, root)
    index_path = root / "transformer_2" / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dropped = "blocks.1.attn2.to_k.weight"
    file = root / "transformer_2" / index["weight_map"].pop(dropped)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    del tensors[dropped]
    save_file(tensors, str(file), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"not in the checkpoint: .*transformer_2\.blocks\.1\.attn2\.to_k\.weight"):
        load_wan22(omni_world, root, load_format=FLAG)


def test_a_wan_format_lora_with_bias_diffs_fuses_exactly(omni_world, wan22, tmp_path):
    """Wan/LightX2V naming (``diffusion_model.blocks.N.self_attn.q.lora_down/up``, ``diff_b``) for transformer_2:
    our formats resolve it against diffusers names, and bias diffs (scaled by @SCALE, as diffusers does) land in
    the streamed bias tensors."""
    from safetensors.torch import save_file

    gen, rank, alpha = torch.Generator().manual_seed(7), 4, 8.0
    base = checkpoint(wan22.root / "transformer_2")
    lora, expected = {}, {k: v.double() for k, v in base.items()}
    for block in range(2):
        for wan, ours in (("self_attn.q", "attn1.to_q"), ("cross_attn.o", "attn2.to_out.0")):
            weight = base[f"blocks.{block}.{ours}.weight"]
            down = torch.randn(rank, weight.shape[1], generator=gen) * 0.1
            up = torch.randn(weight.shape[0], rank, generator=gen) * 0.1
            diff_b = torch.randn(weight.shape[0], generator=gen) * 0.1
            key = f"diffusion_model.blocks.{block}.{wan}"
            lora |= {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up, f"{key}.alpha": torch.tensor(alpha),
                     f"{key}.diff_b": diff_b}
            expected[f"blocks.{block}.{ours}.weight"] += 0.5 * alpha / rank * up.double() @ down.double()
            expected[f"blocks.{block}.{ours}.bias"] += 0.5 * diff_b.double()  # diff_b scales with @SCALE
    path = tmp_path / "lightx2v.safetensors"
    save_file(lora, str(path))

    model, _ = load_wan22(omni_world, wan22.root, load_format=FLAG,
                          additional_config={"diffusion_hsdp": {"lora_path": [f"transformer_2={path}@0.5"]}})
    for name, want in expected.items():
        if name != "scale_shift_table":
            got = omni_view(model.transformer_2, name, rows=want.shape[0]).double()
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


def test_several_loras_for_one_dit_stack(omni_world, wan22):
    model, _ = load_wan22(omni_world, wan22.root, load_format=FLAG, additional_config={"diffusion_hsdp": {
        "lora_path": [f"transformer={wan22.high}", f"transformer={wan22.high}@0.5"]}})
    expected = reference(checkpoint(wan22.root / "transformer"), wan22.high, 1.5)
    for name, want in expected.items():
        if name != "scale_shift_table":
            got = omni_view(model.transformer, name, rows=want.shape[0]).double()
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


def test_rank_local_on_one_rank_reads_everything_with_full(omni_world, wan22):
    """One unsharded rank has no rows to split: rank_local loads with full and the report says so."""
    model, logs = load_wan22(omni_world, wan22.root, load_format=FLAG,
                             additional_config={"diffusion_hsdp": {"hsdp_weight_load": "rank_local"}})
    reports = [m for m in logs.messages(logging.INFO) if m.startswith("diffusion-hsdp load report:")]
    assert len(reports) == 2 and all(" strategy=full " in m for m in reports), reports


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_families_load_through_our_path_with_a_lora(omni_world, family, tmp_path):
    """vllm-omni's FLUX, Qwen-Image and Z-Image DiTs (their own names, q/k/v stacked) read by our door from a
    checkpoint diffusers wrote, with a diffusers-format LoRA at scale 0.7, equal vllm-omni's own ``load_weights``
    fed the checkpoint with the LoRA merged in float64 -- and differ clearly from the same load without it."""
    import json

    import diffusers
    from safetensors.torch import load_file
    from vllm_omni.diffusion.data import OmniDiffusionConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    from vllm_diffusion_plugin.tiny.models import write_tiny_lora

    _, name, config = FAMILIES[family]
    torch.manual_seed(0)
    written = getattr(diffusers, name)(**config)  # initialized by diffusers, saved in several shards
    written.save_pretrained(tmp_path / "transformer", max_shard_size="40KB")
    index = {"_class_name": "OneDit", "transformer": ["diffusers", name]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    lora = write_tiny_lora(tmp_path / "lora.safetensors", written, seed=3, targets=(
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"))
    base = checkpoint(tmp_path / "transformer")
    merged = reference(base, lora, 0.7)
    pairs = [k for k in load_file(str(lora)) if k.endswith(".lora_A.weight")]

    def omni_load(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pipeline = OneDitPipeline(build_family_dit(family))
        pipeline.load_weights((f"transformer.{k}", v.float()) for k, v in state.items())
        return {n: p.detach() for n, p in pipeline.named_parameters()}

    ours = OneDitPipeline(build_family_dit(family))
    ours.weights_sources = [DiffusersPipelineLoader.ComponentSource(str(tmp_path), "transformer", None, "transformer.")]
    loader = runner_loader(OmniDiffusionConfig(**stage_fields(model=str(tmp_path), load_format=FLAG, additional_config={
        "diffusion_hsdp": {"lora_path": [f"transformer={lora}@0.7"]}})))
    loader.load_weights(ours)

    want, unfused = omni_load(merged), omni_load(base)
    got = {n: p.detach() for n, p in ours.named_parameters()}
    assert sorted(got) == sorted(want)
    for param in want:
        torch.testing.assert_close(got[param], want[param], rtol=0, atol=1e-6, msg=f"{family}: {param}")
    changed = [p for p in want if not torch.equal(want[p], unfused[p])]
    assert len(pairs) >= 4 and any("qkv" in p for p in changed), (family, pairs, changed)
    (report,) = [c for c in loader._diffusion_hsdp_state["report"].components if c.name == "transformer"]
    assert report.bytes_read == sum(t.nbytes for t in base.values()) and report.lora_keys_fused == len(pairs), report
