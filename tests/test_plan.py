"""``vllm-diffusion plan``: held against real loads of tiny diffusers checkpoints with real LoRA files.

Bytes read per rank must equal what ``load --json`` reports, exactly, for every strategy at 1 and 2 ranks
(gloo); plan must read no weight byte; bad input is one error line, as with ``load``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

from vllm_diffusion_plugin.doors import cli
from vllm_diffusion_plugin.tiny.models import PIPELINES, build_tiny_model, write_tiny_lora

CLI = [sys.executable, "-m", "vllm_diffusion_plugin.doors.cli"]
COMMON = ("--device", "cpu", "--dtype", "float32")


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DIFFUSION")}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("vllm-diffusion: ")]


@pytest.fixture(autouse=True)
def keep_vllm_logging(monkeypatch):
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")


@pytest.fixture(scope="module")
def wan_loras(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("plan-loras")
    return [f"--lora={write_tiny_lora(root / f'lora_{name}.safetensors', build_tiny_model('wan', seed=i), seed=i)}"
            for i, name in enumerate(PIPELINES["wan"][2])]


def plan_json(capsys, *args: str) -> dict:
    assert cli.main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def planned_reads(plan: dict, strategy: str) -> list[int]:
    return [r["bytes_read"] for r in plan["ranks"] if r["strategy"] == strategy]


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("strategy", ["full", "broadcast", "rank_local"])
def test_plan_bytes_read_per_rank_equal_the_load_exactly(tiny_wan_dir, wan_loras, capsys, strategy, nproc):
    plan = plan_json(capsys, str(tiny_wan_dir), *wan_loras, *COMMON, "--nproc", str(nproc))
    proc = run_cli("load", str(tiny_wan_dir), *wan_loras, *COMMON, "--nproc", str(nproc),
                   "--hsdp-weight-load", strategy, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(proc.stdout)["ranks"]
    measured = [r["bytes_read"] for r in ranks]
    assert all(0 < r["baseline_rss_bytes"] <= r["peak_rss_bytes"] for r in ranks), ranks  # RSS before weights
    assert planned_reads(plan, strategy) == measured
    if nproc == 2 and strategy == "rank_local":  # each rank its own rows: about half, not the whole
        whole = planned_reads(plan, "full")[0]
        assert all(0.4 * whole < m < 0.6 * whole for m in measured), (measured, whole)


@pytest.fixture(scope="module")
def wide_dit(tmp_path_factory) -> tuple[Path, Path]:
    """A DiT big enough for RSS to measure (~350 MB bf16: 10 blocks of width 1024, saved by diffusers in shards)
    and a rank-32 LoRA on its attention."""
    import diffusers

    root = tmp_path_factory.mktemp("plan-wide")
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=128, in_channels=16, out_channels=16,
            text_dim=1024, freq_dim=256, ffn_dim=4096, num_layers=10, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=64)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    model.save_pretrained(root / "dit", max_shard_size="100MB")
    lora = write_tiny_lora(root / "lora.safetensors", model, rank=32)
    return root / "dit", lora


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["full", "broadcast", "rank_local"])
def test_plan_host_peak_within_15_percent_of_the_load(wide_dit, capsys, strategy):
    """What each rank's load adds to its RSS (peak minus ``baseline_rss_bytes``) at 2 gloo ranks with a LoRA,
    against the plan's host peak for that rank: within 15%. (Failed before the baseline was taken after the
    model classes' import -- rank_local measured ~2x its plan, the ~400 MB import of diffusers' Wan module --
    and before the plan followed the load's phases: broadcast's bucket, full's file mappings.)"""
    dit, lora = wide_dit
    args = (str(dit), f"--lora={lora}", "--device", "cpu", "--dtype", "bfloat16", "--nproc", "2")
    planned = {r["rank"]: r["host_peak"] for r in plan_json(capsys, *args)["ranks"] if r["strategy"] == strategy}
    proc = run_cli("load", *args, "--hsdp-weight-load", strategy, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    added = {r["rank"]: r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in json.loads(proc.stdout)["ranks"]}
    assert min(added.values()) > 1.5e8, added  # the DiT's bytes, not noise
    for rank, measured in added.items():
        assert abs(planned[rank] - measured) <= 0.15 * measured, (strategy, rank, planned[rank], measured)


def forward_worker(rank: int, world_size: int, dit: str) -> dict:
    """Load ``dit`` rank_local, then one forward of it: what the forward adds to the rank's peak RSS (``VmHWM``
    reset to the RSS right before it) against what the plan says the first run adds above the held shards."""
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.session import load_components
    from vllm_diffusion_plugin.engine.plan import plan_load

    def status(key: str) -> int:
        return next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith(key + ":"))

    import ctypes

    ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: blocks of a real DiT are far above glibc's 32 MiB
    options = LoadOptions(hsdp_weight_load="rank_local")
    loaded = load_components(dit, options=options, device=torch.device("cpu"), dtype=torch.bfloat16,
                             hsdp=HSDPConfig())
    (model,) = loaded.modules.values()
    plan = plan_load(dit, options=options, world_size=world_size, hsdp=HSDPConfig(), dtype=torch.bfloat16)
    planned = next(r for r in plan.ranks if r.strategy == "rank_local" and r.rank == rank)
    inputs = {"hidden_states": torch.randn(1, 16, 1, 8, 8, dtype=torch.bfloat16), "timestep": torch.tensor([500]),
              "encoder_hidden_states": torch.randn(1, 8, 1024, dtype=torch.bfloat16)}
    with torch.no_grad():
        model(**inputs)  # the allocator's first touch of the activations' sizes, not the all-gathers' peak
        before = status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        model(**inputs)
    return {"added": status("VmHWM") - before,
            "planned": planned.first_run_peak - sum(c.held for c in planned.components)}


