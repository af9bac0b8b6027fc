"""``vllm-diffusion demo --serve`` as a user runs it: a real vllm-omni server on the tiny Wan2.2 pipeline, one video
written into the working folder, the ready time, the load report and the path printed, the server stopped -- and
on SIGINT while the server starts, no process of it left.

Skipped unless ``VLLM_DIFFUSION_SERVE_PROOF=1`` (the ``[omni]`` environment; servers one at a time)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_proof import ENABLED
CLI = [sys.executable, "-m", "vllm_diffusion_plugin.doors.cli", "demo", "--serve"]
pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(not ENABLED, reason="set VLLM_DIFFUSION_SERVE_PROOF=1 to start real vllm-omni servers"),
    pytest.mark.timeout(1200),
]


def _env() -> dict[str, str]:
    package_root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pgid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[2])
    except (OSError, ValueError, IndexError):
        return None


def _servers_of(folder: Path) -> list[int]:
    """PIDs of ``vllm serve`` processes serving a pipeline under ``folder`` -- ``serve`` an argument of its own: the
    demo's command (``demo --serve --keep FOLDER``) matched too, and the interrupt test then signalled the demo while
    it was still importing, before any server existed (seen on a busy host)."""
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
            and "serve" in _cmdline(int(p.name)).split() and str(folder) in _cmdline(int(p.name))]


def _alive_in_group(pgid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid(int(p.name)) == pgid]


def test_demo_serve_writes_the_video_and_prints_the_load_report(tmp_path):
    keep = tmp_path / "keep"
    proc = subprocess.run([*CLI, "--keep", str(keep)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    video = tmp_path / "vllm-diffusion-demo.mp4"
    assert video.is_file() and f"video: {video}" in out, out
    import av

    with av.open(str(video)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)
    assert "ready after " in out and "load report" in out, out
    table = [line.split() for line in out.splitlines() if line.startswith("  transformer")]
    assert [row[0] for row in table] == ["transformer", "transformer_2"], out
    assert all(int(row[3]) > 0 for row in table), out  # bytes_read
    assert not _servers_of(keep), "a server of the demo is still running"


def test_sigint_while_the_server_starts_leaves_nothing_running(tmp_path):
    keep = tmp_path / "keep"
    proc = subprocess.Popen([*CLI, "--keep", str(keep)], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline, servers = time.monotonic() + 300, []
        while not servers:  # the server is up (its process exists) but not ready: the demo is waiting on it
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.5)
            servers = _servers_of(keep)
        time.sleep(8)  # well into its startup: workers spawned, nothing healthy yet
        groups = {_pgid(pid) for pid in servers} - {None}
        seen = {pid for g in groups for pid in _alive_in_group(g)}
        assert seen, "no process of the server found"
        os.kill(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    assert "interrupted (SIGINT)" in stderr and "server was stopped" in stderr, stderr[-3000:]
    left = [pid for pid in seen if Path(f"/proc/{pid}").exists() and _pgid(pid) in groups]
    assert not left and not any(_alive_in_group(g) for g in groups), f"left running: {left}"
    assert not _servers_of(keep)
    assert not (tmp_path / "vllm-diffusion-demo.mp4").exists()
