"""Staging onto an accelerator (``engine.reader.DeviceStaging``) with the fake accelerator, whose non-blocking copies
from page-locked memory on a side stream run only when waited for (``testing.fake_streams``): a buffer refilled
before its copy completed hands the device the wrong bytes, so these tests see ordering bugs as wrong data."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from vllm_diffusion_plugin.engine.io import pagein
from vllm_diffusion_plugin.engine.io import staging as reader
from vllm_diffusion_plugin.engine.io.threads import THREAD_NAME
from vllm_diffusion_plugin.engine.errors import CheckpointError
from vllm_diffusion_plugin.testing.logs import captured_logs

MIB = 1 << 20


def sources(*numels: int, dtype=torch.bfloat16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen).to(dtype) for n in numels]


def staged(tensors, device, staging, *, threads=1, dst_dtype=None):
    out = [torch.empty(t.shape, dtype=dst_dtype or t.dtype, device=device) for t in tensors]
    tags = list(staging.copy((reader.StagedCopy(d, t.dtype, reader.tensor_bytes(t), tag=i)
                              for i, (d, t) in enumerate(zip(out, tensors))), threads=threads))
    return out, tags


@pytest.mark.parametrize("threads", [1, 3])
def test_every_byte_arrives_in_order_through_a_ring_smaller_than_the_data(fake_accelerator, threads):
    dev = fake_accelerator.device
    tensors = sources(3 * MIB, 5, 0, MIB // 2 + 7, 2 * MIB)  # 12.5 MiB bf16 through 4 x 1 MiB buffers
    staging = reader.DeviceStaging(dev, max_bytes=4 * MIB, slots=4)
    out, tags = staged(tensors, dev, staging, threads=threads)
    assert tags == list(range(len(tensors)))  # each tag once all of its bytes were issued, in order
    for got, want in zip(out, tensors):
        assert torch.equal(got.cpu(), want)
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert fake_accelerator.h2d_async_bytes == total  # every byte asynchronously, from pinned memory
    assert fake_accelerator.pinned.allocations == 4  # the bound: 4 buffers, reused


def test_a_buffer_is_refilled_only_after_its_copy_completed(fake_accelerator, monkeypatch):
    """The fake queues each copy until waited for; without the wait on the buffer's event the ring would hand the
    device the next chunk's bytes. Shown both ways: the real ring is exact, the ring without the wait is not."""
    dev = fake_accelerator.device
    tensors = sources(3 * MIB)
    out, _ = staged(tensors, dev, reader.DeviceStaging(dev, max_bytes=2 * MIB, slots=2))
    assert torch.equal(out[0].cpu(), tensors[0])

    careless = reader.DeviceStaging(dev, max_bytes=2 * MIB, slots=2)
    monkeypatch.setattr(careless, "_events", _NeverRemembered(2))
    out, _ = staged(tensors, dev, careless)
    assert not torch.equal(out[0].cpu(), tensors[0])


class _NeverRemembered(list):
    """An events list that forgets every event: the ring then never waits before refilling a buffer."""

    def __init__(self, n: int) -> None:
        super().__init__([None] * n)

    def __setitem__(self, index, value) -> None:
        pass


def test_the_current_stream_sees_the_data_once_the_copies_were_issued(fake_accelerator):
    dev = fake_accelerator.device
    tensors = sources(MIB)
    staging = reader.DeviceStaging(dev, max_bytes=2 * MIB, slots=2)
    out, _ = staged(tensors, dev, staging)
    assert torch.equal((out[0] * 1).cpu(), tensors[0])  # work on the current stream after the copies


def test_a_dtype_cast_happens_after_the_copy_and_equals_a_plain_copy(fake_accelerator):
    dev = fake_accelerator.device
    tensors = sources(MIB + 3, dtype=torch.float32)
    out, _ = staged(tensors, dev, reader.DeviceStaging(dev, max_bytes=2 * MIB, slots=2), dst_dtype=torch.bfloat16)
    assert torch.equal(out[0].cpu(), tensors[0].to(torch.bfloat16))
    assert fake_accelerator.h2d_async_bytes == tensors[0].numel() * 2  # counted in the destination dtype


