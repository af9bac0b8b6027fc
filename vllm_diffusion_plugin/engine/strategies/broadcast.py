"""The ``broadcast`` weight-load strategy: rank 0 reads each checkpoint once and sends it to the other ranks.

Every rank builds the component's skeleton (uninitialized host storage) and derives the same *bucket plan*
from the checkpoint headers: the module tensors the checkpoint fills, in read order, cut into flat
single-dtype buckets of at most ``hsdp_broadcast_bucket_mb`` (a tensor larger than a bucket spans several).
Then, per component:

1. **handshake** -- every rank reports the plan's digest and any error it hit so far (rank 0: LoRA files,
   header validation); a mismatch or an error on any rank fails every rank before a byte is read;
2. **stream** -- rank 0 reads tensors in file order straight into its module; when the last tensor a bucket
   needs has arrived, the LoRA deltas of the tensors read so far are fused (on rank 0 only, once, with
   ``fuse_lora``'s device rule), the bucket is packed and broadcast; the other ranks unpack it into their
   modules. They read 0 bytes of the checkpoint (headers only, at resolve time);
3. **finish** -- an all-reduce confirms every rank received everything.

All collectives run on a dedicated group over the whole world created with the broadcast timeout, and every
wait is bounded by it (``Work.wait(timeout)``), so a rank that dies or stalls makes the others raise
``DistributedLoadError`` naming the bucket within the timeout -- never hang. Rank 0 streams, so no wait covers
more than reading and fusing one bucket. Buckets travel as bytes (``uint8``), so every dtype (fp8 included)
goes over any backend; with gloo they stay on the host, with nccl/hccl they are staged through the device.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from vllm_diffusion_plugin._logging import init_logger
from vllm_diffusion_plugin.engine import weights
from vllm_diffusion_plugin.engine.config import LoadOptions
from vllm_diffusion_plugin.engine.errors import DistributedLoadError
from vllm_diffusion_plugin.engine.io.checkpoint import ComponentSource, is_transformer
from vllm_diffusion_plugin.engine.io.staging import StagedCopy, tensor_bytes
from vllm_diffusion_plugin.engine.io.stream import iterate_weights
from vllm_diffusion_plugin.engine.lora import fuse_lora
from vllm_diffusion_plugin.engine.quant.checkpoints import read_together
from vllm_diffusion_plugin.engine.quant.fuse import fuse_fp8_layers, into_layers, split_deltas
from vllm_diffusion_plugin.engine.quant.layer import serialized_layers
from vllm_diffusion_plugin.engine.skeleton import build_component
from vllm_diffusion_plugin.engine.strategies.base import ComponentLoad, LoadContext, normalize_lora_files
from vllm_diffusion_plugin.engine.strategies.buckets import Bucket, plan_buckets, plan_digest

logger = init_logger(__name__)


class BroadcastChannel:
    """The collectives of ``broadcast`` loads: a dedicated group over the whole world, the timeout, a buffer.

    Every rank must create it (it creates a process group) and ``close()`` it, in the same order.
    """

    def __init__(self, *, timeout_s: float, bucket_bytes: int, device: torch.device) -> None:
        if not dist.is_initialized():
            raise RuntimeError("the broadcast weight load needs torch.distributed initialized")
        self.timeout_s = float(timeout_s)
        self.bucket_bytes = int(bucket_bytes)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(timeout=datetime.timedelta(seconds=self.timeout_s))
        backend = str(dist.get_backend(self.group))
        self.device = torch.device("cpu") if backend == "gloo" else torch.device(device)
        self._buffer: torch.Tensor | None = None
        logger.info("Broadcast weight load: group of %d ranks (%s), buckets of %.1f MiB staged on %s, timeout %.0f s",
                    self.world_size, backend, self.bucket_bytes / 2**20, self.device, self.timeout_s)

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def _fail(self, what: str, exc: BaseException, started: float) -> DistributedLoadError:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
        return DistributedLoadError(
            f"{what} failed on rank {self.rank} of {self.world_size} after {time.monotonic() - started:.1f} s "
            f"(broadcast timeout {self.timeout_s:g} s): {type(exc).__name__}: {first}. A rank died, stalled or "
            f"failed; see the other ranks' logs.")

    def _wait(self, work, what: str, started: float) -> None:
        try:
            if work.wait(timeout=datetime.timedelta(seconds=self.timeout_s)) is False:
                raise TimeoutError("the collective did not complete")
        except DistributedLoadError:
            raise
        except Exception as exc:
            raise self._fail(what, exc, started) from exc

    def handshake(self, what: str, digest: str, error: BaseException | None) -> None:
        """Exchange plan digests and errors; raise on every rank if any rank failed or disagrees.

        The rank that failed gets ``error`` back (its caller re-raises its own exception), the others a
        ``DistributedLoadError`` naming that rank and its message.
        """
        mine = (digest, None if error is None else f"{type(error).__name__}: {error}")
        gathered: list = [None] * self.world_size
        started = time.monotonic()
        try:
            dist.all_gather_object(gathered, mine, group=self.group)
        except Exception as exc:
            raise self._fail(f"the handshake before broadcasting {what}", exc, started) from exc
        failed = [(rank, msg) for rank, (_, msg) in enumerate(gathered) if msg is not None]
        if failed and error is None:
            rank, msg = failed[0]
            raise DistributedLoadError(f"rank {rank} failed before broadcasting {what}; nothing was read: {msg}")
        if error is not None:
            return
        digests = {d for d, _ in gathered}
        if len(digests) > 1:
            per_rank = ", ".join(f"rank {r}: {d}" for r, (d, _) in enumerate(gathered))
            raise DistributedLoadError(f"the ranks disagree on the bucket plan of {what} ({per_rank}): different "
                                       f"checkpoints, dtypes, bucket sizes or diffusers versions?")

    def broadcast(self, what: str, index: int, total: int, bucket: Bucket,
                  fill: Callable[[torch.Tensor], None] | None) -> torch.Tensor:
        """Broadcast one bucket from rank 0 (``fill`` packs it there); returns it, viewed as its dtype."""
        size = max(self.bucket_bytes, bucket.nbytes)
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        raw = self._buffer[: bucket.nbytes]
        data = raw.view(bucket.dtype)
        if fill is not None:
            fill(data)
        first, last = bucket.segments[0].key, bucket.segments[-1].key
        label = (f"broadcast of {what} bucket {index + 1}/{total} ({bucket.dtype}, {bucket.nbytes} bytes, "
                 f"{first}{'' if first == last else ' .. ' + last})")
        started = time.monotonic()
        try:
            work = dist.broadcast(raw, src=0, group=self.group, async_op=True)
        except Exception as exc:
            raise self._fail(label, exc, started) from exc
        self._wait(work, label, started)
        return data

    def finish(self, what: str) -> None:
        """Confirm that every rank got every bucket of ``what`` (also catches a rank lost after the last one).
        The staging buffer goes too: it would otherwise sit beside the component while FSDP2 shards it."""
        self._buffer = None
        done = torch.ones(1, device=self.device)
        started = time.monotonic()
        label = f"the completion check after broadcasting {what}"
        try:
            work = dist.all_reduce(done, group=self.group, async_op=True)
        except Exception as exc:
            raise self._fail(label, exc, started) from exc
        self._wait(work, label, started)
        if int(done.item()) != self.world_size:
            raise DistributedLoadError(f"{label}: {int(done.item())} of {self.world_size} ranks confirmed")


def pack_bucket(data: torch.Tensor, bucket: Bucket, targets: dict[str, torch.Tensor], staging=None, *,
                threads: int = 1) -> None:
    """Copy ``bucket``'s segments of the host module's tensors into the bucket buffer ``data``; a buffer on an
    accelerator is filled through ``staging`` (``staging.DeviceStaging``) when there is one, not by pageable copies."""
    pairs = [(data[s.offset:s.offset + s.length], _flat(targets[s.key], s.key)[s.start:s.start + s.length])
             for s in bucket.segments]
    with torch.no_grad():
        if staging is not None and data.device.type == staging.device.type:
            staging.copy_all((StagedCopy(dst, src.dtype, tensor_bytes(src)) for dst, src in pairs), threads=threads)
            return
        for dst, src in pairs:
            dst.copy_(src)


def _flat(tensor: torch.Tensor, key: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise DistributedLoadError(f"{key}: module tensor {tuple(tensor.shape)} stride {tensor.stride()} is not "
                                   f"contiguous; cannot broadcast it as a flat run")
    return tensor.detach().view(-1)


def _lora_parts(module: nn.Module, files: Sequence[dict],
                keys: Sequence[str] = ()) -> dict[str, list[tuple[int, str, str]]]:
    """Checkpoint key -> the (file index, target, part) LoRA updates that wait for it (part: weight/bias); an FP8
    layer's weight waits for the later of its weight and scale (``quant.checkpoints.read_together``)."""

    modules = dict(module.named_modules())
    together = read_together(keys, serialized_layers(module))
    parts: dict[str, list[tuple[int, str, str]]] = {}
    for i, deltas in enumerate(files):
        for name, delta in deltas.items():
            owner = modules.get(name)
            if delta.A is not None or delta.full_delta is not None:
                key = f"{name}.weight" if owner is not None else name
                key = keys[together[key]] if key in together else key
                parts.setdefault(key, []).append((i, name, "weight"))
            if delta.bias_delta is not None:
                parts.setdefault(f"{name}.bias", []).append((i, name, "bias"))
    return parts


