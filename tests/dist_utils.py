"""Run a function on N fresh CPU processes joined by a gloo process group, with a hard timeout.

    from dist_utils import run_distributed
    results = run_distributed(my_worker, world_size=2, args=(...), timeout_s=120)

``my_worker(rank, world_size, *args)`` must be importable by a fresh interpreter (a module-level function in
a module that is cheap to import at top level). Ranks are not forks of the test process (which may already
have run torch and started threads): by default they come from multiprocessing's *fork server*, a fresh
single-threaded interpreter started once per test process that imports ``preload`` (torch, diffusers, the
plugin) once, so each rank starts with them instead of paying ~10 s of imports (a 4-rank run on 2 cores
saves most of a minute); ``start_method="spawn"`` gives fully independent interpreters. The fork server's
preload list is fixed when it first starts. Each rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``
in its environment, ``torch.set_num_threads(1)`` unless ``env`` sets ``OMP_NUM_THREADS``, and an initialized
gloo default group (met through a fresh file store, no TCP port), destroyed when the function returns.

Returns the per-rank return values (picklable) in rank order. If a rank raises, every other rank is killed
and the exception raised first (by the ranks' clocks, among those reported within a second: a failing rank's
peers usually fail next in their collectives) is re-raised here with the child's traceback attached as its
``__cause__`` (a ``RemoteTraceback`` whose message is the formatted traceback). A rank that dies without
reporting (segfault, ``os._exit``) raises ``RuntimeError``; a run past ``timeout_s`` raises ``TimeoutError``
naming the ranks that had not finished.
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.multiprocessing as mp


DEFAULT_PRELOAD = ("torch", "torch.distributed.fsdp", "diffusers.models.transformers", "vllm_diffusion_plugin.engine.hsdp",
                   "vllm_diffusion_plugin.engine.postprocess")
"""Modules the fork server imports once; every rank forked from it starts with them (a missing one is
skipped silently by multiprocessing)."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a child rank (its ``str`` is the formatted traceback)."""

    def __str__(self) -> str:
        return self.args[0]


def rendezvous() -> str:
    """A fresh ``file://`` store for one group's rendezvous. Not a TCP port: a port picked free and bound later
    by rank 0 can be taken in between by any other process (the flaky-test cause of issue 14)."""
    return "file://" + os.path.join(tempfile.mkdtemp(prefix="vllm-diffusion-store-"), "store")


def _child(fn: Callable[..., Any], rank: int, world_size: int, init_method: str, args: tuple,
           env: Mapping[str, str], pg_timeout_s: float, results) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), **env})
    import datetime

    import torch
    import torch.distributed as dist

    if "OMP_NUM_THREADS" in env:  # torch is already imported here, so the variable alone is too late
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s))
        report = (rank, True, pickle.dumps(fn(rank, world_size, *args)), time.time())
    except BaseException as exc:  # report everything, including SystemExit / KeyboardInterrupt
        tb = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)
        except Exception:
            payload = None
        report = (rank, False, (payload, f"{type(exc).__name__}: {exc}", tb), time.time())
    # Deliver the report before leaving the group: peers blocked in a collective fail only once this rank
    # disconnects, so the root cause reaches the parent first.
    results.put(report)
    results.close()
    results.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()


def _earliest_failure(results, first: tuple, grace_s: float = 1.0) -> tuple:
    """Collect the failures other ranks report within ``grace_s`` (usually their side effects: a peer's
    disconnect breaks their collectives) and return the one raised first."""
    failures = [first]
    deadline = time.monotonic() + grace_s
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            rank, ok, payload, stamp = results.get(timeout=remaining)
        except queue.Empty:
            break
        if not ok:
            failures.append((stamp, rank, payload))
    return min(failures, key=lambda f: (f[0], f[1]))


def run_distributed(fn: Callable[..., Any], world_size: int, *, args: tuple = (), timeout_s: float = 120.0,
                    env: Mapping[str, str] | None = None, start_method: str = "forkserver",
                    preload: Sequence[str] = DEFAULT_PRELOAD) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh gloo ranks; see the module docstring."""
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn' (never fork a test process that "
                         f"already ran torch), got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(preload))  # effective when this process starts its server
    results = ctx.Queue()
    init_method = rendezvous()
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [ctx.Process(target=_child, args=(fn, rank, world_size, init_method, args, env, timeout_s, results),
                         name=f"rank{rank}", daemon=True) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    failure: tuple | None = None
    try:
        while len(values) < world_size and failure is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pending = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}) "
                                   f"timed out after {timeout_s:.0f} s; ranks not finished: {pending}")
            try:
                rank, ok, payload, stamp = results.get(timeout=min(1.0, remaining))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
                if dead:
                    time.sleep(0.5)  # a dying rank may still be flushing its report
                    if results.empty():
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RuntimeError(f"rank(s) {dead} of {world_size} died without reporting "
                                           f"(exit codes {codes})")
                continue
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                failure = _earliest_failure(results, (stamp, rank, payload))
    finally:
        for proc in procs:
            if failure is not None or len(values) < world_size:
                if proc.is_alive():
                    proc.kill()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
    if failure is not None:
        _, rank, (exc_payload, summary, tb) = failure
        remote = RemoteTraceback(f"\n--- rank {rank} of {world_size} ---\n{tb}")
        exc = pickle.loads(exc_payload) if exc_payload is not None else RuntimeError(
            f"rank {rank} raised an unpicklable exception: {summary}")
        exc.add_note(f"(raised on rank {rank} of {world_size}; its traceback is the cause above)")
        raise exc from remote
    return [values[r] for r in range(world_size)]
