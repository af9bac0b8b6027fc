"""The benchmark's measuring parts without a server: per-process peak RSS and read bytes of a real process group
(``tools.process_stats``), page-cache eviction and residency of a real file (``tools.pagecache``), and
vllm-omni's own load-time lines as its workers write them (``tools.servers.worker_load_times``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from vllm_diffusion_plugin.tools import pagecache
from vllm_diffusion_plugin.tools import process_stats as ps
from vllm_diffusion_plugin.tools import servers as sv

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and mincore are Linux's")

CHILD = textwrap.dedent("""
    import os, sys, time
    sys.argv[0] = "sampler-child"
    block = bytearray(int(sys.argv[1]))        # touched: resident
    for i in range(0, len(block), 4096):
        block[i] = 1
    with open(sys.argv[2], "rb") as f:         # read with syscalls: rchar
        while f.read(1 << 20):
            pass
    del block
    print("ready", flush=True)
    time.sleep(30)
""")


def test_group_sampler_sees_each_process_peak_rss_and_reads(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(8 << 20))
    size = 300 << 20
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(size), str(data)], stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        sampler = ps.GroupSampler(proc.pid, interval_s=0.05)
        sampler.start()
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.3)
        seen = sampler.finish()
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert list(seen) == [proc.pid]
    child = seen[proc.pid]
    # the block was freed before "ready": the kernel's high-water mark still holds it
    assert child.peak_rss >= size, child
    assert 0 < child.max_sampled_rss <= child.peak_rss, child
    # the freed block is gone from the private part now; the interpreter's own code is file-backed
    assert 0 < child.rss_anon < size and child.rss_anon <= child.max_sampled_anon and child.rss_file > 0, child
    assert child.rchar >= 8 << 20, child
    assert child.role == "other" and "-c" in child.title


def test_roles_by_process_title():
    assert ps.role_of("vLLM-Omni::DiffusionWorker_FS1") == "worker"
    assert ps.role_of("VLLM::APIServer") == "api"
    assert ps.role_of("/usr/bin/python -m something") == "other"


def test_group_pids_only_lists_the_group(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert ps.group_pids(proc.pid) == [proc.pid]
        assert os.getpid() not in ps.group_pids(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_evict_drops_a_files_pages_and_mincore_shows_it(tmp_path):
    path = tmp_path / "shard.safetensors"
    path.write_bytes(os.urandom(16 << 20))
    path.read_bytes()
    resident, total = pagecache.resident_bytes([tmp_path])
    assert total == 16 << 20 and resident == total
    assert pagecache.evict([tmp_path]) == 1
    resident, _ = pagecache.resident_bytes([tmp_path])
    if resident == total:
        pytest.skip(f"this filesystem ({tmp_path}) ignores POSIX_FADV_DONTNEED")
    assert resident <= total // 8
    with open(path, "rb") as f:
        f.read(4 << 20)
    resident, _ = pagecache.resident_bytes([path])
    assert 4 << 20 <= resident < total


def test_worker_load_times_parse_vllm_omnis_lines():
    log = "\n".join([
        "\x1b[0;36m(DiffusionWorker_FS0 pid=101)\x1b[0;0m INFO 12-03 13:54:07 [diffusion_loader.py:1099] "
        "Loading weights took 7.25 seconds",
        "\x1b[0;36m(DiffusionWorker_FS1 pid=102)\x1b[0;0m INFO 12-03 13:54:08 [diffusion_model_runner.py:352] "
        "Model loading took 1.5122 GiB and 12.500000 seconds",
        "\x1b[0;36m(DiffusionWorker_FS0 pid=101)\x1b[0;0m INFO 12-03 13:54:08 [diffusion_model_runner.py:352] "
        "Model loading took 3.0245 GiB and 10.685583 seconds",
        "(APIServer pid=100) INFO unrelated: Model loading took nothing",
    ])
    assert sv.worker_load_times(log) == {
        "DiffusionWorker_FS0": {"pid": 101, "weights_s": 7.25, "model_s": 10.685583, "model_gib": 3.0245},
        "DiffusionWorker_FS1": {"pid": 102, "model_s": 12.5, "model_gib": 1.5122}}


def test_marks_keep_a_processes_figures_when_its_log_line_appears(tmp_path):
    log = tmp_path / "server.log"
    child = textwrap.dedent(f"""
        import os, sys, time
        log = open({str(log)!r}, "a")
        block = bytearray(100 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        log.write(f"(DiffusionWorker pid={{os.getpid()}}) INFO Model loading took 0.1 GiB and 1.0 seconds\\n")
        log.flush()
        time.sleep(1.0)
        more = bytearray(200 << 20)
        for i in range(0, len(more), 4096):
            more[i] = 1
        print("ready", flush=True)
        time.sleep(30)
    """)
    log.write_text("")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, start_new_session=True)
    try:
        sampler = ps.GroupSampler(proc.pid, interval_s=0.05, log=log, marks=sv.LOAD_MARKS)
        sampler.start()
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.3)
        stats = sampler.finish()[proc.pid]
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    loaded = stats.at_marks["loaded"]["peak_rss"]
    assert 100 << 20 <= loaded < (250 << 20) <= stats.peak_rss, stats


def test_status_memory_reads_this_process_and_nothing_of_a_gone_one():
    from vllm_diffusion_plugin.engine.memory import status_memory

    block = bytearray(64 << 20)  # zero-filled by the allocator: resident once written
    for i in range(0, len(block), 4096):
        block[i] = 1
    mine = status_memory()
    assert mine["VmHWM"] >= mine["VmRSS"] >= len(block), mine
    assert status_memory(os.getpid()).keys() == mine.keys()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert status_memory(int(gone.stdout)) == {}
