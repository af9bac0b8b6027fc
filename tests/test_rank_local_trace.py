"""The row bindings ``rank_local`` uses under vllm-omni, learned by tracing a model's own ``load_weights`` on
``meta`` tensors (``doors/omni/rank_local.py``), and the refusals for what a row binding cannot express.

The models here are small stand-ins with the ``load_weights`` shapes vllm-omni's DiTs use (q/k/v stacked with
``narrow().copy_()``, renamed tensors, dtype casts); the real Wan2.2 pipeline is traced in
``tests/omni/test_omni_rank_local.py``."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from vllm_diffusion_plugin.doors.omni.rank_local import TraceError, check_coverage, trace_bindings
from vllm_diffusion_plugin.engine.io.rows import RowBinding
from vllm_diffusion_plugin.engine.errors import WeightLoadError

ROWS, COLS = 4, 3
KEYS = {"attn.to_q.weight": (ROWS, COLS), "attn.to_k.weight": (ROWS, COLS), "attn.to_v.weight": (ROWS, COLS),
        "attn.to_q.bias": (ROWS,), "attn.to_k.bias": (ROWS,), "attn.to_v.bias": (ROWS,),
        "ffn.net.0.proj.weight": (5, COLS), "scale": ()}


def dit_source(keys=KEYS, dtype=torch.bfloat16, component="transformer"):
    tensors = {k: types.SimpleNamespace(shape=shape, dtype=dtype) for k, shape in keys.items()}
    return types.SimpleNamespace(component=component, prefix=f"{component}.", adapter=None,
                                 source=types.SimpleNamespace(tensors=tensors, folder=f"/ckpt/{component}"))


class Pipeline(nn.Module):
    """A pipeline whose DiT stacks q/k/v like vllm-omni's (``QKVParallelLinear.weight_loader``)."""

    def __init__(self, mode: str = "ok") -> None:
        super().__init__()
        self.mode = mode
        self.transformer = nn.Module()
        dit = self.transformer
        dit.to_qkv = nn.Linear(COLS, 3 * ROWS, device="meta", dtype=torch.float32)
        dit.ffn_0 = nn.Linear(COLS, 5, bias=False, device="meta")
        dit.scale = nn.Parameter(torch.empty((), device="meta"))

    def load_weights(self, weights):
        params, loaded = dict(self.named_parameters()), set()
        for name, tensor in weights:
            for i, part in enumerate(("to_q", "to_k", "to_v")):
                if f".attn.{part}." in name:
                    target = params[name.replace(f"attn.{part}", "to_qkv")]
                    if self.mode == "skip_v" and part == "to_v":
                        break
                    transposed = self.mode == "transposed" and name.endswith("to_k.weight")
                    source = tensor.reshape(COLS, ROWS).t() if transposed else tensor
                    target.data.narrow(0, i * ROWS, ROWS).copy_(source)
                    loaded.add(name)
                    break
            else:
                target = params[name.replace("ffn.net.0.proj", "ffn_0")]
                if self.mode == "fill" and name.endswith("scale"):
                    target.data.fill_(1.0)
                elif self.mode == "replace" and name.endswith("scale"):
                    target.data = tensor
                else:
                    target.data.copy_(tensor.to(torch.float32))  # a cast keeps the rows' origin
                loaded.add(name)
        return loaded


def test_stacked_renamed_and_cast_tensors_are_bound_row_by_row():
    dit = dit_source()
    bindings, loaded = trace_bindings(Pipeline(), [dit])
    assert loaded == {f"transformer.{k}" for k in KEYS}
    assert sorted(bindings["transformer"], key=lambda b: (b.target, b.start)) == sorted([
        RowBinding("attn.to_q.weight", "transformer.to_qkv.weight", 0, 0, ROWS),
        RowBinding("attn.to_k.weight", "transformer.to_qkv.weight", ROWS, 0, ROWS),
        RowBinding("attn.to_v.weight", "transformer.to_qkv.weight", 2 * ROWS, 0, ROWS),
        RowBinding("attn.to_q.bias", "transformer.to_qkv.bias", 0, 0, ROWS),
        RowBinding("attn.to_k.bias", "transformer.to_qkv.bias", ROWS, 0, ROWS),
        RowBinding("attn.to_v.bias", "transformer.to_qkv.bias", 2 * ROWS, 0, ROWS),
        RowBinding("ffn.net.0.proj.weight", "transformer.ffn_0.weight", 0, 0, 5),
        RowBinding("scale", "transformer.scale"),
    ], key=lambda b: (b.target, b.start))
    pipeline = Pipeline()
    check_coverage(dit, pipeline.transformer, bindings["transformer"])  # every row exactly once


