"""What a load did: seconds per phase, bytes read, peak memory, devices, LoRA and HSDP facts.

One ``LoadReport`` per rank, one ``ComponentReport`` per component in it, in every door (the CLI, the vLLM
loader, the vllm-omni workers). ``phase("read")`` times a step; ``to_dict()`` is the ``--json`` form,
``format_table()`` the text form and ``report_line()`` one parseable log line per component (``REPORT_PREFIX``
then ``key=value`` pairs; the serving proof and the benchmarks read it from server logs). ``merge_ranks``
combines the per-rank reports of one load.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_diffusion_plugin.engine.memory import peak_rss_bytes

PHASES = ("startup", "imports", "demo_write", "validate", "preflight", "resolve", "build", "read", "broadcast", "lora",
          "postprocess", "shard", "save", "total", "wall")
"""Report order. ``resolve`` .. ``save`` are the ranks' load steps (``load_components``): ``resolve`` (headers) and
``imports`` (the diffusers classes the checkpoint names: code, seconds and ~400 MB of RSS for a diffusers model
module, paid before ``baseline_rss_bytes`` is taken), then ``total``, the load proper from the strategy checks to
the last component sharded. The CLI adds its launching process's ``startup`` (process start to ``main``) and
``imports`` (torch, diffusers and the same classes; with local ranks, the wait for the fork server's imports as
the ranks start and a rank's own class imports are added to it), ``demo_write`` (the
demo's tiny checkpoint), ``validate`` (its checks before any rank starts) and ``wall`` (process start to the
report)."""


REPORT_PREFIX = "diffusion-hsdp load report:"
"""Starts every ``report_line``."""


@dataclass
class ComponentReport:
    name: str
    class_name: str
    files: int = 0
    bytes_read: int = 0
    tensors: int = 0
    param_bytes_total: int = 0
    param_bytes_local: int = 0
    """Parameter bytes this rank holds after sharding (== total without HSDP)."""
    lora_files: int = 0
    lora_keys_fused: int = 0
    """LoRA *targets* fused (modules whose weight/bias changed; several file keys each). The JSON key keeps
    its historical name; the table heads it "lora targets"."""
    lora_compute_device: str | None = None
    lora_host_rule: str | None = None
    """Where host-resident weights were fused and why (``lora.fuse.HostSide.why``), when an accelerator was usable."""
    lora_fallbacks: int = 0
    sharded_blocks: int = 0
    shard_rule: str | None = None
    read_s: float = 0.0
    """Seconds reading this component's weights (LoRA fusion excluded)."""
    lora_s: float = 0.0
    """Seconds fusing this component's LoRA files."""
    quant_path: str | None = None
    """How ``rank_local`` finished its online-quantized layers: ``rows`` (each rank its own, the method's row
    protocol), ``layer-whole`` (each layer gathered whole and post-processed by its method, ``quant.whole``) or
    ``rows+layer-whole``; None where no layer was quantized online this way."""

    def record_lora(self, stats: Any, seconds: float) -> None:
        """What fusing this component's LoRA files did (``lora.FuseStats``, or None when nothing was fused here)."""
        self.lora_s = seconds
        if stats is not None:
            self.lora_keys_fused, self.lora_compute_device, self.lora_fallbacks = (
                stats.targets, stats.compute_device, stats.fallbacks)
            self.lora_host_rule = stats.host_rule


