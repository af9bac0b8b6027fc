"""The CPU platform for vllm-omni (``vllm_diffusion_plugin.doors.omni.cpu``) against the real vllm-omni: the env gate
through vllm-omni's own platform resolution, device count, memory figures, attention backend selection and
numerics, and the output-thread unit. (Real servers at 1 and 2 ranks: tests/serve.)
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import queue
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import pytest
import torch
from omni_support import import_omni

from vllm_diffusion_plugin.doors.omni import _patching
from vllm_diffusion_plugin.doors.omni.cpu import PLATFORM, platform_plugin

import_omni()  # skips this module where vllm-omni is not installed

from vllm_diffusion_plugin.doors.omni.cpu import patch_output_stream  # noqa: E402  (imports nothing of vllm-omni)
from vllm_diffusion_plugin.doors.omni.cpu.platform import (  # noqa: E402
    ATTENTION_BACKEND,
    CpuOmniPlatform,
    peak_rss_bytes,
    require_patches_applied,
    reset_peak_rss,
)

HERE = Path(__file__).parent


def run_python(script: str, **env: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter (vllm-omni resolves its platform once per process)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION_")}
    child_env |= {"VLLM_TARGET_DEVICE": "cpu", **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=300, cwd=HERE, env=child_env, check=False)


# --- the env gate --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, expected", [(None, None), ("0", None), ("off", None), ("1", PLATFORM),
                                           ("yes", PLATFORM)])
def test_entry_point_applies_only_with_the_switch(raw, expected, monkeypatch):
    monkeypatch.setenv("VLLM_DIFFUSION_PLUGIN", "0")  # independent of the plugin switch
    if raw is None:
        monkeypatch.delenv("VLLM_DIFFUSION_OMNI_CPU", raising=False)
    else:
        monkeypatch.setenv("VLLM_DIFFUSION_OMNI_CPU", raw)
    assert platform_plugin() == expected


def test_entry_point_refuses_a_bad_switch_value(monkeypatch):
    monkeypatch.setenv("VLLM_DIFFUSION_OMNI_CPU", "cpu")
    with pytest.raises(ValueError, match="VLLM_DIFFUSION_OMNI_CPU"):
        platform_plugin()


def test_entry_point_is_installed_in_vllm_omnis_group():
    points = importlib.metadata.entry_points(group="vllm_omni.platform_plugins")
    ours = [p for p in points if p.value == "vllm_diffusion_plugin.doors.omni.cpu:platform_plugin"]
    assert ours, f"no vllm_omni.platform_plugins entry point of this package among {list(points)}"


RESOLVE = """
    import vllm_omni.platforms as platforms
    print("RESOLVED", type(platforms.current_omni_platform).__module__ + "." +
          type(platforms.current_omni_platform).__qualname__)
"""


def test_vllm_omni_resolves_the_cpu_platform_only_when_switched_on():
    on = run_python(RESOLVE, VLLM_DIFFUSION_OMNI_CPU="1", VLLM_DIFFUSION_PLUGIN="0")
    assert f"RESOLVED {PLATFORM}" in on.stdout, on.stdout[-2000:] + on.stderr[-4000:]
    off = run_python(RESOLVE)
    assert "RESOLVED vllm_omni.platforms" in off.stdout, off.stdout[-2000:] + off.stderr[-4000:]


# --- devices and memory --------------------------------------------------------------------------------------
def test_device_count_and_device(monkeypatch):
    monkeypatch.delenv("VLLM_DIFFUSION_OMNI_CPU_DEVICES", raising=False)
    assert CpuOmniPlatform.get_device_count() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_DIFFUSION_OMNI_CPU_DEVICES", "4")
    assert CpuOmniPlatform.get_device_count() == 4
    assert CpuOmniPlatform.get_torch_device(3) == torch.device("cpu")
    assert CpuOmniPlatform.dist_backend == "gloo" and CpuOmniPlatform.device_type == "cpu"
    CpuOmniPlatform.set_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="cuda"):
        CpuOmniPlatform.set_device(torch.device("cuda", 0))


def test_every_device_call_of_the_diffusion_path_is_callable():
    """vLLM's Platform.__getattr__ answers None for names torch.cpu lacks: each must be a real method here."""
    platform = CpuOmniPlatform.__new__(CpuOmniPlatform)  # no __init__: no patch installed by this test
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats", "set_device"):
        assert getattr(platform, name)(*(() if name != "set_device" else (torch.device("cpu"),))) is None
    for name in ("max_memory_allocated", "max_memory_reserved", "get_free_memory", "get_device_total_memory"):
        assert getattr(platform, name)() > 0, name