def test_no_pinned_memory_means_no_staging_and_one_log_line(fake_accelerator):
    reader._fallback_logged.clear()
    with fake_accelerator.fail_pinned(), captured_logs("vllm_diffusion_plugin.engine.io.staging", logging.INFO) as logs:
        assert reader.DeviceStaging.open(fake_accelerator.device) is None
        assert reader.DeviceStaging.open(fake_accelerator.device) is None
    lines = logs.messages(logging.INFO)
    assert len(lines) == 1 and "pageable" in lines[0] and "page-locked" in lines[0], lines
    moved = reader.to_device(sources(10), fake_accelerator.device, None)  # today's path
    assert fake_accelerator.h2d_async_bytes == 0 and moved[0].device == fake_accelerator.device


def test_nothing_to_stage_for_cpu_targets_or_a_zero_bound(fake_accelerator):
    assert reader.DeviceStaging.open(torch.device("cpu")) is None
    assert reader.DeviceStaging.open(fake_accelerator.device, max_bytes=0) is None


def test_a_read_error_is_raised_in_order_and_no_copy_is_left_pending(fake_accelerator):
    dev = fake_accelerator.device
    tensors = sources(MIB, MIB)
    out = [torch.empty_like(t, device=dev) for t in tensors]

    def broken(buffer, start):
        raise CheckpointError("shard.safetensors: error while reading tensor 'w' at byte 7")

    staging = reader.DeviceStaging(dev, max_bytes=2 * MIB, slots=2)
    copies = [reader.StagedCopy(out[0], tensors[0].dtype, reader.tensor_bytes(tensors[0]), tag="a"),
              reader.StagedCopy(out[1], tensors[1].dtype, broken, tag="b")]
    seen = []
    with pytest.raises(CheckpointError, match="shard.safetensors.*byte 7"):
        for tag in staging.copy(copies, threads=2):
            seen.append(tag)
    assert seen == ["a"]
    assert staging._stream.query()  # drained: every issued copy completed before the error left
    assert torch.equal(out[0].cpu(), tensors[0])
    assert not [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


def test_a_non_contiguous_destination_is_refused_by_shape(fake_accelerator):
    dev = fake_accelerator.device
    dst = torch.empty(4, 6, device=dev).t()
    staging = reader.DeviceStaging(dev, max_bytes=2 * MIB, slots=2)
    with pytest.raises(ValueError, match=r"non-contiguous \(6, 4\)"):
        staging.copy_all([reader.StagedCopy(dst, torch.float32, reader.tensor_bytes(torch.zeros(6, 4)))])


# ---- through the load paths: bit-identical to today's (pageable) path -----------------------------------------------
def state(module) -> dict[str, torch.Tensor]:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().cpu().clone()
            for k, v in module.state_dict().items()}


def test_a_full_load_with_a_lora_onto_an_accelerator_arrives_through_the_ring_bit_identical(
        tiny_wan_dir, tmp_path, fake_accelerator):
    """``full`` onto the (fake) accelerator: with staging the DiT is built there, every byte crosses
    asynchronously from pinned memory and the LoRA is fused there; equal, bit for bit, to today's path (built on
    the host, fused, moved)."""
    from vllm_diffusion_plugin.engine.config import LoadOptions
    from vllm_diffusion_plugin.engine.lora.specs import LoraSpec
    from vllm_diffusion_plugin.engine.session import load_components

    from vllm_diffusion_plugin.tiny.models import build_tiny_model, write_tiny_lora

    lora = write_tiny_lora(tmp_path / "lora.safetensors", build_tiny_model("wan"))
    results = {}
    for mb in (0, 1):  # 0: today's pageable path; 1 MiB: a ring far smaller than the DiT
        fake_accelerator.reset_counters()
        loaded = load_components(tiny_wan_dir, options=LoadOptions(pinned_staging_mb=mb, read_threads=3),
                                 components=["transformer"], device=fake_accelerator.device, dtype=torch.bfloat16,
                                 lora_specs=[LoraSpec(lora)])
        results[mb] = (state(loaded.modules["transformer"]), fake_accelerator.h2d_async_bytes,
                       loaded.report.components[0].bytes_read)
    (plain, plain_async, _), (staged, staged_async, read) = results[0], results[1]
    assert plain.keys() == staged.keys() and all(torch.equal(plain[k], staged[k]) for k in plain)
    landed = sum(t.numel() * t.element_size() for t in staged.values())  # in the module's dtypes
    assert plain_async == 0 and read > 0 and staged_async >= landed  # every tensor (and the LoRA factors) too


