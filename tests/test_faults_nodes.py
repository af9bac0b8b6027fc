"""Faults during a load (issue 36, part 2), the CLI on 2 simulated nodes: two ``torchrun --nnodes 2 --node-rank
{0,1} --nproc-per-node 1`` agents over 127.0.0.1 (static rendezvous at node 0), as on two machines; every node runs
the same command (the ranks must agree on their collectives: ``--save-fused`` on every node, rank 0 writes).

No launcher of ours watches a remote rank: node 0's rank learns of node 1's fault only by its silence in a
collective. What each node says:
- an I/O error on node 1's read: node 1 names the file and the offset (as on one node); node 0's rank fails in
  its next collective naming rank 1 as its peer that closed its connection;
- node 1's rank SIGKILLed while node 0's rank waits in the all-gather of ``--save-fused``: node 1's torchrun says
  ``exitcode: -9 ... (SIGKILL)``; node 0's rank fails naming rank 1 as lost.
Both within a generous bound; nothing left (no process, no /dev/shm segment, no output)."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from fault_cli import errors, finish, gone_within, left_behind, start
from fuse_store import faulty_store, wait_for
from proc_utils import alive

pytestmark = [pytest.mark.multiproc,
              pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")]
HOOKS = Path(__file__).resolve().parent / "fault_hooks.py"
GONE_S = 60  # the bound for every rank gone (generous: the seconds are measured and printed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(checkpoints: tuple[Path, Path], tmp_path: Path, *args: str, env: dict[str, str]):
    """Both nodes started: [(process, tmp, out, folder)] for node 0 and node 1."""
    port, nodes = _free_port(), []
    for node, checkpoint in enumerate(checkpoints):
        folder = tmp_path / f"node{node}"
        folder.mkdir()
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        proc, tmp, out = start(checkpoint, folder, *args, script=HOOKS, launcher=torchrun,
                               env={"FAULT_DIR": str(tmp_path), **env})
        nodes.append((proc, tmp, out, folder))
    return nodes


def _finish_all(nodes) -> list[str]:
    try:
        return [finish(proc, folder) for proc, _, _, folder in nodes]
    finally:
        for proc, *_ in nodes:
            if proc.poll() is None:
                proc.kill()


def _check_left(nodes, ranks: list[int]) -> None:
    """Under torchrun no launcher of ours owns the ranks' TMPDIR: a SIGKILLed rank leaves what third-party imports
    made there (a ``tmp*`` folder), and torchrun its ``torchelastic_*`` logs; not checked here."""
    for proc, tmp, out, _ in nodes:
        assert left_behind([proc.pid, *ranks], tmp, out, temp_files=False) == []


def test_an_io_error_on_node_1_is_named_there_and_ends_node_0_naming_rank_1(tiny_wan_dir, tmp_path):
    """Node 1 reads the checkpoint through a store that fails the last page of a shard with EIO; node 0 reads a
    sound copy. Before: node 0's rank said only gloo's "Connection closed by peer [127.0.0.1]:N. This is typically
    caused by a remote worker crashing ..." -- no exchange, no rank."""
    shard = sorted((tiny_wan_dir / "transformer").glob("*.safetensors"))[2]
    with faulty_store(tiny_wan_dir, tmp_path, shard, mode="eio") as (mounted, fault):
        nodes = _nodes((tiny_wan_dir, mounted), tmp_path, "--hsdp-weight-load", "full", env={})
        try:
            wait_for(fault.marker)
        finally:
            failed = time.monotonic()
            errs = _finish_all(nodes)
    ranks = [wait_for(tmp_path / f"started-rank{r}.json", timeout_s=0)["pid"] for r in (0, 1)]
    gone = time.monotonic() - failed + gone_within(ranks, GONE_S)
    print(f"\n[all gone] EIO on node 1: {gone:.1f} s after the failed read", flush=True)
    lines = [errors(err) for err in errs]
    print(lines, flush=True)
    assert [proc.returncode for proc, *_ in nodes] == [1, 1], (errs[0][-3000:], errs[1][-3000:])
    assert len(lines[1]) == 1 and lines[1][0].startswith(f"vllm-diffusion: error: {mounted / 'transformer'}"), lines
    assert re.search(r"at byte \d+", lines[1][0]), lines[1]
    assert len(lines[0]) == 1 and "failed on rank 0 of 2" in lines[0][0], lines[0]
    assert "rank 1, its only peer, closed its connection" in lines[0][0], lines[0]
    assert gone < GONE_S, gone
    _check_left(nodes, ranks)


def test_a_rank_sigkilled_on_node_1_ends_node_0_naming_rank_1(tiny_wan_dir, tmp_path):
    """``rank_local``: node 1's rank held in its read, node 0's rank waiting in the all-gather of ``--save-fused``;
    node 1's rank SIGKILLed. Before: node 0 said only gloo's "Connection closed by peer ..." echo."""
    nodes = _nodes((tiny_wan_dir, tiny_wan_dir), tmp_path, "--hsdp-weight-load", "rank_local",
                   env={"FAULT_HOLD": "1", "FAULT_MARK_COLLECTIVES": "1"})
    try:
        held = wait_for(tmp_path / "held-rank1.json")
        waiting = wait_for(tmp_path / "collective-rank0.json")
        os.kill(held["pid"], signal.SIGKILL)
    finally:
        killed = time.monotonic()
        errs = _finish_all(nodes)
    ranks = [waiting["pid"], held["pid"]]
    gone = time.monotonic() - killed + gone_within(ranks, GONE_S)
    print(f"\n[all gone] rank 1 on node 1 SIGKILLed: {gone:.1f} s after the kill", flush=True)
    lines = [errors(err) for err in errs]
    print(lines, flush=True)
    assert [proc.returncode for proc, *_ in nodes] == [1, 1], (errs[0][-3000:], errs[1][-3000:])
    assert "exitcode  : -9" in errs[1] and "SIGKILL" in errs[1], errs[1][-3000:]  # torchrun's word on node 1
    assert len(lines[0]) == 1 and "failed on rank 0 of 2" in lines[0][0], lines[0]
    assert "rank 1, its only peer, closed its connection" in lines[0][0], lines[0]
    assert not alive(held["pid"]) and gone < GONE_S, gone
    _check_left(nodes, ranks)
