"""Parallel reads (``engine.reader``): in order, really concurrent, bounded, bit-identical to one thread in every
strategy, errors still naming the file, no thread left behind; the ``read_threads`` option in every door."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from vllm_diffusion_plugin.engine.io import pagein
from vllm_diffusion_plugin.engine.io import threads as reader
from vllm_diffusion_plugin.engine.errors import CheckpointError
from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint
from vllm_diffusion_plugin.engine.config import LoadOptions
from vllm_diffusion_plugin.engine.io.stream import iterate_weights

STRATEGIES = ("full", "broadcast", "rank_local")


def read_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(reader.THREAD_NAME)]


class Overlap:
    """A read that takes a while and records how many such reads ran at once (``peak``)."""

    def __init__(self, seconds: float = 0.02) -> None:
        self.lock, self.active, self.peak, self.seconds = threading.Lock(), 0, 0, seconds
        self.threads: set[str] = set()

    def __call__(self, *_args) -> None:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
            self.threads.add(threading.current_thread().name)
        time.sleep(self.seconds)
        with self.lock:
            self.active -= 1


# ---- read_ahead itself ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 4])
def test_results_come_in_job_order_and_reads_overlap(threads):
    overlap, jobs = Overlap(), list(range(12))

    def read(job: int) -> int:
        overlap()
        return job * 10

    assert list(reader.read_ahead(jobs, read, threads=threads, nbytes=lambda j: 1)) == [(j, j * 10) for j in jobs]
    assert overlap.peak == (1 if threads == 1 else 4), overlap.peak  # one thread: one read at a time
    assert not read_threads_alive()


def test_bytes_read_ahead_of_the_consumer_stay_under_the_bound():
    lock, started, consumed, peak = threading.Lock(), [0], [0], [0]

    def read(job: int) -> int:
        with lock:
            started[0] += 100
            peak[0] = max(peak[0], started[0] - consumed[0])
        time.sleep(0.002)
        return job

    for _job, _ in reader.read_ahead(range(40), read, threads=8, nbytes=lambda j: 100, max_bytes=250):
        with lock:
            consumed[0] += 100
    assert 100 < peak[0] <= 300, peak  # two read ahead, plus the one being handed over


def test_a_job_larger_than_the_bound_is_read_alone():
    assert [j for j, _ in reader.read_ahead([1, 2, 3], lambda j: j, threads=4, nbytes=lambda j: 10 ** 9,
                                            max_bytes=10)] == [1, 2, 3]


def test_a_read_error_reaches_the_consumer_at_its_job_and_no_thread_is_left():
    def read(job: int) -> int:
        if job == 5:
            raise OSError("disk gone")
        return job

    got = []
    with pytest.raises(OSError, match="disk gone"):
        for job, _ in reader.read_ahead(range(20), read, threads=4, nbytes=lambda j: 1):
            got.append(job)
    assert got == [0, 1, 2, 3, 4]
    assert not read_threads_alive()


def test_a_consumer_leaving_early_stops_the_reads():
    stream = reader.read_ahead(range(1000), lambda j: time.sleep(0.001), threads=4, nbytes=lambda j: 1)
    next(stream)
    stream.close()
    assert not read_threads_alive()


def test_a_read_that_never_answers_fails_the_consumer_naming_it_and_the_thread_is_left_as_a_daemon():
    """Before: the consumer waited for the read forever, and so did the interpreter's exit (``ThreadPoolExecutor``
    joins its threads)."""
    release = threading.Event()

    def read(job: int) -> int:
        if job == 3:
            release.wait()  # a store that stopped answering
        return job

    got, started = [], time.monotonic()
    with reader.bounded_reads(0.5), pytest.raises(reader.ReadTimeoutError) as info:
        for job, _ in reader.read_ahead(range(10), read, threads=2, nbytes=lambda j: 1,
                                        where=lambda j: f"shard.safetensors at byte {j * 100}"):
            got.append(job)
    assert got == [0, 1, 2]
    assert str(info.value).startswith("shard.safetensors at byte 300: no answer within 0.5 s (read_timeout_s)")
    assert time.monotonic() - started < 60  # generous: not the stuck read's lifetime
    stuck = [t for t in threading.enumerate() if t.name.startswith(reader.THREAD_NAME) and t.is_alive()]
    assert stuck and all(t.daemon for t in stuck)  # the process's exit does not wait for it
    release.set()
    for thread in stuck:
        thread.join(10)
    assert not read_threads_alive()


def test_thread_counts_below_one_are_refused():
    with pytest.raises(ValueError, match="read threads must be >= 1"):
        list(reader.read_ahead([1], lambda j: j, threads=0, nbytes=lambda j: 1))


# ---- in the engine's readers --------------------------------------------------------------------------------------
def test_iterate_weights_faults_tensors_in_on_several_threads_same_bytes_same_order(tiny_wan_dir, monkeypatch):
    source = next(s for s in resolve_checkpoint(tiny_wan_dir) if s.name == "transformer")
    one = [(k, t.clone()) for k, t in iterate_weights(source, threads=1)]
    overlap = Overlap(0.005)
    monkeypatch.setattr(pagein, "fault_in", overlap)
    four = [(k, t.clone()) for k, t in iterate_weights(source, threads=4)]
    assert [k for k, _ in four] == [k for k, _ in one] == [k for f in source.files for k in source.keys_in(f)]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(four, one))
    assert overlap.peak >= 2 and all(n.startswith(reader.THREAD_NAME) for n in overlap.threads), vars(overlap)


def test_a_corrupt_shard_read_on_a_thread_names_the_file(tiny_wan_dir, monkeypatch):
    source = next(s for s in resolve_checkpoint(tiny_wan_dir) if s.name == "transformer")

    def fault_in(tensor, *_where):
        raise RuntimeError("Bus error reading page")

    monkeypatch.setattr(pagein, "fault_in", fault_in)
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model-0000\d-of-0000\d\.safetensors: error while "
                                              r"reading tensor .*Bus error"):
        list(iterate_weights(source, threads=4))
    assert not read_threads_alive()


def test_rank_local_row_reads_overlap(tiny_wan_dir, monkeypatch):
    from vllm_diffusion_plugin.engine.io import rows as rank_local

    source = next(s for s in resolve_checkpoint(tiny_wan_dir) if s.name == "transformer")
    targets = {k: torch.empty(info.shape, dtype=info.dtype) for k, info in source.tensors.items()}
    want = dict(iterate_weights(source))
    overlap, original = Overlap(0.005), rank_local.pread_into

    def pread_into(*args):
        overlap()
        original(*args)

    monkeypatch.setattr(rank_local, "pread_into", pread_into)
    loaded, stats = rank_local.read_bound_rows(source, rank_local.identity_bindings(source.tensors, targets), targets,
                                               threads=4)
    assert loaded == set(source.tensors) and stats.total_bytes == source.total_bytes
    assert all(torch.equal(targets[k], want[k]) for k in want)
    assert overlap.peak >= 2, overlap.peak


# ---- every strategy, 2 gloo ranks: 4 threads give the bytes of 1 ------------------------------------------------
def threads_worker(rank: int, world_size: int, checkpoint: str, lora: str) -> dict:
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.save import gather_full_state_dict
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec
    from vllm_diffusion_plugin.engine.session import load_components

    out = {}
    for strategy in STRATEGIES:
        for threads in (1, 4):
            loaded = load_components(checkpoint, options=LoadOptions(hsdp_weight_load=strategy, read_threads=threads),
                                     device=torch.device("cpu"), dtype=torch.float32, hsdp=HSDPConfig(),
                                     lora_specs=[LoraSpec(Path(lora))])
            out[(strategy, threads)] = {
                "state": {name: gather_full_state_dict(m) for name, m in loaded.modules.items()},
                "read_threads": loaded.report.read_threads, "bytes_read": loaded.report.bytes_read,
                "fused": loaded.report.to_dict()["lora_keys_fused"]}
    return out


@pytest.mark.multiproc
def test_every_strategy_loads_the_same_bytes_with_four_threads_as_with_one(tiny_wan_dir, tmp_path):
    from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora

    lora = write_tiny_lora(tmp_path / "lora.safetensors", build_tiny_model("wan"), seed=3)
    results = run_distributed(threads_worker, 2, args=(str(tiny_wan_dir), str(lora)), timeout_s=300)
    for rank, result in enumerate(results):
        for strategy in STRATEGIES:
            one, four = result[(strategy, 1)], result[(strategy, 4)]
            assert (one["read_threads"], four["read_threads"]) == (1, 4)
            assert one["bytes_read"] == four["bytes_read"] and (one["fused"] > 0 or strategy == "broadcast"), \
                (strategy, rank)
            for name, state in one["state"].items():  # gathered on rank 0
                for key, tensor in (state or {}).items():
                    assert torch.equal(four["state"][name][key], tensor), (strategy, rank, name, key)
    assert results[0][("full", 1)]["state"]["transformer"], "nothing compared"


# ---- the option in every door ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, env, want", [
    ({}, None, 4), ({"read_threads": 1}, None, 1), ({}, "8", 8), ({"read_threads": 2}, "8", 2)])
def test_read_threads_from_extra_config_and_env(monkeypatch, raw, env, want):
    if env is None:
        monkeypatch.delenv("VLLM_DIFFUSION_READ_THREADS", raising=False)
    else:
        monkeypatch.setenv("VLLM_DIFFUSION_READ_THREADS", env)
    assert LoadOptions.from_extra_config(raw).threads == want


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), ("4", TypeError), (True, TypeError)])
def test_bad_read_threads_are_refused_naming_the_key(bad, error):
    with pytest.raises(error, match="read_threads"):
        LoadOptions.from_extra_config({"read_threads": bad})


@pytest.mark.parametrize("ours, od_config, want", [
    ({}, {}, 4),
    ({}, {"enable_multithread_weight_load": True, "num_weight_load_threads": 8}, 8),
    ({}, {"enable_multithread_weight_load": False, "num_weight_load_threads": 8}, 1),
    ({"read_threads": 2}, {"enable_multithread_weight_load": True, "num_weight_load_threads": 8}, 2),
])
def test_vllm_omni_door_honours_vllm_omnis_reading_threads_unless_ours_is_set(monkeypatch, ours, od_config, want):
    from vllm_diffusion_plugin.doors.omni.serve_options import omni_options, read_threads

    monkeypatch.delenv("VLLM_DIFFUSION_READ_THREADS", raising=False)
    assert read_threads(omni_options({"diffusion_hsdp": ours}), od_config) == want


def test_cli_flag_reaches_the_load(tiny_wan_dir, capsys):
    import json

    from vllm_diffusion_plugin.doors import cli

    assert cli.main(["load", str(tiny_wan_dir), "--dtype", "float32", "--device", "cpu", "--read-threads", "3",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["read_threads"] == 3
    with pytest.raises(SystemExit):
        cli.main(["load", str(tiny_wan_dir), "--read-threads", "many"])