def test_rank_local_rows_on_an_accelerator_come_through_the_ring_bit_identical(tiny_wan_dir, fake_accelerator):
    """This rank's rows (shard 0 of 2 on a fake mesh) pread into the ring and copied to the local shards equal the
    rows today's path reads (pageable buffer, blocking copy)."""
    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint
    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig, apply_hsdp
    from vllm_diffusion_plugin.engine.skeleton import build_component
    from vllm_diffusion_plugin.engine.io.rows import identity_bindings, read_bound_rows
    from vllm_diffusion_plugin.engine.strategies.rank_local import materialize_local_shards
    from vllm_diffusion_plugin.testing.fake_mesh import fake_mesh

    (source,) = resolve_checkpoint(tiny_wan_dir, components=["transformer"])
    got = {}
    with fake_mesh((1, 2)) as mesh:
        for staged in (False, True):
            module = build_component(source, dtype=torch.float32, device="meta")
            buffers = {n: b for n, b in module.named_buffers()}
            module.to("meta")
            apply_hsdp(module, mesh=mesh, config=HSDPConfig(), allow_meta=True)
            materialize_local_shards(module, fake_accelerator.device, buffers)
            targets = module.state_dict(keep_vars=True)
            staging = reader.DeviceStaging(fake_accelerator.device, max_bytes=2 * MIB, slots=2) if staged else None
            fake_accelerator.reset_counters()
            _, stats = read_bound_rows(source, identity_bindings(source.tensors, targets), targets, threads=2,
                                       staging=staging)
            got[staged] = (state(module), stats.total_bytes, fake_accelerator.h2d_async_bytes)
    (plain, read, plain_async), (rows, staged_read, staged_async) = got[False], got[True]
    assert all(torch.equal(plain[k], rows[k]) for k in plain)
    assert read == staged_read < source.total_bytes and plain_async == 0 and staged_async == read


def test_weights_can_be_handed_out_on_the_accelerator_and_errors_name_the_file(tiny_wan_dir, fake_accelerator,
                                                                                monkeypatch):
    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint
    from vllm_diffusion_plugin.engine.io.stream import iterate_weights

    (source,) = resolve_checkpoint(tiny_wan_dir, components=["transformer"])
    staging = reader.DeviceStaging(fake_accelerator.device, max_bytes=2 * MIB, slots=2)
    on_host = dict(iterate_weights(source))
    handed = dict(iterate_weights(source, staging=staging, threads=2))
    assert handed.keys() == on_host.keys()
    assert all(t.device == fake_accelerator.device and torch.equal(t.cpu(), on_host[k]) for k, t in handed.items())

    def failing_read(fd, offset, buffer, file):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(pagein, "pread_into", failing_read)
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model.*error while reading tensor .*Input/output"):
        list(iterate_weights(source, staging=staging, threads=2))


