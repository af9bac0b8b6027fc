"""The ``fakeacc`` fake accelerator: CPU-equal numerics, exact aliasing, counters, failures, FSDP2."""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from torch import nn

from vllm_diffusion_plugin.testing import fake_accelerator as fake_module
from vllm_diffusion_plugin.testing.fake_mesh import fake_mesh
from vllm_diffusion_plugin.testing import pytest_plugin


def assert_same(device_tensor: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise equality of a device tensor (fetched to CPU) with a CPU tensor, dtype included."""
    assert device_tensor.device.type == "fakeacc"
    got = device_tensor.to("cpu")
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))


# -- the device ---------------------------------------------------------------------------------
def test_install_is_idempotent_and_is_the_fixture_value(fake_accelerator):
    assert fake_module.install() is fake_accelerator
    assert fake_accelerator.device == torch.device("fakeacc", 0)
    assert torch.accelerator.current_accelerator().type == "fakeacc"


def test_device_module_serves_generic_code(fake_accelerator):
    module = getattr(torch, fake_accelerator.device.type)
    assert module.is_available() and module.device_count() == 1 and module.current_device() == 0
    module.set_device(0)
    module.synchronize()
    with pytest.raises(RuntimeError, match="one device"):
        module.set_device(1)
    before = module.memory_allocated()
    x = torch.empty(1000, dtype=torch.float32, device=fake_accelerator.device)
    assert module.memory_allocated() == before + 4000
    del x
    gc.collect()
    module.empty_cache()
    assert module.memory_allocated() == before


# -- numerics equal CPU -------------------------------------------------------------------------
def test_round_trip_and_item(fake_accelerator):
    x = torch.randn(4, 3)
    d = x.to(fake_accelerator.device)
    assert d.device == fake_accelerator.device
    assert_same(d, x)
    assert d[1, 2].item() == x[1, 2].item()


def test_factories(fake_accelerator):
    dev = fake_accelerator.device
    e = torch.empty(2, 3, dtype=torch.bfloat16, device=dev)
    assert (e.device, e.shape, e.dtype) == (dev, (2, 3), torch.bfloat16)
    assert_same(torch.zeros(2, 3, device=dev), torch.zeros(2, 3))
    assert_same(torch.ones(5, dtype=torch.float16, device=dev), torch.ones(5, dtype=torch.float16))


def test_linear_built_under_device_context_matches_cpu_init(fake_accelerator):
    torch.manual_seed(0)
    reference = nn.Linear(4, 3)
    torch.manual_seed(0)
    with torch.device(fake_accelerator.device):
        built = nn.Linear(4, 3)
    assert_same(built.weight, reference.weight.detach())
    assert_same(built.bias, reference.bias.detach())


def test_linear_moved_forward_and_load_state_dict(fake_accelerator):
    dev = fake_accelerator.device
    reference = nn.Linear(4, 3)
    moved = nn.Linear(4, 3).to(dev)
    moved.load_state_dict(reference.state_dict())
    assert_same(moved.weight, reference.weight.detach())
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert_same(moved(x.to(dev)), reference(x))


def test_matmuls(fake_accelerator):
    dev = fake_accelerator.device
    a, b, c = torch.randn(5, 3), torch.randn(3, 4), torch.randn(5, 4)
    assert_same(torch.mm(a.to(dev), b.to(dev)), torch.mm(a, b))
    assert_same(a.to(dev) @ b.to(dev) * 0.25, a @ b * 0.25)
    assert_same(c.to(dev).addmm_(a.to(dev), b.to(dev), alpha=0.5), c.clone().addmm_(a, b, alpha=0.5))


def test_in_place_add_sub_copy(fake_accelerator):
    dev = fake_accelerator.device
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    d = x.to(dev)
    assert d.add_(y.to(dev)) is d
    assert_same(d, x + y)
    d.sub_(y.to(dev), alpha=2)
    assert_same(d, x + y - 2 * y)
    d.copy_(y)
    assert_same(d, y)


def test_views_match_cpu_geometry_and_values(fake_accelerator):
    x = torch.randn(4, 6)
    d = x.to(fake_accelerator.device)
    cases = {
        "t": lambda t: t.t(),
        "rows": lambda t: t[1:3],
        "cols": lambda t: t[:, 2:5],
        "view": lambda t: t.view(2, 12),
        "narrow": lambda t: t.narrow(1, 1, 3),
        "t_contiguous": lambda t: t.t().contiguous(),
    }
    for name, fn in cases.items():
        got, want = fn(d), fn(x)
        assert (got.stride(), got.storage_offset(), got.is_contiguous()) == (
            want.stride(),
            want.storage_offset(),
            want.is_contiguous(),
        ), name
        assert_same(got, want)


def test_writes_through_views_reach_the_base(fake_accelerator):
    x = torch.zeros(4, 3)
    d = x.to(fake_accelerator.device)
    rows = d[1:3]
    rows.add_(1.0)
    d.t()[0].fill_(7.0)  # column 0 through a transposed view
    x[1:3] += 1.0
    x[:, 0] = 7.0
    assert_same(d, x)
    assert rows.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()


def test_isfinite_and_all_on_a_view(fake_accelerator):
    x = torch.randn(4, 3)
    x[2, 1] = float("inf")
    d = x.to(fake_accelerator.device)
    assert_same(torch.isfinite(d[2:4]), torch.isfinite(x[2:4]))
    assert torch.isfinite(d[0:2]).all().item() is True
    assert torch.isfinite(d[1:3]).all().item() is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_dtype_casts(fake_accelerator, dtype):
    x = torch.randn(8, 8) * 3
    d = x.to(fake_accelerator.device)
    assert_same(d.to(dtype), x.to(dtype))
    assert_same(x.to(fake_accelerator.device, dtype), x.to(dtype))
    assert_same(d.to(dtype).to(torch.float32), x.to(dtype).to(torch.float32))


def test_out_variants_and_resize(fake_accelerator):
    dev = fake_accelerator.device
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    out = torch.empty(0, device=dev)
    assert torch.add(a.to(dev), b.to(dev), out=out) is out
    assert_same(out, a + b)
    grown = torch.arange(4.0).to(dev)
    assert grown.resize_(3, 2) is grown
    assert grown.shape == (3, 2) and grown.stride() == (2, 1)
    assert_same(grown.view(-1)[:4], torch.arange(4.0))  # resize_ keeps the old contents
    grown.fill_(5.0)
    assert_same(grown, torch.full((3, 2), 5.0))


def test_mixing_device_and_cpu_operands_raises(fake_accelerator):
    d = torch.randn(3, 3).to(fake_accelerator.device)
    with pytest.raises(RuntimeError, match="same device"):
        torch.mm(d, torch.randn(3, 3))
    assert_same(d * torch.tensor(2.0), d.cpu() * 2.0)  # 0-dim CPU scalars are fine, as on CUDA


# -- counters -----------------------------------------------------------------------------------
def test_copies_are_counted_in_bytes(fake_accelerator):
    x = torch.randn(16, 8)  # 512 bytes
    d = x.to(fake_accelerator.device)
    assert (fake_accelerator.h2d_copies, fake_accelerator.h2d_bytes) == (1, 512)
    assert (fake_accelerator.d2h_copies, fake_accelerator.d2h_bytes) == (0, 0)
    d.to("cpu")
    assert (fake_accelerator.d2h_copies, fake_accelerator.d2h_bytes) == (1, 512)
    d.sum().item()
    assert (fake_accelerator.d2h_copies, fake_accelerator.d2h_bytes) == (2, 516)
    x.to(fake_accelerator.device, torch.bfloat16)  # bytes landing on the device
    assert (fake_accelerator.h2d_copies, fake_accelerator.h2d_bytes) == (2, 768)
    fake_accelerator.reset_counters()
    assert (fake_accelerator.h2d_copies, fake_accelerator.h2d_bytes, fake_accelerator.d2h_bytes) == (0, 0, 0)


def test_op_counts_see_device_math_only(fake_accelerator):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    a @ b
    torch.mm(a, b)
    assert fake_accelerator.op_counts == {}
    ad, bd = a.to(fake_accelerator.device), b.to(fake_accelerator.device)
    assert fake_accelerator.op_counts["aten::mm"] == 0
    ad @ bd
    assert fake_accelerator.op_counts["aten::mm"] == 1
    torch.randn(4, 4).to(fake_accelerator.device).addmm_(ad, bd)
    assert fake_accelerator.op_counts["aten::addmm"] == 1


def test_allocations_are_counted(fake_accelerator):
    torch.empty(3, device=fake_accelerator.device)
    torch.randn(2).to(fake_accelerator.device)
    assert fake_accelerator.allocations == 2


# -- failure simulation -------------------------------------------------------------------------
def test_fail_probe_makes_allocation_raise(fake_accelerator):
    dev = fake_accelerator.device
    torch.empty(1, device=dev)
    with fake_accelerator.fail_probe():
        with pytest.raises(RuntimeError, match="FAKEACC error"):
            torch.empty(1, device=dev)
        with pytest.raises(RuntimeError, match="FAKEACC error"):
            torch.ones(2).to(dev)
    torch.empty(1, device=dev)
    fake_accelerator.fail_probe()
    with pytest.raises(RuntimeError):
        torch.empty(1, device=dev)
    fake_accelerator.clear_failures()
    torch.empty(1, device=dev)


def test_fail_h2d_after_raises_oom_past_the_budget(fake_accelerator):
    dev = fake_accelerator.device
    torch.randn(64).to(dev)  # spent before the budget: does not count against it
    fake_accelerator.fail_h2d_after(600)
    torch.randn(100).to(dev)  # 400 bytes
    torch.randn(50).to(dev)  # 600 in all: exactly the budget
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        torch.randn(1).to(dev)
    assert fake_accelerator.h2d_bytes == 256 + 600
    fake_accelerator.clear_failures()
    torch.randn(1000).to(dev)
    with fake_accelerator.fail_h2d_after(0), pytest.raises(torch.OutOfMemoryError):
        torch.zeros(4, device=dev).copy_(torch.ones(4))
    torch.randn(1).to(dev)


# -- fixture and install ------------------------------------------------------------------------
def test_reset_clears_counters_failures_and_platform_probe_cache(fake_accelerator, monkeypatch):
    probes = []

    @functools.cache
    def usable_device():
        probes.append(1)
        return "probed"

    platform = types.ModuleType("vllm_diffusion_plugin.engine.platform")
    platform.usable_device = usable_device
    monkeypatch.setitem(sys.modules, "vllm_diffusion_plugin.engine.platform", platform)
    usable_device()
    usable_device()
    torch.randn(2).to(fake_accelerator.device)
    fake_accelerator.fail_probe()
    pytest_plugin.reset_fake_accelerator(fake_accelerator)
    usable_device()
    assert len(probes) == 2
    assert (fake_accelerator.h2d_copies, fake_accelerator.allocations) == (0, 0)
    assert fake_accelerator.op_counts == {}
    torch.empty(1, device=fake_accelerator.device)


def test_install_refuses_other_backend_and_missing_api():
    script = textwrap.dedent(
        """
        import torch
        from torch.utils import backend_registration
        from vllm_diffusion_plugin.testing.fake_accelerator import install
        setup = backend_registration._setup_privateuseone_for_python_backend
        del backend_registration._setup_privateuseone_for_python_backend
        try:
            install()
        except RuntimeError as e:
            assert torch.__version__ in str(e), e
        else:
            raise AssertionError("install() without the private API did not raise")
        backend_registration._setup_privateuseone_for_python_backend = setup
        torch.utils.rename_privateuse1_backend("otheracc")
        try:
            install()
        except RuntimeError as e:
            assert "'otheracc'" in str(e), e
        else:
            raise AssertionError("install() over another backend did not raise")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# -- FSDP2 on a one-process fake mesh -----------------------------------------------------------
def test_fully_shard_structure_and_the_data_move_seed_bug(fake_accelerator):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    reference = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    with fake_mesh((1, 2)) as mesh:
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)).to(fake_accelerator.device)
        model.load_state_dict(reference.state_dict())
        fully_shard(model, mesh=mesh)
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), name
            assert param.placements == (Replicate(), Shard(0)), name
            local = param.to_local()
            rows = reference.get_parameter(name).shape[0] // 2
            assert_same(local, reference.get_parameter(name).detach()[:rows])  # rank 0's half

        # Collectives on fakeacc tensors reach the fake group (they return garbage, but run).
        torch.distributed.broadcast(torch.ones(2, device=fake_accelerator.device), group_src=0)
        assert model[0].weight.full_tensor().shape == (8, 4)

        weight = model[0].weight
        with pytest.raises(RuntimeError):
            weight.data = weight.data.to("cpu")  # the naive per-parameter move

        model.to("cpu")
        assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in model.parameters())
        model.to(fake_accelerator.device)
        for param in model.parameters():
            assert isinstance(param, DTensor) and param.device == fake_accelerator.device
            assert param.placements == (Replicate(), Shard(0))
    assert not torch.distributed.is_initialized()
