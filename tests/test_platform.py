"""Platform hooks: the lookup, the probe, the dist backend, per-device primitives."""

import pytest
import torch

from vllm_diffusion_plugin.engine import platform


@pytest.fixture(autouse=True)
def fresh_probe_cache():
    platform.usable_device.cache_clear()
    yield
    platform.usable_device.cache_clear()


def test_cpu_only_host_resolves_cpu(monkeypatch):
    monkeypatch.setattr(platform, "accelerator_type", lambda: None)
    assert platform.local_device() == torch.device("cpu")


def test_lookup_alone_proves_nothing_cuda_is_not_usable_here():
    # On a CPU-only host a vLLM/vllm-omni style lookup still names cuda:N; only the probe can tell.
    assert not torch.cuda.is_available()
    assert platform.usable_device(torch.device("cuda", 0)) is None
    assert platform.usable_device("cpu") == torch.device("cpu")


def test_fake_accelerator_is_the_local_device_and_honours_local_rank(fake_accelerator, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert platform.local_device() == torch.device(fake_accelerator.device.type, 3)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert platform.local_device() == fake_accelerator.device


def test_bad_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(ValueError, match="LOCAL_RANK='first'"):
        platform.local_rank()


def test_probe_returns_usable_fake_accelerator(fake_accelerator):
    assert platform.usable_device(fake_accelerator.device) == fake_accelerator.device
    assert fake_accelerator.allocations >= 1  # the probe really allocated on the device


def test_probe_failure_returns_none(fake_accelerator):
    with fake_accelerator.fail_probe():
        assert platform.usable_device(fake_accelerator.device) is None


def test_probe_result_is_cached_per_process(fake_accelerator):
    assert platform.usable_device(fake_accelerator.device) == fake_accelerator.device
    allocations = fake_accelerator.allocations
    with fake_accelerator.fail_probe():  # a second probe would fail now; the cached answer is kept
        assert platform.usable_device(fake_accelerator.device) == fake_accelerator.device
    assert fake_accelerator.allocations == allocations


@pytest.mark.parametrize("device, backend", [
    ("cuda:0", "nccl"), ("npu:1", "hccl"), ("xpu", "xccl"), ("cpu", "gloo"),
])
def test_dist_backend(device, backend):
    assert platform.dist_backend(device) == backend


def test_dist_backend_for_privateuse1_without_collectives_is_gloo(fake_accelerator):
    assert platform.dist_backend(fake_accelerator.device) in ("gloo", "fake")


def test_synchronize_and_empty_cache_work_on_every_backend(fake_accelerator):
    for device in ("cpu", fake_accelerator.device):
        platform.synchronize(device)
        platform.empty_cache(device)


def test_fake_accelerator_is_not_the_local_device_outside_its_fixture():
    # Runs after fixture tests in this file: a leaked "available" fake backend would turn every later
    # test's CPU path into an accelerator path.
    from vllm_diffusion_plugin.testing.fake_accelerator import install

    install()
    assert platform.accelerator_type() is None
