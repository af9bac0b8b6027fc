"""``patch_worker_death``'s account of dead diffusion workers, on real processes (the server-level proof, a worker
SIGKILLed while a real ``vllm serve --omni`` starts, is ``tests/serve/test_serve_faults.py``)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import signal
import time

import pytest

from vllm_diffusion_plugin.doors.omni import patch_worker_death as death


def _sleep() -> None:
    time.sleep(60)


def _fail() -> None:
    time.sleep(0.3)  # after its peer was killed, as a peer failing in a collective would
    os._exit(1)


@pytest.fixture
def remembered():
    start = multiprocessing.process.BaseProcess.start
    death._workers.clear()
    death._remember_workers()
    try:
        yield
    finally:
        multiprocessing.process.BaseProcess.start = start
        death._workers.clear()


def test_the_killed_worker_is_named_first_and_the_echo_after_it(remembered):
    ctx = multiprocessing.get_context("spawn")
    echo = ctx.Process(target=_fail, name="DiffusionWorker-0", daemon=True)
    victim = ctx.Process(target=_sleep, name="DiffusionWorker-1", daemon=True)
    other = ctx.Process(target=_sleep, name="not-a-worker", daemon=True)
    for p in (victim, other):
        p.start()
    os.kill(victim.pid, signal.SIGKILL)
    echo.start()
    try:
        line = death.describe_dead(settle_s=20.0)
    finally:
        other.kill()
    assert sorted(death._workers) == [0, 1]  # only vllm-omni's worker names are remembered
    assert line.startswith("diffusion worker rank 1 died of SIGKILL (out of memory or killed from outside); then "
                           "rank 0 exited with code 1"), line


def test_nothing_to_say_while_every_worker_lives(remembered):
    ctx = multiprocessing.get_context("spawn")
    alive = ctx.Process(target=_sleep, name="DiffusionWorker-0", daemon=True)
    alive.start()
    try:
        assert death.describe_dead(settle_s=0.5) is None
    finally:
        alive.kill()
        alive.join()
