"""``engine.pressure``: a host that thrashes during a load or a server's first run is said while it happens (issue 39).

The kernel's own figures where it has them (this kernel's ``/proc/pressure/memory``); the watch's rules against a
``/proc`` tree the test writes (a host cannot be made to thrash on cue without risking the machine).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from vllm_diffusion_plugin.engine import pressure
from vllm_diffusion_plugin.testing.logs import captured_logs

PSI = "some avg10={some:.2f} avg60=0.00 avg300=0.00 total=1\nfull avg10={full:.2f} avg60=0.00 avg300=0.00 total=1\n"


def _proc(root: Path, full: float, available_kib: int = 3 << 20) -> None:
    """The /proc files the watch reads, each replaced at once as the kernel's are read (never half written)."""
    (root / "proc/pressure").mkdir(parents=True, exist_ok=True)
    for name, text in (("pressure/memory", PSI.format(some=full * 1.5, full=full)),
                       ("meminfo", f"MemTotal: {8 << 20} kB\nMemAvailable: {available_kib} kB\n")):
        (root / "proc" / f"{name}.new").write_text(text)
        (root / "proc" / f"{name}.new").replace(root / "proc" / name)


def test_the_kernels_figure_reads_where_it_has_psi():
    if not Path("/proc/pressure/memory").exists():
        pytest.skip("this kernel has no pressure stall information")
    assert 0.0 <= pressure.full_avg10() <= 100.0


def test_no_psi_no_figure(tmp_path):
    assert pressure.full_avg10(tmp_path) is None


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_thrashing_host_is_named_once_per_episode(tmp_path):
    _proc(tmp_path, full=0.0)
    watch = pressure.PressureWatch("rank 1's load of /ckpt", interval_s=0.02, root=tmp_path)
    with captured_logs(pressure.__name__) as logs:
        watch.start()
        try:
            time.sleep(0.1)
            assert watch.warnings == 0  # at ease: nothing said
            _proc(tmp_path, full=63.0)
            _wait_for(lambda: watch.warnings)
            time.sleep(0.1)
            assert watch.warnings == 1  # once while it lasts, not every sample
            _proc(tmp_path, full=pressure.THRESHOLD * 0.75)
            time.sleep(0.1)
            assert watch.warnings == 1 and watch.in_episode  # still above half the threshold: the same episode
            _proc(tmp_path, full=1.0)
            _wait_for(lambda: not watch.in_episode)  # below half: the episode is over
            _proc(tmp_path, full=45.0)
            _wait_for(lambda: watch.warnings == 2)
        finally:
            watch.stop()
    assert watch.warnings == 2 and not watch.is_alive()
    (line, *_) = logs.messages()
    assert "memory pressure during rank 1's load of /ckpt" in line and "63%" in line, line
    assert "3.00 GiB left [MemAvailable]" in line and "vllm-diffusion plan" in line, line


def test_without_psi_the_watch_ends_quietly(tmp_path):
    watch = pressure.PressureWatch("a load", interval_s=0.01, root=tmp_path)
    with captured_logs(pressure.__name__) as logs:
        watch.start()
        watch.join(2)
    assert not watch.is_alive() and not logs.messages()