@pytest.mark.multiproc
def test_plan_first_run_within_15_percent_of_a_forward(wide_dit):
    """The first run's peak above the held shards (a server's warm-up: FSDP2's all-gathers) at 2 gloo ranks: the
    plan against one forward of the loaded DiT, measured through ``VmHWM``. Before, the plan counted one block's
    all-gather (32 MiB planned against 118 MiB measured); FSDP2 holds the root unsharded for the whole forward and,
    while it gathers a block, that block's all-gather output and unsharded parameters beside the previous unit's
    all-gather output."""
    dit, _ = wide_dit
    for rank, r in enumerate(run_distributed(forward_worker, 2, args=(str(dit),), timeout_s=600)):
        print(f"\n[first run] rank {rank}: planned {r['planned'] / 2**20:.1f} MiB, measured "
              f"{r['added'] / 2**20:.1f} MiB", flush=True)
        assert r["added"] > 5e7, r  # the blocks' bytes, not noise
        assert abs(r["planned"] - r["added"]) <= 0.15 * r["added"], (rank, r)


def _hollow(folder: Path) -> int:
    """Replace every safetensors data region under ``folder`` by a hole (zeros, never written): the headers stay
    valid, any weight value read is now 0. Returns the data bytes."""
    import struct

    total = 0
    for path in folder.rglob("*.safetensors"):
        size = path.stat().st_size
        with open(path, "rb") as f:
            header_end = 8 + struct.unpack("<Q", f.read(8))[0]
        os.truncate(path, header_end)
        os.truncate(path, size)
        total += size - header_end
    return total


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_plan_reads_no_weight_byte(tmp_path, capsys, monkeypatch):
    """A DiT with ~10 MB of weights: plan's answer is the same when its data is a hole, and the plan reads
    (read/pread syscalls, /proc/self/io) far less than one shard while safetensors' tensor reads and
    torch.load are made to fail."""
    import diffusers
    import safetensors

    model = diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64,
                                            in_channels=4, out_channels=4, text_dim=64, freq_dim=32, ffn_dim=1024,
                                            num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                            rope_max_seq_len=32)
    model.save_pretrained(tmp_path / "dit", max_shard_size="4MB")
    args = (str(tmp_path / "dit"), *COMMON, "--nproc", "2")
    before = plan_json(capsys, *args)
    data = _hollow(tmp_path / "dit")
    assert data > 8e6

    real_open = safetensors.safe_open

    class HeaderOnly:
        def __init__(self, *a, **k):
            self._inner = real_open(*a, **k)

        def __enter__(self):
            self._inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self._inner.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_tensor(self, *a):
            raise AssertionError("plan read a tensor")

        get_slice = get_tensor

    def no_load(*a, **k):
        raise AssertionError("plan loaded a pickle")

    monkeypatch.setattr(safetensors, "safe_open", HeaderOnly)
    monkeypatch.setattr(torch, "load", no_load)
    started = _rchar()
    after = plan_json(capsys, *args)
    read = _rchar() - started
    assert read < 1e6, f"plan read {read} bytes of {data} data bytes"
    assert before["ranks"] == after["ranks"]


def test_plan_table_names_strategies_and_pick(tiny_wan_dir, wan_loras, capsys):
    args = ["plan", str(tiny_wan_dir), *wan_loras, *COMMON, "--nproc", "2", "--host-memory", "64GiB"]
    assert cli.main([*args, "--per-rank"]) == 0
    out = capsys.readouterr().out
    for word in ("full", "broadcast", "rank_local", "lora_device_chunk_mb", "hsdp_broadcast_bucket_mb",
                 "pick: rank_local", "64.00 GiB"):
        assert word in out, out
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    for word in ("read", "held", "host peak", "device peak", "fits", "pick: rank_local", "64.00 GiB shared by 2"):
        assert word in out, out