class _Sender:
    """Rank 0: the weight stream ``load_into_module`` consumes; between tensors it fuses and broadcasts."""

    def __init__(self, *, what, channel, source, keys, plan, digest, targets, module, files, chunk_mb,
                 check_finite, progress, threads, host_weights="auto", staging=None) -> None:
        self.what, self.channel, self.source, self.keys, self.plan = what, channel, source, keys, plan
        self.digest, self.targets, self.module, self.files = digest, targets, module, files
        self.chunk_mb, self.check_finite, self.progress, self.threads = chunk_mb, check_finite, progress, threads
        self.host_weights, self.staging = host_weights, staging
        self.parts = _lora_parts(module, files, keys)
        self.modules = [name for name, _ in module.named_modules()]
        self.pending: dict[tuple[int, str], set[str]] = {}
        self.handshaken = False
        self.lora_stats = None
        self.fused: set[tuple[int, str]] = set()
        self.nested = {"lora": 0.0, "broadcast": 0.0}  # seconds spent inside the stream, not reading

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.handshaken = True
        self.channel.handshake(self.what, self.digest, None)
        sent, last = 0, len(self.keys) - 1
        for index, (key, tensor) in enumerate(iterate_weights(self.source, keys=self.keys, progress=self.progress,
                                                                   threads=self.threads)):
            if key != self.keys[index]:
                raise DistributedLoadError(f"{self.source.folder}: read {key!r} where the plan expects "
                                           f"{self.keys[index]!r} (position {index}); the checkpoint changed?")
            yield key, tensor  # load_into_module copies it into the module before asking for the next one
            for file_index, name, part in self.parts.pop(key, ()):
                self.pending.setdefault((file_index, name), set()).add(part)
            if index == last:  # updates whose tensor is not in the checkpoint (exempt parameters) go last
                for file_index, name, part in (p for ps in self.parts.values() for p in ps):
                    self.pending.setdefault((file_index, name), set()).add(part)
            while sent < len(self.plan) and self.plan[sent].ready_after == index:
                self._fuse_pending()
                started = time.perf_counter()
                self.channel.broadcast(self.what, sent, len(self.plan), self.plan[sent], self._packer(self.plan[sent]))
                self.nested["broadcast"] += time.perf_counter() - started
                sent += 1
        if sent != len(self.plan):
            raise DistributedLoadError(f"{self.source.folder}: the stream ended after {sent} of {len(self.plan)} "
                                       f"buckets")

    def _packer(self, bucket: Bucket) -> Callable[[torch.Tensor], None]:
        return lambda data: pack_bucket(data, bucket, self.targets, self.staging, threads=self.threads)

    def _fuse_pending(self) -> None:
        if not self.pending:
            return
        started = time.perf_counter()
        layers, fp8_files, other_files = serialized_layers(self.module), [], []
        for file_index in sorted({i for i, _ in self.pending}):  # file after file, as fuse_lora_files does
            deltas = {}
            for (i, name), parts in self.pending.items():
                if i != file_index:
                    continue
                d = self.files[i][name]
                weight = "weight" in parts
                deltas[name] = dataclasses.replace(d, A=d.A if weight else None, B=d.B if weight else None,
                                                   bias_delta=d.bias_delta if "bias" in parts else None,
                                                   full_delta=d.full_delta if weight else None)
                self.fused.add((i, name))
            fp8, deltas = split_deltas(deltas, into_layers(layers))  # FP8 layers: summed, requantized once
            fp8_files.append(fp8)
            other_files.append(deltas)
        fused = [fuse_fp8_layers(self.targets, [f for f in fp8_files if f], modules=self.modules,
                                 chunk_mb=self.chunk_mb, check_finite=self.check_finite,
                                 host_weights=self.host_weights) if any(fp8_files) else None]
        fused += [fuse_lora(self.module, deltas, chunk_mb=self.chunk_mb, check_finite=self.check_finite,
                            host_weights=self.host_weights) for deltas in other_files if deltas]
        for stats in fused:
            if stats is not None:
                self.lora_stats = stats if self.lora_stats is None else self.lora_stats + stats
        self.pending.clear()
        self.nested["lora"] += time.perf_counter() - started


