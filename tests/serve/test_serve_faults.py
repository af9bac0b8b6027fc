"""Faults in real servers (issue 36): a diffusion worker SIGKILLed while the workers start (its load, the peers'
collectives), at 2 ranks of ``vllm serve DIR --omni --load-format diffusion-hsdp --use-hsdp``.

What the user must get: the server exits (non-zero) within 90 s, its error names the worker that died and how --
not a peer that failed after it in a collective ("Connection closed by peer") -- and it leaves no process of its
group behind and its port free. Before ``patch_worker_death``, with ``broadcast`` the log said "Rank 0 scheduler is
dead ... Exit code: 1" (rank 1 was the one killed) and the server's last line "Orchestrator initialization failed:"
with nothing after it.

Skipped unless ``VLLM_DIFFUSION_SERVE_PROOF=1`` (``.ci/omni-serve.sh``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time

import pytest
import serve_proof as sp

from vllm_diffusion_plugin.tools import servers
from vllm_diffusion_plugin.tools.process_stats import group_pids

pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(not sp.ENABLED, reason="set VLLM_DIFFUSION_SERVE_PROOF=1 to start real vllm-omni servers"),
    pytest.mark.timeout(900),
]

LOAD_BEGINS = "diffusion-hsdp (vllm-omni): HSDP"
"""Each worker's first line of our load, before its first weight byte."""
EXIT_WITHIN_S = 90.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> sp.Checkpoints:
    return sp.build_checkpoints(tmp_path_factory.mktemp("serve-faults"), merged=False)


def _worker_pid(run: sp.ServerRun, rank: int, mark: str, proc, timeout_s: float) -> int:
    """Worker ``rank``'s pid once it logged ``mark``: from its log prefix (vllm-omni 0.30: ``(DiffusionWorker_FS1
    pid=N)``), or, where the workers' lines carry none (0.32), once every worker logged it, from its process title
    (``vLLM-Omni::DiffusionWorker_FS1``)."""
    worker = re.compile(rf"\(DiffusionWorker_FS{rank} pid=(\d+)\)")
    title = f"vLLM-Omni::DiffusionWorker_FS{rank}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        marked = [line for line in run.log_text().splitlines() if mark in line]
        for line in marked:
            if found := worker.search(line):
                return int(found[1])
        if len(marked) >= 2 and not any("DiffusionWorker" in line for line in marked):
            titled = [pid for pid in group_pids(proc.pid) if _cmdline(pid).startswith(f"{title}".encode())]
            if titled:
                return titled[0]
        time.sleep(0.05)
    raise AssertionError(f"worker rank {rank} never logged {mark!r} (server exit {proc.poll()}); log {run.log}")


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _group_left(pgid: int, *, within_s: float) -> dict[int, str]:
    """The processes of the server's group still there ``within_s`` after its exit (pid -> command line): the
    server's helpers (vllm-omni's workers, multiprocessing's resource tracker) leave a few seconds after it."""
    deadline = time.monotonic() + within_s
    while (pids := group_pids(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {pid: _cmdline(pid).replace(b"\0", b" ").decode()[:200] for pid in pids}


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("strategy", ["broadcast", "rank_local"])
def test_a_worker_killed_while_the_workers_start_ends_the_server_naming_it(checkpoints, tmp_path, strategy):
    """Rank 1 SIGKILLed as its load begins: under ``broadcast`` rank 0 then fails in its broadcast (the echo that
    used to be named), under ``rank_local`` rank 0 waits in its first collective."""
    config = {"diffusion_hsdp": {"hsdp_weight_load": strategy, "lora_path": [
        f"transformer={checkpoints.lora_high}", f"transformer_2={checkpoints.lora_low}"]}}
    spec = sp.ServerSpec(f"fault-kill-{strategy}", checkpoints.original, plugin=True, args=(
        "--load-format", "diffusion-hsdp", "--use-hsdp", "--hsdp-shard-size", "2",
        "--additional-config", json.dumps(config)))
    proc, run, port = servers.launch(spec, tmp_path / "logs", cpu=sp.CPU)
    try:
        victim = _worker_pid(run, 1, LOAD_BEGINS, proc, sp.READY_TIMEOUT_S)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        try:
            proc.wait(timeout=EXIT_WITHIN_S)
        except Exception:
            pytest.fail(f"the server still runs {EXIT_WITHIN_S:.0f} s after its worker was killed; log {run.log}")
        exited_s = time.monotonic() - killed
        left = _group_left(proc.pid, within_s=10.0)
        gone_s = time.monotonic() - killed
    finally:
        with servers.signals_held():
            servers.stop(proc)
    text = run.log_text()
    print(f"\n[fault] {strategy}: rank 1 (pid {victim}) SIGKILLed; server exit {proc.returncode} after "
          f"{exited_s:.1f} s, its group gone after {gone_s:.1f} s; left {left}; port {'free' if _port_free(port) else 'busy'}", flush=True)
    assert proc.returncode != 0, run.log
    cause = "diffusion worker rank 1 died of SIGKILL (out of memory"
    last = [line for line in text.splitlines() if "Orchestrator initialization failed:" in line]
    assert last and cause in last[-1], (last[-1:], run.log)
    assert "rank 0 died" not in text, run.log
    assert not left, f"processes of the server's group left: {left}"
    assert _port_free(port), f"port {port} still bound after the server exited"