def test_plan_is_one_line_per_strategy_at_scale_and_every_rank_on_request(tiny_wan_dir, capsys):
    """8 ranks x 2 DiTs x 3 strategies: by default a header, one line per strategy (its worst rank) and the
    verdict; ``--per-rank`` the table of every rank and component, as before; --json carries the summary."""
    args = ["plan", str(tiny_wan_dir), *COMMON, "--nproc", "8", "--host-memory", "64GiB"]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[2:5]}
    assert set(rows) == {"full", "broadcast", "rank_local"} and len(lines) == 7, lines
    assert all(row[-1] == "yes" for row in rows.values()), rows
    assert cli.main([*args, "--per-rank"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2 + 3 * 8 * 3 + 2
    plan = plan_json(capsys, *args[1:])
    for strategy, row in plan["summary"].items():  # the summary's figures are the largest over the ranks
        ranks = [r for r in plan["ranks"] if r["strategy"] == strategy]
        assert row["host_peak"] == max(r["host_peak"] for r in ranks)
        assert row["bytes_read"] == max(r["bytes_read"] for r in ranks)
        assert row["node_ranks"] == list(range(8)) and row["fits"] is True


def test_plan_says_what_does_not_fit(tiny_wan_dir, capsys):
    """The ranks of a node share its host memory: their host needs add up against --host-memory. ``broadcast``
    holds each DiT whole on both ranks; ``full`` views its files (pages the kernel can drop, shared by the ranks)
    and holds its shards, as ``rank_local``; each with the first run's all-gathers (a CPU load)."""
    plan = plan_json(capsys, str(tiny_wan_dir), *COMMON, "--nproc", "2")
    wanted, local = (plan["summary"][s]["node_host_need"] for s in ("broadcast", "rank_local"))
    assert local < wanted, (local, wanted)
    between = (local + wanted) // 2
    plan = plan_json(capsys, str(tiny_wan_dir), *COMMON, "--nproc", "2", "--host-memory", str(between))
    worst = max(r["host_private_peak"] for r in plan["ranks"] if r["strategy"] == "broadcast")
    assert worst < between, worst  # one rank alone would fit: only the node's sum does not
    assert plan["fits"] == {"full": True, "broadcast": False, "rank_local": True} and plan["pick"] == "rank_local"
    plan = plan_json(capsys, str(tiny_wan_dir), *COMMON, "--host-memory", "1KB")
    assert plan["pick"] is None and plan["fits"]["full"] is False


@pytest.mark.parametrize("args, match", [
    (("{tmp}/missing",), "missing"),
    (("{tmp}",), "{tmp}"),
    (("{wan}", "--lora={tmp}/bad.safetensors"), "bad.safetensors"),
    (("{wan}", "--host-memory", "lots"), "'lots'"),
])
def test_bad_input_is_one_error_line(tiny_wan_dir, tmp_path, capsys, args, match):
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    fill = {"tmp": str(tmp_path), "wan": str(tiny_wan_dir)}
    assert cli.main(["plan", *(a.format(**fill) for a in args), *COMMON]) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert match.format(**fill) in line, line


def test_plan_device_peak_within_15_percent_of_the_fake_accelerators(wide_dit, fake_accelerator):
    """A load onto an accelerator (the fake one, which counts its live bytes) with a LoRA fused there: the most
    it held at once against the plan's device peak, within 15%."""
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec
    from vllm_diffusion_plugin.engine.session import load_components
    from vllm_diffusion_plugin.engine.plan import plan_load

    dit, lora = wide_dit
    options, specs, device = LoadOptions(), [LoraSpec(lora)], fake_accelerator.device
    planned = plan_load(str(dit), options=options, lora_specs=specs, dtype=torch.bfloat16, device_type=device.type)
    (rank,) = [r for r in planned.ranks if r.strategy == "full"]
    fake_accelerator.reset_counters()
    loaded = load_components(dit, options=options, device=device, dtype=torch.bfloat16, lora_specs=specs)
    assert loaded.report.components[0].lora_compute_device == str(device)  # the LoRA was fused there
    measured = fake_accelerator.peak_bytes
    assert measured > 3e8, measured  # the DiT's bytes
    assert abs(rank.device_peak - measured) <= 0.15 * measured, (rank.device_peak, measured)


def test_plan_of_a_load_onto_an_accelerator_counts_the_staging_ring_not_a_host_copy(tiny_wan_dir):
    """Onto an accelerator with pinned staging, an unsharded ``full`` component is built on the device and filled
    from the ring: its host need is the ring (and LoRA factors), not the component; without the ring (0 MiB) the
    old path's host copy is planned, as it is loaded."""
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.plan import plan_load

    def full_host_peak(mb: int) -> int:
        plan = plan_load(str(tiny_wan_dir), options=LoadOptions(pinned_staging_mb=mb), components=["transformer"],
                         dtype=torch.bfloat16, device_type="cuda")
        (rank,) = [r for r in plan.ranks if r.strategy == "full"]
        return rank.host_peak

    dit_bytes = 80864 // 2  # the tiny Wan's fp32 checkpoint, in bf16
    assert full_host_peak(0) >= dit_bytes
    assert full_host_peak(1) == 1 << 20  # the ring alone: the DiT never sits on the host
