"""What a plan says: per component, per rank, and whether each strategy fits (``plan.plan_load`` computes it).

The result types of ``engine/plan.py`` and the fit logic over them (a node's ranks share its host memory; each rank
has its accelerator): ``Plan.fits``, ``Plan.pick``, ``Plan.summary``. Pure dataclasses; no door imports.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ComponentPlan:
    """One component on one rank under one strategy (bytes)."""

    name: str
    bytes_read: int
    held: int
    """Parameter/buffer bytes this rank holds once the component is loaded (local shards when sharded)."""
    peak: int
    """The most this component's load holds at once on the host (cpu) or accelerator, transients included."""
    transient: str
    transient_bytes: int


@dataclass(frozen=True)
class RankPlan:
    """One rank under one strategy: its components and the peaks over the whole load (bytes)."""

    rank: int
    strategy: str
    """The strategy asked for; ``runs`` is what the load would use (one process: always ``full``)."""
    runs: str
    components: tuple[ComponentPlan, ...]
    bytes_read: int
    host_peak: int
    device_peak: int | None
    """None when the load runs on the CPU (no accelerator)."""
    first_run_peak: int
    """Held bytes plus what FSDP2's all-gathers add during the first run (``first_run_gather``; host or
    accelerator)."""
    host_private_peak: int = 0
    """``host_peak`` less the clean checkpoint pages it maps (``full`` views its files copy-on-write): what the
    kernel cannot drop under a memory limit, and what ranks on one node do not share (they share file pages)."""
    first_run_private_peak: int = 0
    """``first_run_peak`` likewise (on the CPU: the held bytes not mapped from files plus the all-gather)."""
    held_mapped: int = 0
    """Clean file pages the loaded modules keep viewing (an unsharded ``full`` component on the host): in use by
    the model, so counted, but once per node (the ranks share them)."""
    swap_peak: int = 0
    """What a LoRA swap to a set like the planned one holds beyond the loaded model (``engine.swap.planned_peak``):
    every DiT's new factors, plus its largest transient (a fusion chunk; under ``rank_local`` one block's rows of the
    online-quantized layers in the load dtype). 0 without LoRA files."""


@dataclass(frozen=True)
class Plan:
    """What each strategy needs on each rank, and whether it fits the given memory."""

    checkpoint: str
    world_size: int
    layout: tuple[int, int] | None
    device_type: str
    dtype: str
    ranks: tuple[RankPlan, ...]
    unavailable: dict[str, str] = field(default_factory=dict)
    """Strategy -> why it cannot serve this load (``check_strategy``'s message)."""
    host_memory: int | None = None
    """Host memory of one node, shared by its ranks (their host peaks add up)."""
    device_memory: int | None = None
    """Memory of one accelerator (one per rank)."""
    local_world_size: int | None = None
    """Ranks per node (consecutive ranks share a node's host memory); None: every rank on one node."""
    views_files: bool = True
    """``full`` views its files' pages as the CLI's load does; False: the door copies every tensor into a model
    built elsewhere (vllm-omni), so the host needs are the host peaks, file pages and all."""

    def host_need(self, r: RankPlan, *, first_run: bool = True) -> int:
        """What ``r`` needs of the host that the kernel cannot reclaim: its private host peak, or on the CPU its
        first run's when larger (``first_run=False``: the load alone, as the CLI's, which runs nothing). The clean
        file pages a load maps are left out: under pressure the kernel drops them (and reads them again), and the
        ranks of a node share them."""
        if not self.views_files:
            return max(r.host_peak, r.first_run_peak if self.device_type == "cpu" and first_run else 0)
        return max(r.host_private_peak, r.first_run_private_peak if self.device_type == "cpu" and first_run else 0)

    def device_need(self, r: RankPlan) -> int | None:
        """What ``r`` needs of its accelerator: its device peak or its first run's peak (None on the CPU)."""
        return None if r.device_peak is None else max(r.device_peak, r.first_run_peak)

    def node_host_need(self, strategy: str, *, first_run: bool = True) -> tuple[int, tuple[int, ...]]:
        """The most one node's ranks need of its host under ``strategy`` together, and those ranks."""
        per_node = self.local_world_size or self.world_size
        nodes: dict[int, list[RankPlan]] = {}
        for r in self.ranks:
            if r.strategy == strategy:
                nodes.setdefault(r.rank // per_node, []).append(r)
        need = lambda rows: sum(self.host_need(r, first_run=first_run) for r in rows) + \
            max((r.held_mapped for r in rows if self.views_files), default=0)  # noqa: E731
        worst = max(nodes.values(), key=need, default=[])
        return need(worst), tuple(r.rank for r in worst)

    def fits(self, strategy: str, *, first_run: bool = True) -> bool | None:
        """Whether ``strategy`` fits the given memory: each node's ranks' host needs together within
        ``host_memory``, each rank's device need within ``device_memory`` (None: no limit given)."""
        if strategy in self.unavailable:
            return False
        if self.host_memory is None and self.device_memory is None:
            return None
        if self.host_memory is not None and \
                self.node_host_need(strategy, first_run=first_run)[0] > self.host_memory:
            return False
        needs = [self.device_need(r) for r in self.ranks if r.strategy == strategy]
        return self.device_memory is None or all(n is None or n <= self.device_memory for n in needs)

    def pick(self, *, first_run: bool = True) -> str | None:
        """The fitting strategy with the smallest host peak on any rank, then the fewest bytes read per rank."""
        def cost(strategy: str) -> tuple[int, int]:
            rows = [r for r in self.ranks if r.strategy == strategy]
            return (max(max(r.host_peak, r.device_peak or 0) for r in rows), max(r.bytes_read for r in rows))

        usable = [s for s in STRATEGY_ORDER
                  if s not in self.unavailable and self.fits(s, first_run=first_run) is not False]
        return min(usable, key=cost) if usable else None

    def summary(self, strategy: str) -> dict[str, Any] | None:
        """``strategy`` on its worst rank, figure by figure (each the largest over its ranks), with the node's
        host need and whether it fits; None when the strategy cannot serve this load."""
        rows = [r for r in self.ranks if r.strategy == strategy]
        if not rows:
            return None
        devices = [r.device_peak for r in rows if r.device_peak is not None]
        node, node_ranks = self.node_host_need(strategy)
        return {"runs": rows[0].runs, "bytes_read": max(r.bytes_read for r in rows),
                "held": max(sum(c.held for c in r.components) for r in rows),
                "host_peak": max(r.host_peak for r in rows), "device_peak": max(devices) if devices else None,
                "first_run_peak": max(r.first_run_peak for r in rows), "swap_peak": max(r.swap_peak for r in rows),
                "worst_rank": max(rows, key=lambda r: (self.host_need(r), self.device_need(r) or 0)).rank,
                "node_host_need": node, "node_ranks": list(node_ranks), "fits": self.fits(strategy)}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["fits"] = {s: self.fits(s) for s in STRATEGY_ORDER}
        data["pick"] = self.pick()
        data["summary"] = {s: self.summary(s) for s in STRATEGY_ORDER if s not in self.unavailable}
        return data


STRATEGY_ORDER = ("full", "broadcast", "rank_local")
