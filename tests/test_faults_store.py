"""Faults during a load (issue 36, part 2), the CLI door, on a real FUSE store (``fuse_store``) that stalls or fails
the reads of one shard from its last page on, and with ranks SIGKILLed from outside:

- a rank SIGKILLed mid-read (rank 0 of ``broadcast`` held in a stalled read) or mid-collective (rank 1 waiting for
  that bucket): every other rank gone within a generous bound, the launcher's line names the rank and the signal,
  nothing is left behind (no process, no /dev/shm segment, no work folder, no output);
- a read that stalls: the load fails naming the file and the offset within ``read_timeout_s``;
- an I/O error: one line naming the file and the offset, every rank exits, nothing written.

The test watches for the fault's marker (the FUSE server writes it when a read reaches the fault), not for time."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fault_cli import ROOT
from fault_cli import finish as _finish
from fault_cli import left_behind as _left_behind
from fault_cli import start as _start
from fuse_store import faulty_store, wait_for
from proc_utils import descendants, is_rank

pytestmark = [pytest.mark.multiproc,
              pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")]


def _shard(checkpoint: Path) -> Path:
    """The transformer's third shard: its first two are read (and, under ``broadcast``, sent) before it."""
    return sorted((checkpoint / "transformer").glob("*.safetensors"))[2]


@pytest.mark.parametrize("victim", ["reader", "waiter"])
def test_a_rank_sigkilled_mid_read_or_mid_broadcast_is_named_and_nothing_is_left(tiny_wan_dir, tmp_path, victim):
    """``broadcast`` on 2 ranks: rank 0 alone reads; the test kills it in a read its store answers slowly (each
    request past the shard's last page takes 5 s), or kills rank 1 while it waits for rank 0's bucket (rank 0 held
    in a read that never answers). Before: ``rank N exited with code -9`` (no signal named) or the survivor's
    "Connection reset by peer" echo alone (``launcher._first_error`` took the earliest error file); and with the
    reader stuck in its store, the launcher waited for it forever (``stop()`` joined a SIGKILLed process). Seen on
    main: the reader case printed rank 1's broadcast echo alone; the waiter case never exited."""
    mode = "slow" if victim == "reader" else "stall"
    with faulty_store(tiny_wan_dir, tmp_path, _shard(tiny_wan_dir), mode=mode) as (checkpoint, fault):
        proc, tmp, out = _start(checkpoint, tmp_path, "--nproc", "2", "--hsdp-weight-load", "broadcast", "--verbose")
        try:
            reader = wait_for(fault.marker)["pid"]  # rank 0, the only reader, in a read of that page
            processes = descendants(proc.pid)  # its ranks, the fork server they came from: none may be left
            ranks = [p for p in processes if is_rank(p)]
            assert reader in ranks and len(ranks) == 2, (reader, ranks)
            os.kill(reader if victim == "reader" else next(p for p in ranks if p != reader), signal.SIGKILL)
            err = _finish(proc, tmp_path)
        finally:
            if proc.poll() is None:
                proc.kill()
    # the store is gone: a rank stuck in it (the waiter case's reader) is released
    errors = [line for line in err.splitlines() if line.startswith("vllm-diffusion: ")]
    assert proc.returncode == 1 and len(errors) == 1, (proc.returncode, err[-3000:])
    rank = 0 if victim == "reader" else 1
    assert errors[0].startswith(f"vllm-diffusion: error: rank {rank} died of SIGKILL (out of memory or killed from "
                                f"outside)"), errors[0]
    assert "collective timeout 300 s" in err  # each rank's first INFO line says the bound
    assert _left_behind(processes, tmp, out) == []


@pytest.mark.parametrize("strategy", ["broadcast", "rank_local"])
def test_a_stalled_read_fails_the_load_naming_the_file_and_offset(tiny_wan_dir, tmp_path, strategy):
    """The store stops answering reads of one shard's last page: the load fails within ``--read-timeout`` naming
    the file and the offset; the launcher returns though the stalled rank cannot exit until the store answers.
    Before: the load hung (``broadcast``: rank 1 until its 300 s broadcast timeout, then the launcher forever on
    the stuck rank 0; ``rank_local``: every rank forever)."""
    shard = _shard(tiny_wan_dir)
    with faulty_store(tiny_wan_dir, tmp_path, shard, mode="stall") as (checkpoint, fault):
        proc, tmp, out = _start(checkpoint, tmp_path, "--nproc", "2", "--hsdp-weight-load", strategy,
                                "--read-timeout", "5")
        try:
            stalled = wait_for(fault.marker)
            processes = descendants(proc.pid)  # its ranks, the fork server they came from: none may be left
            err = _finish(proc, tmp_path)
        finally:
            if proc.poll() is None:
                proc.kill()
    errors = [line for line in err.splitlines() if line.startswith("vllm-diffusion: ")]
    assert proc.returncode == 1 and len(errors) == 1, (proc.returncode, err[-3000:])
    mounted = checkpoint / "transformer" / shard.name
    assert f"{mounted} " in errors[0] and "no answer within 5 s (read_timeout_s)" in errors[0], errors[0]
    at_byte = re.search(r" at byte (\d+)", errors[0])
    if at_byte is None:  # the peer timed out first, opening that file or reading its header from the stalled store
        assert f"{mounted} (opening it)" in errors[0] or f"{mounted} (reading its header)" in errors[0], errors[0]
    else:
        assert int(at_byte.group(1)) <= stalled["offset"] + stalled["size"], (at_byte.group(1), stalled)
    assert _left_behind(processes, tmp, out) == []


