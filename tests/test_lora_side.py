"""Which side fuses host-resident weights when an accelerator is usable: the faster one on this host, by timings taken
once per process (``lora.fuse.host_side``), not "the device because it is usable". On the H200 host the usable-device
rule made ``fuse_lora`` on ten A14B weights 5.8x slower than the CPU's own bf16 ``addmm_``.

``test_a_faster_cpu_keeps_host_weights_on_the_cpu`` fails on the usable-device rule (every host weight forwarded);
``test_a_faster_device_gets_the_host_weights_through_pinned_memory`` pins the other half (fix #1's forwarding)."""

from __future__ import annotations

import pytest
import torch
from test_lora_fuse import Blocks, assert_matches, make_deltas, reference

from vllm_diffusion_plugin.engine.lora import fuse as fuse_mod
from vllm_diffusion_plugin.engine.lora import fuse_lora


def fuse_with_timings(fake_accelerator, *, cpu_s: float, device_s: float):
    """Host-resident fp32 blocks fused after the rule was told these timings; checked against the float64
    reference. Returns ``(model, stats)``."""
    fuse_mod.record_side_timings(fake_accelerator.device, torch.float32, cpu_s=cpu_s, device_s=device_s)
    model = Blocks()
    deltas = make_deltas(model)
    ref = reference(model, deltas)
    fake_accelerator.reset_counters()
    stats = fuse_lora(model, deltas)
    assert_matches(model, ref, rtol=1e-6, atol=1e-5)
    return model, stats


def test_a_faster_cpu_keeps_host_weights_on_the_cpu(fake_accelerator):
    _, stats = fuse_with_timings(fake_accelerator, cpu_s=0.041, device_s=0.234)  # the H200 host's ten weights
    assert fake_accelerator.h2d_bytes == 0 and stats.compute_device == "cpu" and stats.cpu_kernel
    assert stats.host_rule.startswith("cpu: measured faster for host float32 weights (cpu 41.00 ms, through fakeacc:0 "
                                      "234.00 ms"), stats.host_rule


def test_a_faster_device_gets_the_host_weights_through_pinned_memory(fake_accelerator):
    model, stats = fuse_with_timings(fake_accelerator, cpu_s=0.041, device_s=0.027)
    assert stats.compute_device == str(fake_accelerator.device) and stats.cpu_kernel is None
    assert stats.host_rule.startswith("fakeacc:0: measured faster"), stats.host_rule
    assert fake_accelerator.pinned.allocations >= 1  # the rows crossed through a page-locked buffer
    assert fake_accelerator.d2h_bytes >= sum(p.numel() * 4 for n, p in model.named_parameters() if "weight" in n)


@pytest.mark.parametrize("preference, device_side", [("cpu", False), ("device", True)])
def test_an_explicit_side_needs_no_timing(fake_accelerator, monkeypatch, preference, device_side):
    def no_timing(*args):
        raise AssertionError("timed although the side was given")

    monkeypatch.setattr(fuse_mod, "side_timings", no_timing)
    model = Blocks()
    stats = fuse_lora(model, make_deltas(model), host_weights=preference)
    assert (stats.compute_device != "cpu") is device_side
    assert stats.host_rule.endswith(f"lora_host_weights={preference}")


def test_no_usable_accelerator_means_cpu_and_no_rule_in_the_report(monkeypatch):
    model = Blocks()
    stats = fuse_lora(model, make_deltas(model))
    assert stats.compute_device == "cpu" and stats.host_rule is None


def test_the_sides_are_timed_once_per_process_and_dtype(fake_accelerator, monkeypatch):
    """The real measurement (on the fake device it times Python dispatch: which side wins means nothing here),
    taken once per dtype, reused by later calls."""
    fuse_mod.forget_side_timings()
    calls = []
    real = fuse_mod.fuse_weight_
    monkeypatch.setattr(fuse_mod, "fuse_weight_", lambda *a, **k: calls.append(k["compute_device"]) or real(*a, **k))
    first = fuse_mod.side_timings(fake_accelerator.device, torch.bfloat16)
    assert all(0 < t < float("inf") for t in first) and calls.count(None) == 4 and len(calls) == 8
    assert fuse_mod.side_timings(fake_accelerator.device, torch.bfloat16) == first and len(calls) == 8
    fuse_mod.side_timings(fake_accelerator.device, torch.float32)
    assert len(calls) == 16


def test_a_side_that_fails_to_run_is_never_chosen(fake_accelerator):
    fuse_mod.forget_side_timings()
    with fake_accelerator.fail_h2d_after(0):
        cpu_s, device_s = fuse_mod.side_timings(fake_accelerator.device, torch.float32)
    assert device_s == float("inf") and cpu_s < device_s
    assert fuse_mod.host_side(fake_accelerator.device, torch.float32).device is None


def test_a_bad_preference_is_refused():
    with pytest.raises(ValueError, match="lora_host_weights must be auto, cpu or device, got 'gpu'"):
        fuse_mod.host_side(None, torch.float32, "gpu")


def test_the_load_report_says_which_side_ran_and_why(tiny_wan_dir, tmp_path, fake_accelerator):
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec
    from vllm_diffusion_plugin.engine.session import load_components
    from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora

    lora = write_tiny_lora(tmp_path / "lora.safetensors", build_tiny_model("wan"))
    fuse_mod.record_side_timings(fake_accelerator.device, torch.float32, cpu_s=0.01, device_s=0.02)
    loaded = load_components(tiny_wan_dir, options=LoadOptions(pinned_staging_mb=0), components=["transformer"],
                             device=fake_accelerator.device, dtype=torch.float32, lora_specs=[LoraSpec(lora)])
    data = loaded.report.to_dict()
    assert data["lora_compute_device"] == "cpu" and data["lora_host_rule"].startswith("cpu: measured faster"), data
