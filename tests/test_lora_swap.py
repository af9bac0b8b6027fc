"""Replacing a loaded model's fused LoRA set (issue 49): exact, whatever the strategy, rank count or quantization.

A swap re-reads the base rows of every module the old or new set touches from the checkpoint and fuses the new set
as the load does, so after any number of swaps the weights are bit for bit those of a fresh load with the final set.
The naive swap -- subtracting the old delta, adding the new -- drifts in bf16 (checked below, so these comparisons
can see it); a bad LoRA file is refused before any weight changes.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from safetensors.torch import load_file, save_file
from test_distributed_load import write_rich_lora, write_uneven_wan

from vllm_diffusion_plugin.doors import cli
from vllm_diffusion_plugin.engine.config import LoadOptions
from vllm_diffusion_plugin.engine.session import LoadSession, LoraSpec, LoraSwapFailed, LoraSwapRefused
from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora, write_tiny_pipeline


@pytest.fixture(scope="module")
def bf16_wan(tmp_path_factory) -> tuple[Path, list[str]]:
    """A bf16 tiny Wan2.2 pipeline (two DiTs) and three LoRA files touching different modules."""
    root = tmp_path_factory.mktemp("swap-wan")
    checkpoint = write_tiny_pipeline(root / "wan", "wan", dtype=torch.bfloat16)
    model = build_tiny_model("wan")
    loras = [write_tiny_lora(root / "qkv.safetensors", model, seed=1),
             write_tiny_lora(root / "out_ffn.safetensors", model, seed=2, targets=("to_out.0", "ffn.net.0.proj")),
             write_tiny_lora(root / "all.safetensors", model, seed=3,
                             targets=("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"))]
    return checkpoint, [str(p) for p in loras]


def _load(checkpoint: Path, loras: list[str], **options) -> LoadSession:
    session = LoadSession(LoadOptions(**options), device=torch.device("cpu"), dtype=torch.bfloat16,
                          lora_specs=[LoraSpec(Path(p)) for p in loras])
    session.load_all(checkpoint)
    return session


def _state(session: LoadSession) -> dict[str, torch.Tensor]:
    return {f"{name}/{key}": value.detach().clone() for name, module in session.loaded.modules.items()
            for key, value in module.state_dict().items()}


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_ten_swaps_back_and_forth_equal_a_fresh_load_with_the_last_set(bf16_wan):
    checkpoint, (qkv, out_ffn, every) = bf16_wan
    session = _load(checkpoint, [qkv])
    first = _state(session)
    sets = [[out_ffn], [every, qkv], [], [qkv], [out_ffn, every]] * 2
    for specs in sets:
        report = session.swap_loras([LoraSpec(Path(p)) for p in specs])
        names = [Path(e["path"]).name for e in report.loras]  # one file: both DiTs; two: one each, by position
        assert sorted(names) == sorted([Path(p).name for p in specs] * (2 if len(specs) == 1 else 1))
        assert report.bytes_read > 0 and report.modules > 0
    fresh = _load(checkpoint, sets[-1])
    assert not _differing(_state(session), _state(fresh))
    assert _differing(first, _state(fresh))  # the swaps changed what the first load fused
    assert [e["sha256"] for e in session.fused_loras()] == [e["sha256"] for e in fresh.fused_loras()]
    assert all(len(e["sha256"]) == 64 for e in session.fused_loras()) and "sha256" not in report.loras[0]


def test_the_naive_swap_drifts_where_the_exact_one_does_not(bf16_wan):
    """Subtract the old delta and add the new (SGLang's merge / unmerge) -- not bit for bit in bf16: the test above
    would see it."""
    checkpoint, (qkv, *_) = bf16_wan
    base = _state(_load(checkpoint, []))
    fused = _state(_load(checkpoint, [qkv]))
    key = next(k for k in fused if k.endswith("attn1.to_q.weight") and not torch.equal(fused[k], base[k]))
    delta = (fused[key].float() - base[key].float()).to(torch.bfloat16)
    assert not torch.equal(fused[key] - delta, base[key])


def test_swap_to_the_same_set_and_to_none_restores_the_checkpoint_bits(bf16_wan):
    checkpoint, (qkv, *_) = bf16_wan
    session = _load(checkpoint, [qkv])
    session.swap_loras([])
    assert not _differing(_state(session), _state(_load(checkpoint, [])))
    assert session.fused_loras() == []


def _nan_lora(path: Path, like: str) -> str:
    tensors = load_file(like)
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key][0, 0] = float("nan")
    save_file(tensors, path)
    return str(path)


def _foreign_lora(path: Path, like: str) -> str:
    save_file({k.replace("blocks.", "single_transformer_blocks."): v for k, v in load_file(like).items()}, path)
    return str(path)


def _wrong_shape_lora(path: Path, like: str) -> str:
    tensors = load_file(like)
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 3)
    save_file(tensors, path)
    return str(path)


@pytest.mark.parametrize("bad, named", [
    (lambda tmp, like: str(tmp / "missing.safetensors"), "does not exist"),
    (lambda tmp, like: _nan_lora(tmp / "nan.safetensors", like), "NaN"),
    (_foreign_lora_ := lambda tmp, like: _foreign_lora(tmp / "foreign.safetensors", like), "foreign.safetensors"),
    (lambda tmp, like: _wrong_shape_lora(tmp / "shape.safetensors", like), "shape.safetensors"),
], ids=["missing", "nan", "foreign-layout", "wrong-shape"])
def test_a_bad_lora_file_is_refused_before_any_weight_changes(bf16_wan, tmp_path, bad, named):
    checkpoint, (qkv, out_ffn, _) = bf16_wan
    session = _load(checkpoint, [qkv])
    before, fused_before = _state(session), session.fused_loras()
    path = bad(tmp_path, out_ffn)
    with pytest.raises(LoraSwapRefused, match=named) as refused:
        session.swap_loras([LoraSpec(Path(path))])
    assert "\n" not in str(refused.value) and "unchanged" in str(refused.value)
    assert not _differing(before, _state(session))
    assert session.fused_loras() == fused_before
    session.swap_loras([LoraSpec(Path(out_ffn))])  # and it still swaps afterwards
    assert not _differing(_state(session), _state(_load(checkpoint, [out_ffn])))


def test_a_checkpoint_changed_since_the_load_is_refused(bf16_wan, copy_checkpoint):
    checkpoint, (qkv, out_ffn, _) = bf16_wan
    copy = copy_checkpoint(checkpoint)
    session = _load(copy, [qkv])
    before = _state(session)
    shard = sorted((copy / "transformer").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes())  # same bytes, rewritten: a new modification time
    with pytest.raises(LoraSwapRefused, match=f"{shard.name}.*rewritten"):
        session.swap_loras([LoraSpec(Path(out_ffn))])
    assert not _differing(before, _state(session))


def test_a_failure_after_weights_began_to_change_says_the_model_is_mixed(bf16_wan, monkeypatch):
    from vllm_diffusion_plugin.engine import swap

    checkpoint, (qkv, out_ffn, _) = bf16_wan
    session = _load(checkpoint, [qkv])
    calls = []
    real = swap.load_bound_rows

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("read failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(swap, "load_bound_rows", second_fails)
    with pytest.raises(LoraSwapFailed, match="read failed.*part of the old set and part of the new"):
        session.swap_loras([LoraSpec(Path(out_ffn))])


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def swap_worker(rank: int, world_size: int, checkpoint: str, first: str, second: str, strategy: str,
                per_channel: bool | None) -> list[str]:
    """Load ``first`` with ``strategy`` (online fp8 unless ``per_channel`` is None), swap to ``second``, to none, to
    ``second``; every local shard bit for bit that of a fresh load with ``second``."""
    from torch.distributed.tensor import DTensor

    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.session import LoadSession
    from vllm_diffusion_plugin.testing.online_quant import attach_online_quant

    quantization = None if per_channel is None else functools.partial(attach_online_quant, per_channel=per_channel)

    def load(loras):
        session = LoadSession(LoadOptions(hsdp_weight_load=strategy), device=torch.device("cpu"),
                              dtype=torch.bfloat16, hsdp=HSDPConfig(), lora_specs=[LoraSpec(Path(p)) for p in loras],
                              quantization=quantization)
        session.load_all(checkpoint)
        return session

    def local(session):
        return {f"{n}/{k}": (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
                for n, m in session.loaded.modules.items() for k, v in m.state_dict().items()}

    session = load([first])
    for specs in ([second], [], [second]):
        session.swap_loras([LoraSpec(Path(p)) for p in specs])
    got, want = local(session), local(load([second]))
    return [k for k in want if not torch.equal(_bits(got[k]), _bits(want[k]))] + \
        (["<nothing quantized>"] if per_channel is not None and not any(v.dtype == torch.float8_e4m3fn
                                                                        for v in got.values()) else [])


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> tuple[str, str, str]:
    root = write_uneven_wan(tmp_path_factory.mktemp("swap-uneven"))
    rich = write_rich_lora(root.parent / "rich.safetensors", root)
    import diffusers

    plain = write_tiny_lora(root.parent / "plain.safetensors",
                            diffusers.WanTransformer3DModel.from_pretrained(root / "transformer"), seed=9)
    return str(root), str(rich), str(plain)


@pytest.mark.parametrize("strategy, per_channel", [
    ("full", None), ("broadcast", None), ("rank_local", None),
    ("rank_local", False), ("rank_local", True)],
    ids=["full-bf16", "broadcast-bf16", "rank_local-bf16", "rank_local-fp8-tensor", "rank_local-fp8-channel"])
def test_two_ranks_swap_exactly_with_every_strategy_and_online_fp8(uneven, strategy, per_channel):
    checkpoint, rich, plain = uneven
    results = run_distributed(swap_worker, 2, args=(checkpoint, rich, plain, strategy, per_channel), timeout_s=300)
    assert results == [[], []]


def test_online_quantized_layers_laid_out_whole_are_refused_before_any_weight_changes(bf16_wan):
    """``full`` leaves each online-quantized weight in its method's own layout (the stand-in's column-major ``.t()``,
    like vLLM's fp8): no row of it can be quantized again alone -- refused, naming rank_local."""
    from vllm_diffusion_plugin.testing.online_quant import attach_online_quant

    checkpoint, (qkv, out_ffn, _) = bf16_wan
    session = LoadSession(LoadOptions(), device=torch.device("cpu"), dtype=torch.bfloat16,
                          lora_specs=[LoraSpec(Path(qkv))], quantization=attach_online_quant)
    session.load_all(checkpoint)
    before = _state(session)
    with pytest.raises(LoraSwapRefused, match="own layout.*hsdp_weight_load=rank_local"):
        session.swap_loras([LoraSpec(Path(out_ffn))])
    assert not _differing(before, _state(session))


def test_cli_swap_lora_sets_and_save_fused_equal_a_fresh_load(bf16_wan, tmp_path, capsys):
    checkpoint, (qkv, out_ffn, every) = bf16_wan
    common = ["load", str(checkpoint), "--device", "cpu", "--dtype", "bfloat16", "--json"]
    assert cli.main([*common, "--lora", qkv, "--swap-lora", f"{out_ffn},{every}@0.5", "--swap-lora", "none",
                     "--swap-lora", f"transformer={out_ffn},transformer_2={every}@0.5",
                     "--save-fused", str(tmp_path / "swapped")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["swaps"]) == 3 and report["swaps"][1]["loras"] == []
    assert [(e["component"], e["scale"]) for e in report["swaps"][2]["loras"]] == [("transformer", 1.0),
                                                                                    ("transformer_2", 0.5)]
    assert cli.main([*common, "--lora", f"transformer={out_ffn}", "--lora", f"transformer_2={every}@0.5",
                     "--save-fused", str(tmp_path / "fresh")]) == 0
    for name in ("transformer", "transformer_2"):
        got, want = ({k: v for f in sorted((tmp_path / d / name).glob("*.safetensors")) for k, v in load_file(f).items()}
                     for d in ("swapped", "fresh"))
        assert not _differing(got, want)


def test_cli_swap_lora_with_a_missing_file_fails_before_any_rank_starts(bf16_wan, tmp_path, capsys):
    checkpoint, (qkv, *_) = bf16_wan
    assert cli.main(["load", str(checkpoint), "--device", "cpu", "--lora", qkv,
                     "--swap-lora", str(tmp_path / "nope.safetensors")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"vllm-diffusion: error: --swap-lora: LoRA file {tmp_path / 'nope.safetensors'} does not exist"]


def failing_rank_worker(rank: int, world_size: int, checkpoint: str, first: str, second: str) -> str:
    """Rank 1's read fails mid-swap; every rank must learn that the model is mixed, naming the cause."""
    from vllm_diffusion_plugin.engine import swap
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig

    session = LoadSession(LoadOptions(hsdp_weight_load="rank_local"), device=torch.device("cpu"),
                          dtype=torch.bfloat16, hsdp=HSDPConfig(), lora_specs=[LoraSpec(Path(first))])
    session.load_all(checkpoint)
    if rank == 1:
        def fails(*args, **kwargs):
            raise OSError("the store stopped answering")

        swap.load_bound_rows = fails
    try:
        session.swap_loras([LoraSpec(Path(second))])
    except LoraSwapFailed as exc:
        return str(exc)
    return "no error"


def test_a_rank_failing_mid_swap_fails_the_swap_on_every_rank(uneven):
    checkpoint, rich, plain = uneven
    results = run_distributed(failing_rank_worker, 2, args=(checkpoint, rich, plain), timeout_s=300)
    assert all("the store stopped answering" in r and "do not serve it" in r for r in results), results
    assert results[0].startswith("LoRA swap failed") and "rank 1: OSError" in results[0]
