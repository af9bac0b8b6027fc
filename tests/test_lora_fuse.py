"""LoRA fusion: the accelerator device rule (DESIGN.md fix #1), fallbacks, the CPU kernels, integrity, unfuse.

The seed bug (review thread seeds/000_*.txt): CPU-resident weights were fused with CPU matmuls even when a
usable accelerator was present (``compute_dev = params.device if params.device.type != "cpu" else None``).
``test_cpu_weights_are_fused_on_the_usable_accelerator`` and ``test_every_cpu_weight_is_handed_the_accelerator``
fail on that code; the fallback tests pin the other half (unusable device / failing H2D -> CPU, same numbers).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from vllm_diffusion_plugin.engine import platform
from vllm_diffusion_plugin.engine.lora import (
    LoraDelta,
    LoraFusionError,
    NonFiniteFusionError,
    PartiallyFusedError,
    fuse_lora,
    unfuse_lora,
)
from vllm_diffusion_plugin.engine.lora import fuse as fuse_mod
from vllm_diffusion_plugin.engine.lora import weight as weight_mod
from vllm_diffusion_plugin.testing.logs import captured_logs


class Blocks(nn.Module):
    """``n`` blocks of (to_q with bias, ff without bias); weight shapes (out, in) differ per layer kind."""

    def __init__(self, n: int = 3, dim: int = 48, hidden: int = 80, dtype=torch.float32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"to_q": nn.Linear(dim, dim), "ff": nn.Linear(dim, hidden, bias=False)}) for _ in range(n))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.to(dtype)


def make_deltas(model: nn.Module, *, rank: int = 4, dtype=torch.float32, seed: int = 1) -> dict[str, LoraDelta]:
    gen = torch.Generator().manual_seed(seed)
    deltas = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            out_f, in_f = mod.weight.shape
            A = (torch.randn(rank, in_f, generator=gen) * 0.3).to(dtype)
            B = (torch.randn(out_f, rank, generator=gen) * 0.3).to(dtype)
            deltas[name] = LoraDelta(A, B, 0.75)
    return deltas


def reference(model: nn.Module, deltas: dict[str, LoraDelta], sign: int = 1) -> dict[str, torch.Tensor]:
    """``W + sign * scale * B @ A`` (and bias/full deltas) in float64."""
    ref = {n: p.detach().to("cpu", torch.float64).clone() for n, p in model.named_parameters()}
    for name, d in deltas.items():
        weight, bias = (f"{name}.weight", f"{name}.bias") if name else ("weight", "bias")
        if d.A is not None:
            ref[weight] += sign * d.scale * (d.B.double() @ d.A.double())
        if d.full_delta is not None:
            ref[weight] += sign * d.full_delta.double()
        if d.bias_delta is not None:
            ref[bias] += sign * d.bias_delta.double()
    return ref


def assert_matches(model: nn.Module, ref: dict[str, torch.Tensor], *, rtol: float, atol: float) -> None:
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach().to("cpu", torch.float64), ref[name], rtol=rtol, atol=atol, msg=name)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu").clone() for n, p in model.named_parameters()}


def assert_bit_identical(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().to("cpu"), before[name]), f"{name} was modified"


@pytest.fixture
def no_accelerator(monkeypatch):
    """A CPU-only host, even in a process where the fake accelerator was installed by another test."""
    monkeypatch.setattr(platform, "local_device", lambda: torch.device("cpu"))


@pytest.fixture
def fuse_warnings():
    """Records fuse.py's warnings; vLLM's logger tree does not propagate to the root (so no caplog)."""
    with captured_logs("vllm_diffusion_plugin.engine.lora.fuse", logging.WARNING) as logs:
        yield logs.records


# ---- the seed regression: CPU weights + usable accelerator -> the matmul runs on the accelerator -----------
def test_cpu_weights_are_fused_on_the_usable_accelerator(fake_accelerator):
    assert platform.local_device() == fake_accelerator.device  # the lookup names it; the probe will pass
    model = Blocks()
    deltas = make_deltas(model)
    ref = reference(model, deltas)
    fake_accelerator.reset_counters()

    stats = fuse_lora(model, deltas)

    assert all(p.device.type == "cpu" for p in model.parameters())  # fused in place, still on the host
    ab_bytes = sum((d.A.numel() + d.B.numel()) * 4 for d in deltas.values())
    w_bytes = sum(model.get_submodule(n).weight.numel() * 4 for n in deltas)
    assert fake_accelerator.h2d_bytes >= ab_bytes + w_bytes  # A, B and every weight row went to the device
    assert fake_accelerator.d2h_bytes >= w_bytes  # fused rows came back, and nothing bigger than rows
    assert fake_accelerator.d2h_bytes < 2 * w_bytes
    matmuls = fake_accelerator.op_counts["aten::addmm"] + fake_accelerator.op_counts["aten::addmm_"]
    assert matmuls >= len(deltas)  # the matmul ran on the device, once per weight (one chunk each)
    assert stats.compute_device == str(fake_accelerator.device) and stats.cpu_kernel is None
    assert stats.params == len(deltas) and stats.fallbacks == 0
    assert_matches(model, ref, rtol=1e-6, atol=1e-5)


def test_every_cpu_weight_is_handed_the_accelerator(fake_accelerator, monkeypatch):
    """Spy on the per-weight function: each CPU weight receives the accelerator as compute_device, in fuse
    and unfuse; the spy then computes on the CPU so the numbers stay checkable."""
    seen = []
    real = fuse_mod.fuse_weight_

    def spy(weight, delta, *, compute_device, **kwargs):
        seen.append((weight.device.type, compute_device))
        return real(weight, delta, compute_device=None, **kwargs)

    monkeypatch.setattr(fuse_mod, "fuse_weight_", spy)
    model = Blocks()
    deltas = make_deltas(model)
    before, ref = snapshot(model), reference(model, deltas)
    fuse_lora(model, deltas)
    assert seen == [("cpu", fake_accelerator.device)] * len(deltas)
    assert_matches(model, ref, rtol=1e-6, atol=1e-5)
    seen.clear()
    unfuse_lora(model, deltas)
    assert seen == [("cpu", fake_accelerator.device)] * len(deltas)
    assert_matches(model, {n: t.double() for n, t in before.items()}, rtol=1e-6, atol=1e-5)


def test_weights_already_on_the_device_are_fused_there_in_place(fake_accelerator):
    model = Blocks().to(fake_accelerator.device)
    deltas = make_deltas(model)
    ref = reference(model, deltas)
    fake_accelerator.reset_counters()
    stats = fuse_lora(model, deltas)
    ab_bytes = sum((d.A.numel() + d.B.numel()) * 4 for d in deltas.values())
    assert fake_accelerator.h2d_bytes == ab_bytes  # only the factors travel; weights stay where they are
    assert fake_accelerator.h2d_async_bytes == ab_bytes  # in batches through pinned memory, no pageable copy each
    assert stats.compute_device == str(fake_accelerator.device)
    assert all(p.device == fake_accelerator.device for p in model.parameters())
    assert_matches(model, ref, rtol=1e-6, atol=1e-5)


def test_weights_and_factors_on_the_device_take_one_kernel_per_weight(fake_accelerator, monkeypatch):
    """The common case on a device (the staging ring put the weights there, the factors are there): one in-place
    ``addmm_`` per weight, no row slices or copies around it; the numbers of ``W.addmm_(B, A, alpha=s)``."""
    host = Blocks(dtype=torch.bfloat16)
    model = Blocks(dtype=torch.bfloat16).to(fake_accelerator.device)
    host_deltas = make_deltas(host, dtype=torch.bfloat16)
    deltas = {name: LoraDelta(d.A.to(fake_accelerator.device), d.B.to(fake_accelerator.device), d.scale)
              for name, d in host_deltas.items()}
    def row_chunks(*args, **kwargs):
        raise AssertionError("the common case went through the row-chunk loop")

    monkeypatch.setattr(weight_mod, "_fuse_on_device", row_chunks)
    fake_accelerator.reset_counters()
    fuse_lora(model, deltas)
    assert fake_accelerator.op_counts["aten::addmm_"] + fake_accelerator.op_counts["aten::addmm"] == len(deltas)
    assert fake_accelerator.h2d_bytes == 0
    with torch.no_grad():
        for name, d in host_deltas.items():
            host.get_submodule(name).weight.addmm_(d.B, d.A, alpha=d.scale)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(model.parameters(), host.parameters()))


def test_weight_rows_are_staged_in_chunks_of_at_most_chunk_mb(fake_accelerator):
    model = nn.Linear(1024, 1024, bias=False)  # 4 MiB fp32 -> four 1 MiB chunks
    deltas = {"": LoraDelta(torch.randn(8, 1024) * 0.1, torch.randn(1024, 8) * 0.1, 0.5)}
    ref = reference(model, deltas)
    fake_accelerator.reset_counters()
    fuse_lora(model, deltas, chunk_mb=1)
    assert fake_accelerator.h2d_copies == 2 + 4  # A, B once; four row chunks
    assert fake_accelerator.d2h_copies >= 4
    assert_matches(model, ref, rtol=1e-6, atol=1e-5)


def test_bf16_weights_on_the_accelerator_round_once(fake_accelerator):
    model = Blocks(dtype=torch.bfloat16)
    deltas = make_deltas(model, dtype=torch.bfloat16)
    ref = reference(model, deltas)
    fuse_lora(model, deltas)
    for name, p in model.named_parameters():  # computed in fp32 on the device, rounded once: the nearest bf16
        close = (p.double() - ref[name].to(torch.bfloat16).double()).abs() <= ref[name].abs() * 2**-8
        assert close.all(), name


# ---- fallbacks: the probe fails, or H2D fails half-way --------------------------------------------------
def test_failed_probe_uses_the_cpu_path_with_the_same_numbers(fake_accelerator):
    model = Blocks()
    deltas = make_deltas(model)
    ref = reference(model, deltas)
    with fake_accelerator.fail_probe():
        assert fuse_mod.resolve_compute_device() is None
        fake_accelerator.reset_counters()
        stats = fuse_lora(model, deltas)
    assert fake_accelerator.h2d_copies == 0 and sum(fake_accelerator.op_counts.values()) == 0
    assert stats.compute_device == "cpu" and stats.cpu_kernel == "fp32-chunks"
    assert_matches(model, ref, rtol=1e-6, atol=1e-5)


def test_h2d_failure_mid_weight_falls_back_to_cpu_once(fake_accelerator, fuse_warnings):
    model = nn.Sequential(nn.Linear(256, 2048, bias=False), nn.Linear(256, 512, bias=False))  # 2 MiB + 0.5 MiB
    deltas = make_deltas(model)
    ref = reference(model, deltas)
    first = deltas["0"]
    ab0 = (first.A.numel() + first.B.numel()) * 4
    fake_accelerator.reset_counters()
    # A, B and the first 1 MiB chunk of weight "0" fit; its second chunk and everything after fail.
    with fake_accelerator.fail_h2d_after(ab0 + (1 << 20)):
        stats = fuse_lora(model, deltas, chunk_mb=1)
    assert stats.fallbacks == 2 and stats.compute_device == str(fake_accelerator.device)
    assert stats.cpu_kernel == "fp32-chunks"
    assert fake_accelerator.d2h_bytes >= 1 << 20  # the first chunk was fused on the device and written back
    assert len(fuse_warnings) == 1 and "CPU path" in fuse_warnings[0].getMessage()
    assert "rows 1024: onward" in fuse_warnings[0].getMessage()
    assert_matches(model, ref, rtol=1e-6, atol=1e-5)  # no row fused twice, none skipped


def test_device_is_resolved_once_per_call(fake_accelerator, monkeypatch):
    calls = {"local_device": 0, "usable_device": 0}
    real_local, real_usable = platform.local_device, platform.usable_device

    def counting(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(platform, "local_device", counting("local_device", real_local))
    monkeypatch.setattr(platform, "usable_device", counting("usable_device", real_usable))
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(150)))  # 300 parameters
    deltas = make_deltas(model, rank=2)
    fuse_lora(model, deltas)
    assert calls == {"local_device": 1, "usable_device": 1}
    unfuse_lora(model, deltas)
    assert calls == {"local_device": 2, "usable_device": 2}


# ---- the CPU path ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_path_matches_float64_reference(no_accelerator, dtype):
    model = Blocks(dtype=dtype)
    deltas = make_deltas(model, dtype=dtype)
    ref = reference(model, deltas)
    stats = fuse_lora(model, deltas)
    assert stats.compute_device == "cpu"
    assert stats.cpu_kernel == fuse_mod.cpu_kernel(dtype)
    rtol = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    assert_matches(model, ref, rtol=rtol, atol=1e-5)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_cpu_kernel_rule(no_accelerator, monkeypatch):
    monkeypatch.setattr(weight_mod, "_FAST_LOWP", {})
    probes = []

    def probe(dtype):
        probes.append(dtype)
        return dtype == torch.bfloat16, 1.0, 1.0

    monkeypatch.setattr(weight_mod, "_lowp_gemm_is_fast", probe)
    assert fuse_mod.cpu_kernel(torch.float32) == "fp32-chunks" and probes == []  # fp32 never probes
    assert fuse_mod.cpu_kernel(torch.bfloat16) == "native"
    assert fuse_mod.cpu_kernel(torch.float16) == "fp32-chunks"
    assert fuse_mod.cpu_kernel(torch.bfloat16) == "native" and probes == [torch.bfloat16, torch.float16]  # cached
    with torch.backends.mkldnn.flags(enabled=False):  # a host without fast bf16 GEMM kernels: no probe needed
        assert fuse_mod.cpu_kernel(torch.bfloat16) == "fp32-chunks"
    assert len(probes) == 2


def test_cpu_kernel_probe_runs_and_restores_threads(no_accelerator):
    threads = torch.get_num_threads()
    fast, low_ms, fp32_ms = weight_mod._lowp_gemm_is_fast(torch.bfloat16)
    assert torch.get_num_threads() == threads
    assert low_ms > 0 and fp32_ms > 0 and fast == (low_ms <= 2 * fp32_ms)


@pytest.mark.parametrize("kernel", ["native", "fp32-chunks"])
def test_both_cpu_kernels_give_the_nearest_bf16(no_accelerator, monkeypatch, kernel):
    monkeypatch.setattr(weight_mod, "cpu_kernel", lambda dtype: kernel)
    model = Blocks(dtype=torch.bfloat16)
    deltas = make_deltas(model, dtype=torch.bfloat16)
    ref = reference(model, deltas)
    assert fuse_lora(model, deltas).cpu_kernel == kernel
    for name, p in model.named_parameters():
        nearest = ref[name].to(torch.bfloat16)
        assert (p != nearest).float().mean() < 1e-3, name  # double rounding aside, the nearest bf16
        torch.testing.assert_close(p.double(), ref[name], rtol=2**-8, atol=1e-6)


def test_native_kernel_is_skipped_for_mixed_dtypes(no_accelerator, monkeypatch):
    monkeypatch.setattr(weight_mod, "cpu_kernel", lambda dtype: "native")
    model = Blocks(dtype=torch.bfloat16)
    deltas = make_deltas(model, dtype=torch.float32)  # fp32 factors: rounding them to bf16 would lose precision
    assert fuse_lora(model, deltas).cpu_kernel == "fp32-chunks"


def test_cpu_buffers_are_reused_across_weights(no_accelerator, monkeypatch):
    allocated = []
    real_rows = weight_mod.Workspace.rows

    def rows(self, n, cols, dtype):
        before = {k: v.data_ptr() for k, v in self.buffers.items()}
        out = real_rows(self, n, cols, dtype)
        allocated.append(before.get(dtype) != self.buffers[dtype].data_ptr())
        return out

    monkeypatch.setattr(weight_mod.Workspace, "rows", rows)
    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(20)))
    fuse_lora(model, make_deltas(model))
    assert len(allocated) == 20 and sum(allocated) == 1  # one buffer for the whole call


# ---- unfuse, bias/full deltas ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unfuse_restores_the_weights(no_accelerator, dtype):
    model = Blocks(dtype=dtype)
    before = snapshot(model)
    deltas = make_deltas(model, dtype=dtype)
    fuse_lora(model, deltas)
    fused = snapshot(model)
    assert any(not torch.equal(fused[n], before[n]) for n in before)
    unfuse_lora(model, deltas)
    # Stated tolerance: two roundings to the weight dtype, one at |W + delta| and one at |W|, each at most
    # half an ulp, plus the fp32 rounding of the rank-r product in each direction:
    # |restored - W| <= eps/2 * (|W + delta| + |W|) + 2 * r * eps32 * |s| * (|B| @ |A|), eps = finfo(dtype).eps.
    half_ulp, eps32 = torch.finfo(dtype).eps / 2, torch.finfo(torch.float32).eps
    for name, p in model.named_parameters():
        error = (p.double() - before[name].double()).abs()
        bound = half_ulp * (fused[name].double().abs() + before[name].double().abs())
        d = deltas.get(name.rpartition(".")[0])
        if d is not None and name.endswith("weight"):
            bound = bound + 2 * d.rank * eps32 * abs(d.scale) * (d.B.double().abs() @ d.A.double().abs())
        assert (error <= bound).all(), f"{name}: max excess {(error - bound).max().item()}"


def test_bias_and_full_deltas(fake_accelerator):
    model = Blocks()
    q = model.blocks[0].to_q
    deltas = {"blocks.0.to_q": LoraDelta(torch.randn(2, 48), torch.randn(48, 2), 0.5, bias_delta=torch.randn(48),
                                         full_delta=torch.randn(48, 48)),
              "blocks.1.ff": LoraDelta(None, None, 1.0, full_delta=torch.randn(80, 48))}
    ref = reference(model, deltas)
    stats = fuse_lora(model, deltas)
    assert stats.params == 3  # blocks.0.to_q.weight, its bias, blocks.1.ff.weight
    assert_matches(model, ref, rtol=1e-6, atol=1e-5)
    assert q.bias.device.type == "cpu"


# ---- integrity ------------------------------------------------------------------------------------------
def test_bias_delta_without_bias_is_refused_before_writing(no_accelerator):
    model = Blocks()
    before = snapshot(model)
    deltas = make_deltas(model)
    deltas["blocks.2.ff"] = LoraDelta(None, None, 1.0, bias_delta=torch.ones(80))
    with pytest.raises(LoraFusionError, match=r"blocks\.2\.ff: bias delta \(80,\) but the module's bias is None"):
        fuse_lora(model, deltas)
    assert_bit_identical(model, before)


@pytest.mark.parametrize("where", ["cpu", "accelerator"])
def test_overflow_is_refused_before_writing(request, where, monkeypatch):
    if where == "cpu":
        monkeypatch.setattr(platform, "local_device", lambda: torch.device("cpu"))
    else:
        request.getfixturevalue("fake_accelerator")
    model = nn.Linear(8, 8, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(1.0)
    before = snapshot(model)
    deltas = {"": LoraDelta(torch.ones(1, 8), torch.ones(8, 1), 70000.0)}  # 70001 > fp16 max
    with pytest.raises(NonFiniteFusionError, match=r"\.weight would make rows 0:8 NaN/inf"):
        fuse_lora(model, deltas)
    assert_bit_identical(model, before)


@pytest.mark.parametrize("where", ["cpu", "accelerator"])
@pytest.mark.parametrize("bad", ["lora_A", "lora_B", "scale"])
def test_non_finite_lora_factors_are_refused_before_any_write(request, where, bad, monkeypatch):
    """Checked on the small factors up front (not on the fused weights): the error names the factor, and not
    even an earlier target of the call was written."""
    if where == "cpu":
        monkeypatch.setattr(platform, "local_device", lambda: torch.device("cpu"))
    else:
        request.getfixturevalue("fake_accelerator")
    model = Blocks(dtype=torch.bfloat16)
    deltas = make_deltas(model, dtype=torch.bfloat16)
    last = list(deltas)[-1]
    A, B, scale = deltas[last].A.clone(), deltas[last].B.clone(), deltas[last].scale
    if bad == "lora_A":
        A[0, 1] = float("nan")
    elif bad == "lora_B":
        B[2, 0] = float("inf")
    else:
        scale = float("inf")
    deltas[last] = LoraDelta(A, B, scale, source_keys=("k.lora_A.weight", "k.lora_B.weight"))
    before = snapshot(model)
    with pytest.raises(NonFiniteFusionError, match=rf"{last}\.weight has non-finite {bad} .*k\.lora_A\.weight.*"
                                                   rf"nothing was written"):
        fuse_lora(model, deltas)
    assert_bit_identical(model, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("special", [None, float("nan"), float("inf"), float("-inf"), -7.5])
def test_cpu_factor_maxima_equal_the_inf_norm(dtype, special):
    """The CPU's aminmax-based ``max|t|`` (not ``_foreach_norm``: slow there) agrees with the inf-norm,
    NaN and +-inf included, so the integrity rule sees exactly what it saw before."""
    gen = torch.Generator().manual_seed(0)
    A, B = torch.randn(4, 48, generator=gen).to(dtype), torch.randn(80, 4, generator=gen).to(dtype)
    if special is not None:
        B[5, 2] = special
    expected = [float(torch.linalg.vector_norm(t.double(), float("inf"))) for t in (A, B)]
    got = weight_mod.factor_maxima([LoraDelta(A, B, 0.5)])[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("where", ["cpu", "accelerator"])
def test_overflow_of_a_bf16_delta_is_refused_before_writing(request, where, monkeypatch):
    """Same dtype everywhere (the in-place fast paths), but the bound says the delta may overflow bf16."""
    if where == "cpu":
        monkeypatch.setattr(platform, "local_device", lambda: torch.device("cpu"))
        monkeypatch.setattr(weight_mod, "cpu_kernel", lambda dtype: "native")
    else:
        request.getfixturevalue("fake_accelerator")
    model = nn.Linear(8, 8, bias=False).bfloat16()
    before = snapshot(model)
    big = torch.full((1, 8), 3e38, dtype=torch.bfloat16)
    deltas = {"": LoraDelta(big, torch.full((8, 1), 2.0, dtype=torch.bfloat16), 1.0)}  # 6e38 > bf16 max
    with pytest.raises(NonFiniteFusionError, match=r"\.weight would make rows 0:8 NaN/inf"):
        fuse_lora(model, deltas)
    assert_bit_identical(model, before)


def test_failure_after_a_write_raises_partially_fused(no_accelerator):
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)).half()
    deltas = {"0": LoraDelta(torch.ones(1, 8), torch.ones(8, 1), 1.0),
              "1": LoraDelta(torch.ones(1, 8), torch.ones(8, 1), 70000.0)}  # the delta overflows fp16
    with pytest.raises(PartiallyFusedError, match=r"failed at 1 after 1 tensors .* partially fused, abort the load"):
        fuse_lora(model, deltas)


@pytest.mark.parametrize("kernel", ["native", "fp32-chunks"])
def test_a_non_finite_base_weight_is_caught_by_check_finite_and_otherwise_stays_where_it_was(
        no_accelerator, monkeypatch, kernel):
    monkeypatch.setattr(weight_mod, "cpu_kernel", lambda dtype: kernel)
    model = nn.Linear(8, 8, bias=False).bfloat16()
    with torch.no_grad():
        model.weight[3, 3] = float("nan")
    deltas = {"": LoraDelta(torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(8, 1, dtype=torch.bfloat16), 1.0)}
    ref = reference(model, deltas)
    # check_finite (lora_check_finite / VLLM_DIFFUSION_LORA_CHECK_FINITE): the base weight is named
    expected = PartiallyFusedError if kernel == "native" else NonFiniteFusionError  # native writes in place
    with pytest.raises(expected, match=r"rows 0:8 (are )?NaN/inf"):
        fuse_lora(model, deltas, check_finite=True)
    # off (the default): no extra pass; the fused weight is the reference, NaN exactly where the base had it
    model = nn.Linear(8, 8, bias=False).bfloat16()
    with torch.no_grad():
        model.weight.copy_(ref["weight"].to(torch.bfloat16) - 1)  # any finite base; NaN at [3, 3]
        model.weight[3, 3] = float("nan")
    ref = reference(model, deltas)
    fuse_lora(model, deltas)
    fused = model.weight.detach().double()
    assert torch.isnan(fused).nonzero().tolist() == [[3, 3]]
    finite = ~torch.isnan(ref["weight"])
    torch.testing.assert_close(fused[finite], ref["weight"][finite], rtol=2**-8, atol=0)


@pytest.mark.parametrize("where", ["cpu", "accelerator"])
def test_check_finite_catches_a_base_weight_that_overflows_with_a_bounded_delta(request, where, monkeypatch):
    """|W| near the dtype's max counts as a bad base weight: only the full check sees it."""
    if where == "cpu":
        monkeypatch.setattr(platform, "local_device", lambda: torch.device("cpu"))
        monkeypatch.setattr(weight_mod, "cpu_kernel", lambda dtype: "fp32-chunks")  # checks before writing
    else:
        request.getfixturevalue("fake_accelerator")
    model = nn.Linear(8, 8, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(60000.0)
    before = snapshot(model)
    deltas = {"": LoraDelta(torch.ones(1, 8).half(), torch.ones(8, 1).half(), 10000.0)}  # bound 1e4 < max / 2
    with pytest.raises(NonFiniteFusionError, match=r"\.weight would make rows 0:8 NaN/inf"):
        fuse_lora(model, deltas, check_finite=True)
    assert_bit_identical(model, before)


def test_meta_and_dtensor_weights_are_refused(no_accelerator):
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(LoraFusionError, match=r"on meta: fuse LoRA on plain materialized tensors, before sharding"):
        fuse_lora(model, {"": LoraDelta(torch.ones(1, 4), torch.ones(4, 1), 1.0)})


def test_bad_chunk_mb(no_accelerator):
    with pytest.raises(ValueError, match="chunk_mb must be positive, got 0"):
        fuse_lora(nn.Linear(4, 4), {}, chunk_mb=0)


def test_non_finite_in_a_later_chunk_on_the_device_is_partially_fused(fake_accelerator):
    model = nn.Linear(1024, 1024, bias=False).half().to(fake_accelerator.device)  # 2 MiB: two 1 MiB chunks
    with torch.no_grad():
        model.weight.zero_()
        model.weight[600:].fill_(60000.0)
    deltas = {"": LoraDelta(torch.ones(1, 1024), torch.ones(1024, 1), 10000.0)}
    with pytest.raises(PartiallyFusedError, match=r"rows 512:1024 NaN/inf; earlier rows were already fused"):
        fuse_lora(model, deltas, chunk_mb=1)
    assert (model.weight[:512].cpu() == 10000.0).all() and (model.weight[512:600].cpu() == 0).all()


def test_fuse_lora_files_second_file_failing_after_the_first_was_fused(no_accelerator, tmp_path):
    from safetensors.torch import save_file

    from vllm_diffusion_plugin.engine.lora import fuse_lora_files

    model = nn.Sequential(nn.Linear(8, 8, bias=False)).half()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    save_file({"0.lora_A.weight": torch.ones(1, 8), "0.lora_B.weight": torch.ones(8, 1)}, tmp_path / "a.safetensors")
    save_file({"0.lora_A.weight": torch.ones(1, 8), "0.lora_B.weight": torch.ones(8, 1) * 1000,  # 1e5 > fp16 max
               "0.alpha": torch.tensor(100.0)}, tmp_path / "b.safetensors")
    stats = fuse_lora_files(model, {tmp_path / "a.safetensors": 2.0})
    assert stats.targets == 1 and (model[0].weight == 3.0).all()
    with pytest.raises(PartiallyFusedError, match=r"b\.safetensors failed after 1 LoRA file\(s\) were fused"):
        fuse_lora_files(model, [(tmp_path / "a.safetensors", 1.0), (tmp_path / "b.safetensors", 1.0)])
    assert (model[0].weight == 4.0).all()  # the first file was fused, the second one touched nothing