@pytest.mark.parametrize(("strategy", "threads"), [("full", "4"), ("rank_local", "4"), ("full", "1")])
def test_an_io_error_is_named_with_the_file_and_offset(tiny_wan_dir, tmp_path, strategy, threads):
    """The store fails reads of one shard's last page with EIO. ``full`` views mapped files: before, the failed
    page-in killed each rank with SIGBUS (``rank 0 exited with code -7``, no file named); ``rank_local`` ``pread``s:
    before, ``[Errno 5] Input/output error``, naming nothing (both seen on main). With one read thread the loading
    thread read the tensors itself (safetensors' own mapping): before, ``rank 0 died of SIGBUS``, no file named."""
    shard = _shard(tiny_wan_dir)
    with faulty_store(tiny_wan_dir, tmp_path, shard, mode="eio") as (checkpoint, fault):
        proc, tmp, out = _start(checkpoint, tmp_path, "--nproc", "2", "--hsdp-weight-load", strategy,
                                "--read-threads", threads)
        err = _finish(proc, tmp_path)
        failed = wait_for(fault.marker, timeout_s=0)
    errors = [line for line in err.splitlines() if line.startswith("vllm-diffusion: ")]
    assert proc.returncode == 1 and len(errors) == 1, (proc.returncode, err[-3000:])
    mounted = checkpoint / "transformer" / shard.name
    assert errors[0].startswith(f"vllm-diffusion: error: {mounted}") and "at byte" in errors[0], errors[0]
    offset = int(re.search(r" at byte (\d+)", errors[0]).group(1))
    assert failed["offset"] <= offset < failed["offset"] + failed["size"], (offset, failed)  # the page that failed
    assert _left_behind([], tmp, out) == []


NO_POPULATE = """
import ctypes, errno, sys
from vllm_diffusion_plugin.engine.io import pagein
from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint
from vllm_diffusion_plugin.engine.io.stream import iterate_weights


def no_populate(address, length):  # a kernel before 5.14: madvise(MADV_POPULATE_READ) is EINVAL
    ctypes.set_errno(errno.EINVAL)
    return -1


pagein._madvise_populate = no_populate
source = next(s for s in resolve_checkpoint(sys.argv[1]) if s.name == "transformer")
try:
    for _ in iterate_weights(source, threads=int(sys.argv[2])):
        pass
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(3)
"""


@pytest.mark.parametrize("threads", [1, 4])
def test_without_madv_populate_read_an_io_error_is_named_not_a_sigbus(tiny_wan_dir, tmp_path, threads):
    """A kernel without ``MADV_POPULATE_READ`` (madvise answers EINVAL, forced here): a tensor of a mapped file is
    read with ``pread`` instead of by touching its pages, so the store's EIO is an error naming the file and the
    offset. Before: the touch (or, with one thread, safetensors' own read of its mapping) killed the process with
    SIGBUS. In a child process: a SIGBUS here would end pytest."""
    shard = _shard(tiny_wan_dir)
    with faulty_store(tiny_wan_dir, tmp_path, shard, mode="eio") as (checkpoint, fault):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-c", NO_POPULATE, str(checkpoint), str(threads)], env=env,
                              capture_output=True, text=True, timeout=300)
        failed = wait_for(fault.marker, timeout_s=0)
    assert proc.returncode == 3, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    mounted = checkpoint / "transformer" / shard.name
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith(f"CheckpointError: {mounted}: error while reading tensor "), line
    offset = int(re.search(r" at byte (\d+)", line).group(1))
    assert failed["offset"] <= offset < failed["offset"] + failed["size"], (offset, failed)


def test_opening_a_shard_whose_read_stalls_is_bounded_and_named(tiny_wan_dir, tmp_path):
    """A read of one shard's last page stalls in the store (here another thread: in a server, a peer rank). Opening
    that shard again waits in the kernel for the page the read holds (FUSE drops a file's cached pages on open),
    SIGKILL or not: before, every reader opened a shard in the loading thread (the header read again, the mapping,
    ``rank_local``'s descriptor) and a 2-rank server hung there (seen). Now each open is bounded by
    ``read_timeout_s`` and named; seen hanging on the code before."""
    import threading

    from vllm_diffusion_plugin.engine.io import stream as file_reads
    from vllm_diffusion_plugin.engine.io import threads as reader
    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_component

    shard = _shard(tiny_wan_dir)
    with faulty_store(tiny_wan_dir, tmp_path, shard, mode="stall") as (checkpoint, fault):
        mounted = checkpoint / "transformer" / shard.name
        source = resolve_component(checkpoint / "transformer")
        fd = os.open(mounted, os.O_RDONLY)

        def held() -> None:
            with contextlib.suppress(OSError):  # the store unmounted: the read ends
                os.pread(fd, 1, os.fstat(fd).st_size - 1)

        threading.Thread(target=held, daemon=True).start()
        wait_for(fault.marker, timeout_s=30)  # that read is held in the store now
        with reader.bounded_reads(1.0):
            with pytest.raises(reader.ReadTimeoutError) as mapped:
                next(file_reads.mapped_file(source, mounted, source.keys_in(mounted)))
            with pytest.raises(reader.ReadTimeoutError) as described, file_reads.FileReads(source) as reads:
                reads.fill(source.keys_in(mounted)[0])
    for error in (mapped.value, described.value):
        assert f"{mounted} (reading its header): no answer within 1 s (read_timeout_s)" in str(error), error