def test_full_sharded_blocks_cross_through_the_ring_before_fsdp_shards_them(fake_accelerator):
    """``apply_hsdp`` with staging: each host-resident block crosses asynchronously just before FSDP2 shards it;
    the shards hold the same values as a module moved whole first (FSDP2's own move of host tensors does not run
    on the Python fake device)."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    from vllm_diffusion_plugin.engine.hsdp import HSDPConfig, apply_hsdp
    from vllm_diffusion_plugin.testing.fake_mesh import fake_mesh

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(16, 32), *(nn.Sequential(nn.Linear(32, 32)) for _ in range(3)))

    shards = {}
    with fake_mesh((1, 2)) as mesh:
        for staged in (False, True):
            module = model() if staged else model().to(fake_accelerator.device)
            fake_accelerator.reset_counters()
            staging = reader.DeviceStaging(fake_accelerator.device, max_bytes=2 * MIB, slots=2) if staged else None
            apply_hsdp(module, mesh=mesh, config=HSDPConfig(), pattern=r"^\d+$", staging=staging)
            assert all(isinstance(p, DTensor) and p.device == fake_accelerator.device for p in module.parameters())
            shards[staged] = (state(module), fake_accelerator.h2d_async_bytes)
    bytes_ = sum(p.numel() * p.element_size() for p in model().parameters())
    assert shards[False][1] == 0 and shards[True][1] == bytes_
    assert all(torch.equal(shards[False][0][k], shards[True][0][k]) for k in shards[False][0])


def test_broadcast_buckets_on_an_accelerator_are_packed_through_the_ring(fake_accelerator):
    """``broadcast``'s rank 0 packs each bucket from its host module into the (device) bucket buffer: through the
    ring, the same bytes as the pageable copies."""
    from vllm_diffusion_plugin.engine.strategies.broadcast import pack_bucket
    from vllm_diffusion_plugin.engine.strategies.buckets import Bucket, Segment

    targets = {"a": sources(MIB)[0], "b": sources(3 * MIB + 5)[0]}
    bucket = Bucket(torch.bfloat16, MIB + 2 * MIB, (Segment("a", 0, MIB, 0), Segment("b", MIB, 2 * MIB, MIB)), 1)
    plain = torch.empty(bucket.numel, dtype=torch.bfloat16, device=fake_accelerator.device)
    pack_bucket(plain, bucket, targets)
    fake_accelerator.reset_counters()
    staged = torch.empty_like(plain)
    pack_bucket(staged, bucket, targets, reader.DeviceStaging(fake_accelerator.device, max_bytes=2 * MIB, slots=2))
    assert torch.equal(plain.cpu(), staged.cpu()) and fake_accelerator.h2d_async_bytes == bucket.nbytes


def test_the_vllm_loader_fills_a_model_on_an_accelerator_through_the_ring(tiny_wan_dir, fake_accelerator):
    """vLLM's ``--load-format diffusion-hsdp`` loader (the real class, vLLM's ``LoadConfig``) on a model whose
    parameters are on the (fake) accelerator: every byte through the ring, the weights of a host load."""
    from types import SimpleNamespace

    from vllm.config.load import LoadConfig

    from vllm_diffusion_plugin.doors.vllm_loader import DiffusionHSDPLoader
    from vllm_diffusion_plugin.engine.io.checkpoint import resolve_checkpoint
    from vllm_diffusion_plugin.engine.skeleton import build_component

    folder = tiny_wan_dir / "transformer"
    (source,) = resolve_checkpoint(folder)
    loader = DiffusionHSDPLoader(LoadConfig(load_format="diffusion-hsdp",
                                            model_loader_extra_config={"pinned_staging_mb": 1}))
    config = SimpleNamespace(model=str(folder), revision=None)
    on_host = build_component(source, dtype=torch.float32, device="cpu")
    loader.load_weights(on_host, config)
    model = build_component(source, dtype=torch.float32, device=fake_accelerator.device)
    fake_accelerator.reset_counters()
    loader.load_weights(model, config)
    assert fake_accelerator.h2d_async_bytes == source.total_bytes  # fp32 into fp32: every checkpoint byte
    assert all(torch.equal(a.cpu(), b) for a, b in zip(model.state_dict().values(), on_host.state_dict().values()))