@pytest.mark.parametrize(("mode", "match"), [
    ("fill", r"transformer\.scale: written by aten\.fill_"),
    ("transposed", r"transformer\.to_qkv\.weight: attn\.to_k\.weight is copied in through a reshaped, transposed"),
    ("replace", r"transformer\.scale: replaced by load_weights"),
])
def test_what_a_row_binding_cannot_express_is_refused_naming_the_parameter(mode, match):
    with pytest.raises(TraceError, match=match) as caught:
        trace_bindings(Pipeline(mode), [dit_source()])
    assert "use hsdp_weight_load=full or broadcast" in str(caught.value)


def test_rows_no_checkpoint_tensor_fills_are_named_with_their_range():
    dit = dit_source()
    pipeline = Pipeline("skip_v")
    bindings, _ = trace_bindings(pipeline, [dit])
    with pytest.raises(WeightLoadError, match=r"transformer\.to_qkv\.weight \(rows 8:12\), "
                                              r"transformer\.to_qkv\.bias \(rows 8:12\)"):
        check_coverage(dit, pipeline.transformer, bindings["transformer"])


def test_a_model_that_cannot_run_on_meta_is_refused_naming_it():
    class DataDependent(Pipeline):
        def load_weights(self, weights):
            for _, tensor in weights:
                tensor.sum().item()

    with pytest.raises(TraceError, match=r"DataDependent\.load_weights cannot run on meta tensors"):
        trace_bindings(DataDependent(), [dit_source()])


# ---- reading bound rows: several checkpoint tensors into one stacked target ------------------------------
def test_bound_rows_of_several_tensors_fill_one_stacked_target_exactly(tmp_path, monkeypatch, capsys):
    """``read_bound_rows`` on a real diffusers checkpoint: the q/k/v weights of block 0 read into one stacked
    (3N, C) target, a bias into a bigger target at an offset; bytes counted once, the bar shows them all."""
    import sys

    from safetensors.torch import load_file

    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint
    from vllm_diffusion_plugin.engine.io.rows import read_bound_rows
    from vllm_diffusion_plugin.tiny.models import write_tiny_pipeline

    root = write_tiny_pipeline(tmp_path, "wan")
    source = resolve_checkpoint(root, components=["transformer"])[0]
    state = {}
    for file in source.files:
        state.update(load_file(str(file)))
    parts = [f"blocks.0.attn1.to_{p}.weight" for p in "qkv"]
    rows = state[parts[0]].shape[0]
    stacked = torch.full((3 * rows, state[parts[0]].shape[1]), float("nan"))
    bias = torch.full((rows + 5,), float("nan"))
    bindings = [RowBinding(key, "stacked", i * rows, 0, rows) for i, key in enumerate(parts)]
    bindings.append(RowBinding("blocks.0.attn1.to_q.bias", "bias", 5, 0, rows))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    keys, stats = read_bound_rows(source, bindings, {"stacked": stacked, "bias": bias}, progress=True)
    assert keys == {*parts, "blocks.0.attn1.to_q.bias"}
    torch.testing.assert_close(stacked, torch.cat([state[k] for k in parts]), rtol=0, atol=0)
    torch.testing.assert_close(bias[5:], state["blocks.0.attn1.to_q.bias"], rtol=0, atol=0)
    assert bias[:5].isnan().all()  # rows no binding covers are left alone
    assert stats.total_bytes == stacked.nbytes + rows * 4
    assert "Loading transformer (own rows)" in capsys.readouterr().err
