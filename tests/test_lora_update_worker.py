"""The runtime LoRA update on a diffusion worker (``doors.omni.lora_update.run``) around a real load session: what it
answers for each outcome, and that a failure after the first write leaves a pipeline that serves nothing.

The session is the engine's own (a 1-rank load of a tiny Wan2.2 pipeline, its DiTs' rows as the swap reads them);
the pipeline stands for the one vllm-omni serves (``lora_update.keep`` leaves the state on it, as ``rank_local`` does
after its load). ``tests/serve/test_serve_lora_swap.py`` runs it in a real 2-rank server.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vllm_diffusion_plugin.doors.omni import lora_update
from vllm_diffusion_plugin.engine import swap
from vllm_diffusion_plugin.engine.config import LoadOptions
from vllm_diffusion_plugin.engine.session import LoadSession, LoraSpec
from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora, write_tiny_pipeline


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("worker-swap")
    checkpoint = write_tiny_pipeline(root / "wan", "wan", dtype=torch.bfloat16)
    model = build_tiny_model("wan")
    qkv = write_tiny_lora(root / "qkv.safetensors", model, seed=1)
    ffn = write_tiny_lora(root / "ffn.safetensors", model, seed=2, targets=("to_out.0", "ffn.net.0.proj"))
    return checkpoint, str(qkv), str(ffn)


class Pipeline(nn.Module):
    """What vllm-omni serves: its runner calls ``pipeline.forward(batch)``."""

    def __init__(self, dits: dict[str, nn.Module]):
        super().__init__()
        self.dits = nn.ModuleDict(dits)

    def forward(self, batch):
        return batch


def served(checkpoint: Path, loras: list[str], *, strategy: str = "rank_local") -> tuple[Pipeline, LoadSession]:
    session = LoadSession(LoadOptions(), device=torch.device("cpu"), dtype=torch.bfloat16,
                          lora_specs=[LoraSpec(Path(p)) for p in loras])
    loaded = session.load_all(checkpoint)
    pipeline = Pipeline(dict(loaded.modules))
    rows = swap.loaded_rows(loaded.modules, session.sources, device=session.device, dtype=session.dtype)
    lora_update.keep(pipeline, session, strategy=strategy, rows=rows if strategy == "rank_local" else None)
    return pipeline, session


def weights(pipeline: Pipeline) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pipeline.state_dict().items()}


def entry(path: str, scale: float | None = None, component: str | None = None) -> list:
    return [component, path, scale]


def test_a_swap_answers_the_new_set_and_equals_a_fresh_load(wan):
    checkpoint, qkv, ffn = wan
    pipeline, _ = served(checkpoint, [qkv])
    answer = lora_update.run(pipeline, [entry(ffn, 0.5, "transformer")], step_execution=False)
    assert answer["ok"] and answer["kind"] == "ok", answer
    assert [(x["component"], Path(x["path"]).name, x["scale"]) for x in answer["loras"]] == \
        [("transformer", "ffn.safetensors", 0.5)]
    assert answer["report"]["bytes_read"] > 0 and answer["seconds"] > 0
    fresh_session = LoadSession(LoadOptions(), device=torch.device("cpu"), dtype=torch.bfloat16,
                                lora_specs=[LoraSpec(Path(ffn), 0.5, "transformer")])
    fresh = Pipeline(dict(fresh_session.load_all(checkpoint).modules))
    assert all(torch.equal(a, b) for a, b in zip(weights(pipeline).values(), weights(fresh).values()))
    assert lora_update.run(pipeline, None, step_execution=False)["loras"] == answer["loras"]


def test_a_refused_lora_changes_nothing_and_the_pipeline_still_serves(wan, tmp_path):
    checkpoint, qkv, ffn = wan
    pipeline, session = served(checkpoint, [qkv])
    before, fused = weights(pipeline), session.fused_loras()
    tensors = load_file(ffn)
    save_file({k: torch.full_like(v, float("nan")) for k, v in tensors.items()}, tmp_path / "nan.safetensors")
    answer = lora_update.run(pipeline, [entry(str(tmp_path / "nan.safetensors"))], step_execution=False)
    assert answer["kind"] == "refused" and "nan.safetensors" in answer["error"], answer
    assert all(torch.equal(before[k], v) for k, v in weights(pipeline).items())
    assert session.fused_loras() == fused and pipeline.forward("batch") == "batch"


def test_a_failure_after_the_first_write_leaves_a_pipeline_that_serves_nothing(wan, monkeypatch):
    checkpoint, qkv, ffn = wan
    pipeline, _ = served(checkpoint, [qkv])
    real, calls = swap.load_bound_rows, []

    def second_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("read failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(swap, "load_bound_rows", second_fails)
    answer = lora_update.run(pipeline, [entry(ffn)], step_execution=False)
    assert answer["kind"] == "failed" and "read failed" in answer["error"], answer
    with pytest.raises(RuntimeError, match="mixed LoRA weights.*read failed"):
        pipeline.forward("batch")
    monkeypatch.setattr(swap, "load_bound_rows", real)
    again = lora_update.run(pipeline, [entry(qkv)], step_execution=False)  # no swap on a mixed model either
    assert again["kind"] == "failed" and "earlier LoRA update" in again["error"]


def test_what_cannot_swap_is_unsupported_and_untouched(wan):
    checkpoint, qkv, ffn = wan
    pipeline, _ = served(checkpoint, [qkv], strategy="full")
    answer = lora_update.run(pipeline, [entry(ffn)], step_execution=False)
    assert answer["kind"] == "unsupported" and "hsdp_weight_load=rank_local" in answer["error"]
    assert lora_update.run(pipeline, None, step_execution=False)["ok"]  # it still says what it serves
    pipeline, _ = served(checkpoint, [qkv])
    answer = lora_update.run(pipeline, [entry(ffn)], step_execution=True)
    assert answer["kind"] == "unsupported" and "step execution" in answer["error"]
    assert lora_update.run(nn.Module(), None, step_execution=False)["kind"] == "unsupported"  # not our load