def _report_early_failure(channel: BroadcastChannel, what: str, exc: BaseException, digest: str = "") -> None:
    """Tell the other ranks (through the handshake) that this one failed before the broadcast started."""
    try:
        channel.handshake(what, digest, exc)
    except Exception as second:  # the original error matters more; the peers time out at worst
        logger.warning("Could not report the failure (%s) to the other ranks: %s", exc, second)


def open_channel(options: LoadOptions, device: torch.device) -> BroadcastChannel:
    """The channel a ``broadcast`` load sends through, sized and timed by ``options``; collective."""
    return BroadcastChannel(timeout_s=options.hsdp_broadcast_timeout_s,
                            bucket_bytes=options.hsdp_broadcast_bucket_mb << 20, device=device)


def load_broadcast(source: ComponentSource, *, context: LoadContext,
                   lora_files: Sequence[tuple[str, float]]) -> ComponentLoad:
    """Load ``source`` on every rank of ``context.channel``'s world; only rank 0 reads the checkpoint (see
    module doc).

    All ranks must call this for the same sources in the same order. Returns the full module on the host.
    """

    channel, dtype, options = context.channel, context.dtype, context.options
    report, progress = context.report, context.progress

    what = f"{source.name} ({source.folder})"
    try:
        with report.phase("build"):
            module = build_component(source, dtype=dtype, device="cpu")
            if context.quantization is not None and is_transformer(source):
                context.quantization(module)  # every rank quantizes the whole tensors, as with full
            targets = module.state_dict(keep_vars=True)
            keys = [k for f in source.files for k in source.keys_in(f) if k in targets]
            plan = plan_buckets([(k, targets[k].numel(), targets[k].dtype) for k in keys],
                                bucket_bytes=channel.bucket_bytes)
            together, floor = read_together(keys, serialized_layers(module)), -1  # FP8 weight + scale, then send
            for i, bucket in enumerate(plan):
                floor = max(floor, bucket.ready_after, *(together.get(s.key, -1) for s in bucket.segments))
                plan[i] = dataclasses.replace(bucket, ready_after=floor)
            digest = plan_digest(plan)
    except Exception as exc:
        _report_early_failure(channel, what, exc)
        raise
    if channel.rank != 0:
        with report.phase("broadcast"):
            channel.handshake(what, digest, None)
            with torch.no_grad():
                for index, bucket in enumerate(plan):
                    data = channel.broadcast(what, index, len(plan), bucket, None)
                    for s in bucket.segments:
                        _flat(targets[s.key], s.key)[s.start:s.start + s.length].copy_(
                            data[s.offset:s.offset + s.length])
            channel.finish(what)
        logger.info("Received %s: %d tensors in %d buckets (%.3f GB) from rank 0; read 0 bytes of the checkpoint",
                    what, len(keys), len(plan), sum(b.nbytes for b in plan) / 1e9)
        return ComponentLoad(module, bytes_read=0, tensors=len(keys))

    sender = None
    try:
        with report.phase("lora"):
            files = normalize_lora_files(module, lora_files, strict=options.lora_strict, component=source.name)
        sender = _Sender(what=what, channel=channel, source=source, keys=keys, plan=plan, digest=digest,
                         targets=targets, module=module, files=files, chunk_mb=options.lora_device_chunk_mb,
                         check_finite=options.lora_check_finite, progress=progress,
                         threads=options.threads, host_weights=options.lora_host_weights, staging=context.staging)
        started = time.perf_counter()
        result = weights.load_into_module(module, weights=sender.stream(), source=source,
                                  strict_unexpected=options.strict_unexpected, progress=progress)
    except Exception as exc:
        if sender is None or not sender.handshaken:
            _report_early_failure(channel, what, exc, digest)
        raise
    for phase, seconds in sender.nested.items():
        report.seconds[phase] = report.seconds.get(phase, 0.0) + seconds
    reading = time.perf_counter() - started - sum(sender.nested.values())
    report.seconds["read"] = report.seconds.get("read", 0.0) + reading
    with report.phase("broadcast"):
        channel.finish(what)
    stats = sender.lora_stats
    if stats is not None:
        stats = dataclasses.replace(stats, targets=len(sender.fused))
    logger.info("Broadcast %s: read %d tensors (%.3f GB) and sent them in %d buckets to %d ranks%s", what,
                len(result.loaded), result.bytes_read / 1e9, len(plan), channel.world_size - 1,
                f"; fused {len(sender.fused)} LoRA targets first" if sender.fused else "")
    return ComponentLoad(module, bytes_read=result.bytes_read, tensors=len(result.loaded), lora=stats)