def test_memory_figures_are_the_hosts():
    import psutil

    free, total = CpuOmniPlatform.get_device_memory()
    assert total == psutil.virtual_memory().total
    assert 0 < free <= total
    assert abs(CpuOmniPlatform.get_free_memory() - psutil.virtual_memory().available) < total // 10


def test_peak_memory_follows_an_allocation_and_resets():
    if not reset_peak_rss():
        pytest.skip("this kernel does not allow resetting the peak RSS")
    size = 256 * 2**20
    before = peak_rss_bytes()
    block = torch.ones(size // 4)  # written: resident
    del block
    assert CpuOmniPlatform.max_memory_reserved() >= before + size * 9 // 10
    CpuOmniPlatform.reset_peak_memory_stats()
    assert CpuOmniPlatform.max_memory_allocated() < before + size // 2


def test_each_worker_says_its_own_rss_right_before_its_model_load():
    """vLLM's CPU "Model loading took X GiB" is the host's used memory (every worker and the page cache); the
    capacity benchmark needs each worker's own RSS where vllm-omni's runner starts ``load_model``."""
    import re

    from vllm_diffusion_plugin.engine.memory import status_memory
    from vllm_diffusion_plugin.testing.logs import captured_logs

    with captured_logs("vllm_diffusion_plugin.doors.omni.cpu.platform") as records:
        CpuOmniPlatform.init_diffusion_model_runner_runtime(vllm_config=None, od_config=None,
                                                            device=torch.device("cpu"))
    (line,) = [m for m in records.messages(level=20) if "before its model load" in m]
    said = int(re.search(r"RSS before its model load: (\d+) bytes", line)[1])
    assert abs(said - status_memory()["VmRSS"]) < 64 * 2**20, line


# --- attention -----------------------------------------------------------------------------------------------
def test_backend_selection():
    assert CpuOmniPlatform.get_diffusion_attn_backend_cls(None, 64) == ATTENTION_BACKEND
    assert CpuOmniPlatform.get_diffusion_attn_backend_cls("torch_sdpa", 64) == ATTENTION_BACKEND
    with pytest.raises(ValueError, match="FLASH_ATTN"):
        CpuOmniPlatform.get_diffusion_attn_backend_cls("FLASH_ATTN", 64)


ATTENTION = """
    import torch
    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl
    from vllm_omni.diffusion.attention.selector import get_attn_backend_for_role
    from vllm_omni.platforms import current_omni_platform

    backend, _ = get_attn_backend_for_role("self", head_size=8)
    print("BACKEND", backend.__module__ + "." + backend.__qualname__, backend.get_name())
    q, k, v = (torch.randn(2, 5, 3, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata
    ours = backend.get_impl_cls()(num_heads=3, head_size=8, softmax_scale=0.3).forward(
        q, k, v, AttentionMetadata(attn_mask=mask))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.permute(0, 2, 1, 3) for x in (q, k, v)), attn_mask=mask[:, None, None, :], scale=0.3).permute(0, 2, 1, 3)
    torch.testing.assert_close(ours, ref)
    try:
        SDPAImpl(num_heads=3, head_size=8, softmax_scale=0.3).forward(q, k, v)
    except NotImplementedError as exc:
        print("STOCK-REFUSES", exc)
    print("ATTENTION-OK")
"""


def test_vllm_omnis_selector_picks_sdpa_that_runs_on_cpu():
    result = run_python(ATTENTION, VLLM_DIFFUSION_OMNI_CPU="1")
    out = result.stdout
    assert f"BACKEND {ATTENTION_BACKEND} SDPA" in out and "ATTENTION-OK" in out, out[-2000:] + result.stderr[-4000:]
    assert "STOCK-REFUSES" in out  # why the subclass exists: vllm-omni's own SDPA impl has no CPU forward


# --- the output-thread unit ----------------------------------------------------------------------------------
def fresh_worker_module(monkeypatch) -> types.ModuleType:
    """A second, unpatched instance of vllm-omni's diffusion_worker module, installed under its name."""
    spec = importlib.util.find_spec(patch_output_stream.TARGET)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, patch_output_stream.TARGET, module)
    return module