@dataclass
class LoadReport:
    rank: int = 0
    world_size: int = 1
    layout: tuple[int, int] = (1, 1)
    """HSDP (replicate, shard) sizes; (1, 1) when not sharded."""
    device: str = "cpu"
    dtype: str = "float32"
    strategy: str = "full"
    """The ``hsdp_weight_load`` strategy used: full, broadcast or rank_local."""
    read_threads: int = 1
    """Threads that read the checkpoint bytes (``engine.io``)."""
    seconds: dict[str, float] = field(default_factory=dict)
    components: list[ComponentReport] = field(default_factory=list)
    peak_rss_bytes: int = 0
    baseline_rss_bytes: int = 0
    """This process's RSS when the load started, before its first weight byte (``peak_rss_bytes`` minus this is
    what the load added, when the process had not peaked higher before)."""

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; phases: {', '.join(PHASES)}")
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    @property
    def bytes_read(self) -> int:
        return sum(c.bytes_read for c in self.components)

    def finish(self) -> LoadReport:
        self.peak_rss_bytes = peak_rss_bytes()
        return self

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["layout"] = {"replicate": self.layout[0], "shard": self.layout[1]}
        data["bytes_read"] = self.bytes_read
        data["lora_keys_fused"] = sum(c.lora_keys_fused for c in self.components)
        data["lora_compute_device"] = next(
            (c.lora_compute_device for c in self.components if c.lora_compute_device), None)
        data["lora_host_rule"] = next((c.lora_host_rule for c in self.components if c.lora_host_rule), None)
        return data


def report_line(report: LoadReport, component: ComponentReport) -> str:
    """One component on one rank as one parseable line: ``REPORT_PREFIX`` then ``key=value`` pairs."""
    return (f"{REPORT_PREFIX} component={component.name} rank={report.rank} world_size={report.world_size} "
            f"strategy={report.strategy} read_threads={report.read_threads} bytes_read={component.bytes_read} "
            f"tensors={component.tensors} "
            f"read_s={component.read_s:.3f} lora_s={component.lora_s:.3f} lora_files={component.lora_files} "
            f"lora_targets={component.lora_keys_fused} lora_device={component.lora_compute_device or '-'} "
            f"lora_fallbacks={component.lora_fallbacks} quant_path={component.quant_path or '-'}")


def merge_ranks(reports: list[LoadReport]) -> dict[str, Any]:
    """One JSON object for a whole load: rank 0's view plus the per-rank figures."""
    reports = sorted(reports, key=lambda r: r.rank)
    merged = reports[0].to_dict()
    merged["ranks"] = [
        {"rank": r.rank, "bytes_read": r.bytes_read, "peak_rss_bytes": r.peak_rss_bytes,
         "baseline_rss_bytes": r.baseline_rss_bytes,
         "seconds": r.seconds,
         "param_bytes_local": sum(c.param_bytes_local for c in r.components)}
        for r in reports
    ]
    return merged


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_table(merged: dict[str, Any]) -> str:
    """A human-readable table of ``merge_ranks`` output."""
    layout = merged["layout"]
    lines = [
        f"world {merged['world_size']} (replicate {layout['replicate']} x shard {layout['shard']}), "
        f"device {merged['device']}, dtype {merged['dtype']}, weight load {merged.get('strategy', 'full')}",
        "",
        f"{'component':<16}{'class':<28}{'files':>6}{'read':>12}{'params':>12}{'local':>12}"
        f"{'lora targets':>13}  lora device",
    ]
    for c in merged["components"]:
        lines.append(
            f"{c['name']:<16}{c['class_name']:<28}{c['files']:>6}{_size(c['bytes_read']):>12}"
            f"{_size(c['param_bytes_total']):>12}{_size(c['param_bytes_local']):>12}"
            f"{c['lora_keys_fused']:>13}  {c['lora_compute_device'] or '-'}"
        )
    lines += ["", "phase seconds: " + ", ".join(
        f"{p} {merged['seconds'][p]:.2f}" for p in PHASES if p in merged["seconds"])]
    lines.append(f"{'rank':<6}{'read':>12}{'local params':>14}{'peak RSS':>12}")
    for r in merged["ranks"]:
        lines.append(f"{r['rank']:<6}{_size(r['bytes_read']):>12}{_size(r['param_bytes_local']):>14}"
                     f"{_size(r['peak_rss_bytes']):>12}")
    for i, swap in enumerate(merged.get("swaps", ()), 1):
        lines.append(f"LoRA swap {i}: {len(swap['loras'])} file(s) fused, {swap['modules']} modules re-read "
                     f"({_size(swap['bytes_read'])} on rank 0) in {swap['seconds']['total']:.2f} s")
    return "\n".join(lines)
