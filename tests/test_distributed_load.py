"""``hsdp_weight_load``: full / broadcast / rank_local on real gloo ranks (2 as (1, 2), 4 as (2, 2)).

Checked on tiny Wan DiTs written by diffusers (two transformers, several shards, an FFN of 30 rows so that
shards are uneven at S=4), with and without a LoRA that has A/B pairs, PEFT ``lora_B.bias``, ``.diff_b`` bias
deltas and ``.diff`` full deltas (a 1-D norm weight and a (1, 6, 24) table only shard 0 holds):

- every strategy's gathered state equals ``full``'s (exactly), dtypes included (bf16 keeps diffusers' fp32
  modules), and the sharded forward matches (the non-persistent rotary buffers survive ``rank_local``);
- bytes read per rank, counted by the readers: broadcast -> ranks != 0 read 0; rank_local -> each rank at
  most 1.1 x total / S, the shard group together exactly the checkpoint once;
- a receiver killed, or the sender stalled, mid-broadcast -> the survivors raise within the timeout;
- bad combinations fail before any weight is read.

Ranks come from dist_utils' fork server; each world size is one run doing all scenarios.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from dist_utils import DEFAULT_PRELOAD, _child, rendezvous, run_distributed

FFN_UNEVEN = 30
STRATEGIES = ("full", "broadcast", "rank_local")


# ---- fixtures: a checkpoint with uneven rows and a LoRA touching every kind of delta ------------------------
def write_uneven_wan(root: Path) -> Path:
    import diffusers

    from vllm_diffusion_plugin.tiny.models import TINY_CONFIGS

    config = {**TINY_CONFIGS["wan"], "ffn_dim": FFN_UNEVEN}
    index = {"_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__, "vae": [None, None],
             "transformer": ["diffusers", "WanTransformer3DModel"],
             "transformer_2": ["diffusers", "WanTransformer3DModel"]}
    root.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(("transformer", "transformer_2")):
        torch.manual_seed(seed)
        model = diffusers.WanTransformer3DModel(**config)
        gen = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
        model.save_pretrained(root / name, max_shard_size="40KB")
        assert len(list((root / name).glob("*.safetensors"))) >= 3
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def write_rich_lora(path: Path, checkpoint: Path) -> Path:
    import diffusers
    from safetensors.torch import save_file

    model = diffusers.WanTransformer3DModel.from_pretrained(checkpoint / "transformer")
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for name, module in model.named_modules():
        targets = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj")
        if isinstance(module, torch.nn.Linear) and name.endswith(targets):
            tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=gen) * 0.1
            tensors[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=gen) * 0.1
            tensors[f"transformer.{name}.alpha"] = torch.tensor(8.0)
    tensors["transformer.blocks.0.attn1.to_q.lora_B.bias"] = torch.randn(24, generator=gen) * 0.1
    tensors["transformer.blocks.1.ffn.net.0.proj.diff_b"] = torch.randn(FFN_UNEVEN, generator=gen) * 0.1
    tensors["transformer.blocks.0.norm2.diff"] = torch.randn(24, generator=gen) * 0.1
    tensors["transformer.blocks.1.scale_shift_table.diff"] = torch.randn(1, 6, 24, generator=gen) * 0.1
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def uneven(tmp_path_factory) -> tuple[str, str]:
    root = write_uneven_wan(tmp_path_factory.mktemp("uneven-wan"))
    return str(root), str(write_rich_lora(root.parent / "rich_lora.safetensors", root))


def inputs() -> dict:
    gen = torch.Generator().manual_seed(7)
    return dict(hidden_states=torch.randn(1, 4, 2, 4, 4, generator=gen), timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, 8, 16, generator=gen), return_dict=False)


def forbid_weight_reads(monkeypatch_like=None) -> None:
    """Make every weight reader raise: a strategy check that runs after a read shows up as this error."""
    from vllm_diffusion_plugin.engine.io import stream as weights
    from vllm_diffusion_plugin.engine.strategies import rank_local

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the strategy was checked")

    if monkeypatch_like is None:
        weights._iter_file = refuse
        rank_local._read_local_rows = refuse
    else:
        monkeypatch_like.setattr(weights, "_iter_file", refuse)
        monkeypatch_like.setattr(rank_local, "_read_local_rows", refuse)


# ---- the rank worker ----------------------------------------------------------------------------------------
def load_once(strategy: str, dtype: torch.dtype, checkpoint: str, lora: str | None, replicate: int) -> dict:
    from torch.distributed.tensor import DTensor

    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig
    from vllm_diffusion_plugin.engine.save import gather_full_state_dict
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec
    from vllm_diffusion_plugin.engine.session import load_components

    loaded = load_components(checkpoint, options=LoadOptions(hsdp_weight_load=strategy), device=torch.device("cpu"),
                             dtype=dtype, hsdp=HSDPConfig(replicate_size=replicate),
                             lora_specs=[LoraSpec(Path(lora))] if lora else [])
    out = {"report": loaded.report.to_dict(), "components": {}}
    for name, module in loaded.modules.items():
        source = loaded.sources[name]
        module.requires_grad_(False)  # FSDP2's forward refuses trainable params of mixed dtypes (bf16 Wan)
        with torch.no_grad():
            forward = module(**{k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                                for k, v in inputs().items()})[0]
        sharded = {n for n, t in module.state_dict().items() if isinstance(t, DTensor)}
        out["components"][name] = {
            "state": gather_full_state_dict(module),
            "forward": forward.float(),
            "all_dtensor": all(isinstance(p, DTensor) for p in module.parameters()),
            "sharded_bytes": sum(source.tensors[k].nbytes for k in sharded),
            "total_bytes": source.total_bytes,
        }
    return out


def scenarios_worker(rank: int, world_size: int, replicate: int, checkpoint: str, lora: str,
                     scenarios: list[tuple[str, str, bool]], bad_combo: bool) -> dict:
    results = {}
    for strategy, dtype_name, with_lora in scenarios:
        results[(strategy, dtype_name, with_lora)] = load_once(strategy, getattr(torch, dtype_name), checkpoint,
                                                               lora if with_lora else None, replicate)
    results["small_buckets"] = small_buckets(rank, checkpoint, lora)
    if bad_combo:
        results["uncovered"] = uncovered_tensor_is_named(checkpoint)
        # rank_local without HSDP on a multi-rank world: an error before any read, on every rank
        from vllm_diffusion_plugin.engine.config import LoadOptions
        from vllm_diffusion_plugin.engine.session import load_components
        from vllm_diffusion_plugin.engine.strategies import StrategyError

        forbid_weight_reads()
        try:
            load_components(checkpoint, options=LoadOptions(hsdp_weight_load="rank_local"),
                            device=torch.device("cpu"), dtype=torch.float32, hsdp=None)
            results["bad_combo"] = "no error"
        except StrategyError as exc:
            results["bad_combo"] = str(exc)
    return results


def uncovered_tensor_is_named(checkpoint: str) -> str:
    """A rank-local read that leaves a tensor out must fail naming it (the reader is made to skip one key)."""
    from vllm_diffusion_plugin.engine.strategies import rank_local
    from vllm_diffusion_plugin.engine.errors import WeightLoadError

    real = rank_local._read_local_rows

    def skipping(source, targets, *args):
        loaded, stats = real(source, targets, *args)
        return loaded - {"blocks.1.ffn.net.2.bias"}, stats

    rank_local._read_local_rows = skipping
    try:
        load_once("rank_local", torch.float32, checkpoint, None, 1)
        return "no error"
    except WeightLoadError as exc:
        return str(exc)
    finally:
        rank_local._read_local_rows = real


def small_buckets(rank: int, checkpoint: str, lora: str) -> dict:
    """The broadcast with 3000-byte buckets (tensors span several), LoRA fused on rank 0: the received module."""
    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.report import LoadReport
    from vllm_diffusion_plugin.engine.strategies import LoadContext
    from vllm_diffusion_plugin.engine.strategies.broadcast import BroadcastChannel, load_broadcast

    channel = BroadcastChannel(timeout_s=60, bucket_bytes=3000, device=torch.device("cpu"))
    try:
        out = {}
        for source in resolve_checkpoint(checkpoint):
            context = LoadContext(options=LoadOptions(), device=torch.device("cpu"), dtype=torch.float32,
                                  report=LoadReport(), channel=channel)
            result = load_broadcast(source, context=context, lora_files=[(lora, 1.0)])
            out[source.name] = {k: v.detach().clone() for k, v in result.module.state_dict().items()}
        return out
    finally:
        channel.close()


# ---- checks -------------------------------------------------------------------------------------------------
def assert_same_state(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, f"{what}: {key} is {got[key].dtype}, full gives {tensor.dtype}"
        assert torch.equal(got[key], tensor), f"{what}: {key} differs from full's by " \
                                              f"{(got[key].double() - tensor.double()).abs().max().item():.3g}"


def check_world(results: list[dict], shards: int, scenarios: list[tuple[str, str, bool]]) -> None:
    world = len(results)
    for strategy, dtype_name, with_lora in scenarios:
        key = (strategy, dtype_name, with_lora)
        reference = results[0][("full", dtype_name, with_lora)]
        for name, ref in reference["components"].items():
            what = f"{strategy} {dtype_name} lora={with_lora} {name}"
            got = results[0][key]["components"][name]
            assert_same_state(got["state"], ref["state"], what)
            for rank in range(world):
                component = results[rank][key]["components"][name]
                assert component["all_dtensor"], what
                torch.testing.assert_close(component["forward"], ref["forward"], rtol=1e-5, atol=1e-5, msg=what)
        for rank in range(world):
            report = results[rank][key]["report"]
            assert report["strategy"] == strategy, (what, report["strategy"])
            assert (report["lora_keys_fused"] > 0) == with_lora or (strategy == "broadcast" and rank != 0)
            for component in report["components"]:
                info = results[rank][key]["components"][component["name"]]
                read, total = component["bytes_read"], info["total_bytes"]
                if strategy == "full" or (strategy == "broadcast" and rank == 0):
                    assert read == total, (key, rank, component["name"], read, total)
                elif strategy == "broadcast":
                    assert read == 0, (key, rank, component["name"], read)
                else:
                    assert info["sharded_bytes"] == total  # every tensor of the DiT is sharded
                    assert 0 < read <= 1.1 * total / shards, (key, rank, component["name"], read, total / shards)
        if strategy == "rank_local":  # each shard group reads the checkpoint exactly once, together
            for group in range(world // shards):
                ranks = range(group * shards, (group + 1) * shards)
                assert sum(results[r][key]["report"]["bytes_read"] for r in ranks) == \
                    sum(results[0][key]["components"][c]["total_bytes"] for c in results[0][key]["components"])
    # with LoRA the state really changed (the equality above is not vacuous)
    plain, fused = (results[0][("full", "float32", lora)]["components"]["transformer"]["state"]
                    for lora in (False, True))
    changed = [k for k in plain if not torch.equal(plain[k], fused[k])]
    assert "blocks.0.attn1.to_q.bias" in changed and "blocks.1.ffn.net.0.proj.weight" in changed
    assert "blocks.0.norm2.weight" in changed and "blocks.1.scale_shift_table" in changed


def check_small_buckets(results: list[dict], reference: dict) -> None:
    for rank, result in enumerate(results):
        for name, state in result["small_buckets"].items():
            assert_same_state(state, reference[name]["state"], f"3000-byte buckets, rank {rank}, {name}")


SCENARIOS_2 = [(s, "float32", lora) for s in STRATEGIES for lora in (False, True)] + \
              [(s, "bfloat16", True) for s in STRATEGIES] + \
              [("full", "bfloat16", False), ("rank_local", "bfloat16", False)]
SCENARIOS_4 = [(s, "float32", lora) for s in STRATEGIES for lora in (False, True)]


@pytest.mark.multiproc
def test_world2_strategies_equal_full_and_read_their_share(uneven):
    checkpoint, lora = uneven
    results = run_distributed(scenarios_worker, 2, args=(1, checkpoint, lora, SCENARIOS_2, True), timeout_s=300)
    check_world(results, 2, SCENARIOS_2)
    check_small_buckets(results, results[0][("full", "float32", True)]["components"])
    # bf16 keeps diffusers' fp32 modules in fp32 under every strategy (compared against full above)
    state = results[0][("rank_local", "bfloat16", False)]["components"]["transformer"]["state"]
    assert state["blocks.0.norm2.weight"].dtype == torch.float32 and state["blocks.0.ffn.net.0.proj.weight"].dtype \
        == torch.bfloat16
    for rank in range(2):
        assert "1 parameter(s)/buffer(s) of WanTransformer3DModel were not in" in results[rank]["uncovered"]
        assert results[rank]["uncovered"].endswith("blocks.1.ffn.net.2.bias"), results[rank]["uncovered"]
        message = results[rank]["bad_combo"]
        assert "hsdp_weight_load=rank_local" in message and "use hsdp_weight_load=broadcast" in message, message


@pytest.mark.multiproc
def test_world4_replicate2_shard2_strategies_equal_full(uneven):
    checkpoint, lora = uneven
    results = run_distributed(scenarios_worker, 4, args=(2, checkpoint, lora, SCENARIOS_4, False), timeout_s=300)
    check_world(results, 2, SCENARIOS_4)
    check_small_buckets(results, results[0][("full", "float32", True)]["components"])
    key = ("rank_local", "float32", False)
    for rank in (2, 3):  # replicas read the same rows as their peer in the first group
        assert results[rank][key]["report"]["bytes_read"] == results[rank - 2][key]["report"]["bytes_read"]


# ---- a rank dies or stalls mid-broadcast ---------------------------------------------------------------------
def victim_worker(rank: int, world_size: int, checkpoint: str, victim: int, mode: str, timeout_s: float,
                  out_dir: str) -> None:
    """Broadcast-load the first transformer in 2000-byte buckets; ``victim`` dies or stalls at its 3rd bucket.
    Every other rank writes what happened (error type, message, seconds) to ``out_dir/rank<N>.json``."""
    import torch.distributed as dist

    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.report import LoadReport
    from vllm_diffusion_plugin.engine.strategies import LoadContext
    from vllm_diffusion_plugin.engine.strategies.broadcast import BroadcastChannel, load_broadcast

    if rank == victim:
        original, calls = dist.broadcast, [0]

        def broadcast(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 3:
                if mode == "die":
                    os._exit(17)
                time.sleep(600)
            return original(*args, **kwargs)

        dist.broadcast = broadcast
    source = resolve_checkpoint(checkpoint, components=["transformer"])[0]
    channel = BroadcastChannel(timeout_s=timeout_s, bucket_bytes=2000, device=torch.device("cpu"))
    started = time.monotonic()
    try:
        context = LoadContext(options=LoadOptions(), device=torch.device("cpu"), dtype=torch.float32,
                              report=LoadReport(), channel=channel)
        load_broadcast(source, context=context, lora_files=[])
        outcome = {"error": None}
    except Exception as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - started
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    os._exit(0)  # the group is broken; do not wait in its teardown


def run_with_victim(world_size: int, args: tuple, survivors: list[int], out_dir: Path, deadline_s: float) -> dict:
    """Start the ranks (dist_utils' fork server), wait for the survivors' reports until the deadline, kill all."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(DEFAULT_PRELOAD))
    queue, init_method = ctx.Queue(), rendezvous()
    procs = [ctx.Process(target=_child, args=(victim_worker, r, world_size, init_method, args,
                                              {"OMP_NUM_THREADS": "1"},
                                              120.0, queue), daemon=True) for r in range(world_size)]
    for proc in procs:
        proc.start()
    end = time.monotonic() + deadline_s
    try:
        while time.monotonic() < end and not all((out_dir / f"rank{r}.json").exists() for r in survivors):
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
    missing = [r for r in survivors if not (out_dir / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} neither finished nor raised within {deadline_s} s: a hang"
    return {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in survivors}


@pytest.mark.multiproc
def test_receiver_killed_mid_broadcast_survivors_raise_within_timeout(uneven, tmp_path):
    timeout_s = 20.0
    outcomes = run_with_victim(4, (uneven[0], 2, "die", timeout_s, str(tmp_path)), [0, 1, 3], tmp_path, 90)
    for rank, outcome in outcomes.items():
        assert outcome["error"] == "DistributedLoadError", (rank, outcome)
        assert outcome["seconds"] < timeout_s, (rank, outcome)  # a dead peer is seen at once, not at the timeout
        assert f"on rank {rank} of 4" in outcome["message"] and "transformer" in outcome["message"], outcome


@pytest.mark.multiproc
def test_sender_stalled_mid_broadcast_receivers_raise_at_the_timeout(uneven, tmp_path):
    timeout_s = 4.0
    outcomes = run_with_victim(2, (uneven[0], 0, "stall", timeout_s, str(tmp_path)), [1], tmp_path, 90)
    outcome = outcomes[1]
    assert outcome["error"] == "DistributedLoadError", outcome
    assert timeout_s * 0.9 <= outcome["seconds"] <= timeout_s + 10, outcome
    assert "bucket 3/" in outcome["message"] and "broadcast timeout 4 s" in outcome["message"], outcome


# ---- configuration -----------------------------------------------------------------------------------------
def test_bucket_plan_is_single_dtype_bounded_and_covers_every_element_once():
    from vllm_diffusion_plugin.engine.strategies.buckets import plan_buckets, plan_digest

    entries = [("a", 10, torch.float32), ("b", 3, torch.bfloat16), ("c", 25, torch.float32), ("d", 1, torch.float32),
               ("e", 7, torch.bfloat16), ("f", 0, torch.float32)]
    plan = plan_buckets(entries, bucket_bytes=48)  # 12 float32 or 24 bfloat16 elements
    covered = {key: [] for key, *_ in entries}
    for bucket in plan:
        assert bucket.nbytes <= 48 and bucket.numel == sum(s.length for s in bucket.segments)
        offset = 0
        for seg in bucket.segments:
            assert dict((k, d) for k, _, d in entries)[seg.key] == bucket.dtype and seg.offset == offset
            covered[seg.key].append((seg.start, seg.start + seg.length))
            offset += seg.length
        # sendable only once every key with elements in it was read
        assert bucket.ready_after >= max([k for k, *_ in entries].index(s.key) for s in bucket.segments)
    for key, numel, _ in entries:
        spans = sorted(covered[key])
        assert [s for s, _ in spans] == [0, *(e for _, e in spans[:-1])][:len(spans)], (key, spans)
        assert (spans[-1][1] if spans else 0) == numel, (key, spans)
    assert [b.ready_after for b in plan] == sorted(b.ready_after for b in plan)
    assert plan_digest(plan) == plan_digest(plan_buckets(entries, bucket_bytes=48))
    assert plan_digest(plan) != plan_digest(plan_buckets(entries, bucket_bytes=64))


@pytest.mark.parametrize("extra, match", [
    ({"hsdp_weight_load": "scatter"}, "hsdp_weight_load must be one of full, broadcast, rank_local, got 'scatter'"),
    ({"hsdp_broadcast_bucket_mb": 0}, "hsdp_broadcast_bucket_mb must be positive"),
    ({"hsdp_broadcast_timeout_s": 0}, "hsdp_broadcast_timeout_s must be positive"),
])
def test_bad_option_values(extra, match):
    from vllm_diffusion_plugin.engine.config import LoadOptions

    with pytest.raises(ValueError, match=match):
        LoadOptions.from_extra_config(extra)


def test_strategy_from_env_and_extra_config(monkeypatch):
    from vllm_diffusion_plugin.engine.config import LoadOptions

    monkeypatch.setenv("VLLM_DIFFUSION_HSDP_WEIGHT_LOAD", "rank_local")
    monkeypatch.setenv("VLLM_DIFFUSION_HSDP_BROADCAST_TIMEOUT_S", "12.5")
    assert LoadOptions.from_extra_config({}).hsdp_weight_load == "rank_local"
    options = LoadOptions.from_extra_config({"hsdp_weight_load": "broadcast", "hsdp_broadcast_bucket_mb": 64})
    assert (options.hsdp_weight_load, options.hsdp_broadcast_bucket_mb, options.hsdp_broadcast_timeout_s) == \
        ("broadcast", 64, 12.5)
    with pytest.raises(TypeError, match="'hsdp_weight_load' must be a string"):
        LoadOptions.from_extra_config({"hsdp_weight_load": 2})


def test_check_strategy_rules(tiny_wan_dir, tiny_checkpoint_factory, monkeypatch):
    from vllm_diffusion_plugin.engine import skeleton
    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint
    from vllm_diffusion_plugin.engine.strategies import StrategyError, check_strategy

    sources = resolve_checkpoint(tiny_wan_dir)
    assert check_strategy("rank_local", sources=sources, world_size=4, sharded=True) == "rank_local"
    assert check_strategy("broadcast", sources=sources, world_size=2, sharded=False) == "broadcast"
    assert check_strategy("rank_local", sources=sources, world_size=1, sharded=False) == "full"
    with pytest.raises(StrategyError, match="does not shard with HSDP; use hsdp_weight_load=broadcast"):
        check_strategy("rank_local", sources=sources, world_size=2, sharded=False)
    pickled = resolve_checkpoint(tiny_checkpoint_factory("wan", safe_serialization=False), allow_pickle=True)
    with pytest.raises(StrategyError, match=r"holds pickle weights \(.*\.bin\).*use hsdp_weight_load=broadcast"):
        check_strategy("rank_local", sources=pickled, world_size=1, sharded=False)
    assert check_strategy("broadcast", sources=pickled, world_size=2, sharded=True) == "broadcast"

    real = skeleton.component_class

    def with_own_loader(source):
        return type("StackedQKV", (real(source),), {"load_weights": lambda self, weights: set()})

    monkeypatch.setattr(skeleton, "component_class", with_own_loader)
    for strategy in ("broadcast", "rank_local"):
        with pytest.raises(StrategyError, match=f"StackedQKV .* own load_weights .* use hsdp_weight_load=full"):
            check_strategy(strategy, sources=sources, world_size=2, sharded=True)
    assert check_strategy("full", sources=sources, world_size=2, sharded=True) == "full"


def test_bad_combination_fails_before_any_read(tiny_checkpoint_factory, monkeypatch):
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.session import load_components
    from vllm_diffusion_plugin.engine.strategies import StrategyError

    forbid_weight_reads(monkeypatch)
    pickled = tiny_checkpoint_factory("wan", safe_serialization=False)
    with pytest.raises(StrategyError, match="use hsdp_weight_load=broadcast"):
        load_components(pickled, options=LoadOptions(hsdp_weight_load="rank_local", allow_pickle=True),
                        device=torch.device("cpu"), dtype=torch.float32)


def test_cli_rejects_bad_combination_before_any_rank_starts(tiny_checkpoint_factory, monkeypatch, capsys):
    from vllm_diffusion_plugin.doors import cli
    from vllm_diffusion_plugin.doors.cli import load as cli_load

    monkeypatch.setattr(cli_load, "rank_main", lambda args: pytest.fail("a rank started despite bad input"))
    pickled = tiny_checkpoint_factory("wan", safe_serialization=False)
    assert cli.main(["load", str(pickled), "--allow-pickle", "--nproc", "2", "--device", "cpu",
                     "--hsdp-weight-load", "rank_local"]) == 1
    err = capsys.readouterr().err
    assert "rank_local reads row ranges of safetensors files" in err and "Traceback" not in err
    monkeypatch.setenv("VLLM_DIFFUSION_HSDP_WEIGHT_LOAD", "rank_local")  # the env fallback is checked too
    assert cli.main(["load", str(pickled), "--allow-pickle", "--nproc", "2", "--device", "cpu"]) == 1
    assert "use hsdp_weight_load=broadcast" in capsys.readouterr().err


def test_shard_local_fusion_takes_the_accelerator_for_host_rows_and_moves_only_them(fake_accelerator, tmp_path):
    """Rank 0 of a (1, 2) fake mesh holds the first half of each weight's rows (host storage). Its LoRA
    update must follow ``fuse_lora``'s device rule -- computed on the usable accelerator, not on the CPU --
    and move only its own rows, ``A`` and its rows of ``B`` there (no full-size weight or delta)."""
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig, apply_hsdp
    from vllm_diffusion_plugin.engine.lora import load_lora, normalize_lora
    from vllm_diffusion_plugin.engine.lora.rows import fuse_local_rows
    from vllm_diffusion_plugin.engine.io.rows import local_rows
    from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora

    model = build_tiny_model("wan")
    original = {k: v.clone() for k, v in model.state_dict().items()}
    lora = load_lora(write_tiny_lora(tmp_path / "lora.safetensors", model, seed=2))
    deltas = normalize_lora(lora.state_dict, model, scale=1.0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
        apply_hsdp(model, mesh=mesh, config=HSDPConfig(), pattern=r"blocks\.\d+")
        fake_accelerator.reset_counters()
        stats = fuse_local_rows(model, [deltas], chunk_mb=256)
        expected_h2d = 0
        for name, delta in deltas.items():
            weight = model.get_submodule(name).weight
            assert isinstance(weight, DTensor)
            local, start, stop = local_rows(name, weight)
            assert (start, stop) == (0, math.ceil(weight.shape[0] / 2))
            want = original[f"{name}.weight"][start:stop].double() + \
                delta.scale * delta.B[start:stop].double() @ delta.A.double()
            torch.testing.assert_close(local.double(), want, rtol=1e-6, atol=1e-6, msg=name)
            expected_h2d += local.nbytes + delta.A.nbytes + delta.B[start:stop].nbytes
    finally:
        dist.destroy_process_group()
    assert stats.compute_device == str(fake_accelerator.device) and stats.targets == len(deltas)
    assert fake_accelerator.op_counts["aten::addmm_"] + fake_accelerator.op_counts["aten::addmm"] >= len(deltas)
    assert fake_accelerator.h2d_bytes == expected_h2d  # own rows + A + own rows of B, nothing full-size