def worker_stub(items: list) -> types.SimpleNamespace:
    """The attributes of a ``WorkerProc`` that its output thread uses; results are recorded in ``sent``."""
    stub = types.SimpleNamespace(gpu_id=1, _async_output_queue=queue.Queue(), _async_output_done=threading.Condition(),
                                 _async_output_pending=len(items) - 1, sent=[])
    stub._enqueue_result = stub.sent.append
    for item in items:
        stub._async_output_queue.put(item)
    return stub


def run_loop(loop, stub) -> BaseException | None:
    errors = []

    def target():
        try:
            loop(stub)
        except BaseException as exc:  # the thread's death is the bug
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the output loop did not stop at the None sentinel"
    return errors[0] if errors else None


def test_output_thread_packs_without_a_stream(monkeypatch):
    from vllm_omni.diffusion.data import AsyncOutputKind, DiffusionOutput
    from vllm_omni.diffusion.ipc import unpack_diffusion_output_shm

    module = fresh_worker_module(monkeypatch)
    original = module.WorkerProc._async_output_loop
    assert patch_output_stream.apply(module) == "applied"
    patched = module.WorkerProc._async_output_loop
    assert _patching.is_patched(patched) and patched.__wrapped__ is original
    assert patch_output_stream.apply(module) == "already applied" and module.WorkerProc._async_output_loop is patched

    video = torch.randn(1, 3, 9, 128, 128)  # > 1 MB: travels through shared memory
    unpackable = DiffusionOutput(output=torch.zeros(2**21, dtype=torch.float8_e4m3fn))  # numpy has no fp8
    stub = worker_stub([(DiffusionOutput(output=video.clone()), "a", None), (unpackable, "b", None), None])
    assert run_loop(patched, stub) is None
    assert [m.async_output_id for m in stub.sent] == ["a", "b"]
    assert all(m.kind is AsyncOutputKind.OUTPUT_READY for m in stub.sent)
    assert stub.sent[0].error is None and stub.sent[1].error == patch_output_stream.ERROR_TEXT
    assert isinstance(stub.sent[0].output.output, dict)  # an SHM handle, not the tensor
    torch.testing.assert_close(unpack_diffusion_output_shm(stub.sent[0].output).output, video)
    assert stub._async_output_pending == 0

    if not torch.accelerator.is_available():  # the bug on this host: vllm-omni's own loop dies at once
        stub = worker_stub([(DiffusionOutput(output=video.clone()), "a", None), None])
        assert isinstance(run_loop(original, stub), RuntimeError) and stub.sent == []


def test_output_thread_unit_refuses_an_unknown_loop_and_the_platform_then_refuses_workers(monkeypatch):
    module = types.ModuleType(patch_output_stream.TARGET)

    class WorkerProc:
        def _async_output_loop(self):  # a future vllm-omni without the stream
            pass

        _enqueue_result = drain_async_outputs = _async_output_loop

    module.WorkerProc = WorkerProc
    module.AsyncOutputKind = types.SimpleNamespace(OUTPUT_READY="output_ready")
    module.AsyncDiffusionOutput = module.pack_diffusion_output_shm = object
    monkeypatch.setattr(_patching, "_status", {})
    monkeypatch.setitem(sys.modules, patch_output_stream.TARGET, module)
    assert _patching.run_unit(patch_output_stream, module).startswith("skipped: ")
    assert not _patching.is_patched(WorkerProc._async_output_loop)
    with pytest.raises(RuntimeError, match="cpu-output-stream"):
        require_patches_applied()
