"""Charts of the benchmarks' JSON results: one function per benchmark turns its report into panels of bars, and one
helper (:func:`draw`) draws every panel the same way -- the baseline's bars grey and first, the floor of the same
run as a dashed line, units on the axes, the host and the date in the caption.

The benchmarks call :func:`plot` when given ``--plot PATH``. Every chart in ``docs/`` is drawn from a JSON file
committed beside it (``docs/charts/NAME.json`` -> ``NAME.png``, its ``"chart"`` key naming the function), so one
command redraws them all without re-running anything, and a chart shows what its table says::

    python benchmarks/charts.py                                  # every docs/charts/*.json
    python benchmarks/charts.py proof.json --kind gpu_proof      # one benchmark's --json output, PNG beside it

matplotlib comes with the ``bench`` extra (``pip install -e '.[bench]'``); it is imported here only, only when a
chart is drawn.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS_CHARTS = ROOT / "docs" / "charts"
SIZE_PX = (1100, 460)
"""Every chart's size in pixels (width, height): ``SIZE_PX / DPI`` inches at ``DPI``."""
DPI = 100
GiB, GB = 2**30, 1e9
GREYS, COLORS = ("#a6a6a6", "#5e5e5e"), ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")


@dataclass
class Bars:
    """One panel: one bar per (group, series); ``None`` draws no bar (``notes`` may say why).

    ``floor``: (label, one value per group) drawn as a dashed segment over each group; ``lines``: (label, value)
    drawn across the panel (a memory limit); ``spans``: per series, (low, high) per group drawn as a range;
    ``notes``: text on a bar instead of its value, keyed (group index, series label)."""

    title: str
    unit: str
    groups: list[str]
    series: dict[str, list[float | None]]
    floor: tuple[str, list[float | None]] | None = None
    lines: list[tuple[str, float]] = field(default_factory=list)
    spans: dict[str, list[tuple[float, float] | None]] = field(default_factory=dict)
    notes: dict[tuple[int, str], str] = field(default_factory=dict)
    fmt: str = "{:.2f}"
    baselines: tuple[str, ...] | None = None
    """The series drawn grey, as baselines (default: the first one)."""

    def empty(self) -> bool:
        return not self.groups or all(v is None for values in self.series.values() for v in values)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("charts need matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def add_plot_option(parser: argparse.ArgumentParser) -> None:
    """A benchmark's ``--plot PNG``; refused while parsing, before any measurement, where matplotlib is missing."""
    def path(value: str) -> Path:
        try:
            _pyplot()
        except RuntimeError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return Path(value)

    parser.add_argument("--plot", type=path, metavar="PNG",
                        help="also draw the results as a PNG chart (benchmarks/charts.py)")


def this_host() -> str:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    return f"{platform.node()} ({os.cpu_count()} CPU cores, {ram:.0f} GiB RAM)"


def draw(title: str, panels: list[Bars], path: Path, caption: str) -> None:
    """``panels`` side by side under ``title`` into the PNG ``path`` (:data:`SIZE_PX`), ``caption`` below."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(SIZE_PX[0] / DPI, SIZE_PX[1] / DPI), dpi=DPI,
                             squeeze=False, layout="constrained")
    caption = textwrap.wrap(caption, 190)
    fig.get_layout_engine().set(rect=(0, 0.01 + 0.027 * len(caption), 1, 0.99 - 0.027 * len(caption)))
    for ax, panel in zip(axes[0], panels):
        _draw_bars(ax, panel, legend_columns=2 if len(panels) < 3 else 1)
    fig.suptitle(title, fontsize=11)
    fig.text(0.005, 0.01, "\n".join(caption), fontsize=7, color="0.3", va="bottom")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _draw_bars(ax, p: Bars, *, legend_columns: int) -> None:
    width = 0.8 / len(p.series)
    top = max([v for values in p.series.values() for v in values if v is not None]
              + [y for _, y in p.lines] + [hi for s in p.spans.values() for r in s if r for hi in r[1:]])
    baselines = list(p.series)[:1] if p.baselines is None else p.baselines
    greys, colors = itertools.cycle(GREYS), itertools.cycle(COLORS)
    for i, (label, values) in enumerate(p.series.items()):
        xs = [g + (i - (len(p.series) - 1) / 2) * width for g in range(len(p.groups))]
        ax.bar(xs, [math.nan if v is None else v for v in values], width * 0.92, label=label,
               color=next(greys) if label in baselines else next(colors))
        for g, (x, v) in enumerate(zip(xs, values)):
            if note := p.notes.get((g, label)):
                ax.text(g if v is None else x, (v or 0) + top * 0.02, "\n".join(textwrap.wrap(note, 20)),
                        ha="center", va="bottom", fontsize=8, color="#d62728")
            elif v is not None:
                ax.text(x, v + top * 0.01, p.fmt.format(v), ha="center", va="bottom", fontsize=7)
        ranges = p.spans.get(label, [])
        for x, v, r in zip(xs, values, ranges):
            if r and v is not None:
                ax.errorbar(x, v, yerr=[[v - r[0]], [r[1] - v]], fmt="none", ecolor="black", capsize=3, lw=0.8)
    if p.floor:
        label, values = p.floor
        for g, v in ((g, v) for g, v in enumerate(values) if v is not None):
            ax.hlines(v, g - 0.44, g + 0.44, colors="black", linestyles="--", lw=1.2, label=label)
            label = None  # one legend entry
    for label, y in p.lines:
        ax.axhline(y, color="#d62728", linestyle="--", lw=1.3, label=label)
    ax.set_xlim(-0.5, len(p.groups) - 0.5)
    ax.set_xticks(range(len(p.groups)), ["\n".join(textwrap.wrap(g, 22)) for g in p.groups], fontsize=8)
    ax.set_ylabel(p.unit, fontsize=9)
    entries = len(p.series) + len(p.lines) + bool(p.floor)
    ax.set_ylim(0, top * (1.12 + 0.1 * math.ceil(entries / legend_columns)))  # room for the legend above the bars
    ax.set_title(p.title, fontsize=9.5)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", ncols=legend_columns)


def _blocks(n: int | None) -> str:
    return f"{n} block{'s' * (n != 1)}" if n is not None else "? blocks"


# ---- one function per benchmark: its report -> (title, panels) --------------------------------------------------
def worker(row: dict | None, key: str) -> float | None:
    """GiB of ``key`` (``load_peak``, ``baseline``...) of ``bench_capacity.py`` row's largest worker."""
    values = [w[key] for w in (row or {}).get("workers", {}).values() if w.get(key) is not None]
    return max(values) / GiB if values else None


def capacity(report: dict) -> tuple[str, list[Bars]]:
    """``bench_capacity.py``: each worker's memory at the end of its load against S (vllm-omni's own load, ours,
    the plan of ours), the floor its baseline; and the limit run: each server's peak against the limit."""
    scaling = sorted((r for r in report["rows"] if r["run"] == "scaling"), key=lambda r: r["S"])
    sizes = sorted({r["S"] for r in scaling})

    def row(setting: str, size: int) -> dict | None:
        return next((r for r in scaling if r["setting"] == setting and r["S"] == size), None)

    def plan(size: int) -> float | None:
        ours, planned = row("ours", size), (row("ours", size) or {}).get("planned_host_peak")
        base = worker(ours, "baseline")
        return base + max(planned.values()) / GiB if planned and base is not None else None

    blocks = scaling[0]["blocks"] if scaling else None
    per_s = Bars(f"each worker at the end of its load, {_blocks(blocks)} per transformer",
                 "peak RSS per worker (GiB)", [f"S = {n}" for n in sizes],
                 {"vllm-omni's own load (baseline)": [worker(row("omni", n), "load_peak") for n in sizes],
                  "ours (rank_local; S = 1: full)": [worker(row("ours", n), "load_peak") for n in sizes],
                  "the plan of ours (baseline + planned)": [plan(n) for n in sizes]},
                 floor=("ours before its first weight byte", [worker(row("ours", n), "baseline") for n in sizes]))
    limited = [r for r in report["rows"] if r["run"] == "limit"]
    return "Memory per worker: vllm-omni's own load vs ours (Wan2.2 at A14B width, real servers)", [
        per_s, _limit_run(limited)] if limited else [per_s]


def _limit_run(rows: list[dict]) -> Bars:
    """``bench_capacity.py``'s limit run: each server's cgroup peak and largest worker against the limit; what
    did not serve is said on its bars."""
    def note(r: dict) -> str:
        kills = r.get("oom_kills") or 0
        return ("OOM-killed" if r["status"] == "oom" else r["status"]) + (
            f" ({kills} kill{'s' * (kills > 1)})" if kills else "")

    server = "the server (cgroup peak)"
    return Bars(f"under one memory limit, {_blocks(rows[0]['blocks'])}, S = {rows[0]['S']}", "memory (GiB)",
                [SETTING_LABELS.get(r["setting"], r["setting"]) for r in rows],
                {server: [r["cgroup_peak"] / GiB if r.get("cgroup_peak") else None for r in rows],
                 "largest worker at the end of its load": [worker(r, "load_peak") for r in rows]},
                lines=[(f"memory limit ({rows[0]['limit'] / GiB:.1f} GiB)", rows[0]["limit"] / GiB)],
                notes={(g, server): note(r) for g, r in enumerate(rows) if r["status"] != "served"}, baselines=())


SETTING_LABELS = {"omni": "vllm-omni's own load", "omni-broadcast": "vllm-omni broadcast", "ours": "ours rank_local",
                  "omni-nolora-1": "vllm-omni, no LoRA, 1 rank", "omni-1": "vllm-omni's own load, 1 rank",
                  "ours-1": "ours, 1 rank", "omni-hsdp2": "vllm-omni's own HSDP, 2 ranks",
                  **{f"ours-hsdp2-{s}": f"ours {s}, 2 ranks" for s in ("full", "broadcast", "rank_local")}}
LAYOUT_LABELS = {"2x1": "2 nodes x 1 rank, shard 2", "2x2-S4": "2 nodes x 2 ranks, shard 4",
                 "2x2-R2S2": "2 nodes x 2 ranks, replicate 2 x shard 2"}
STORAGE_LABELS = {"warm": "warm page cache", "cold": "cold local disk", "throttled": "read cap (throttled)",
                  "latency": "latency per request (FUSE)"}


def _storage_label(kind: str, note: str | None) -> str:
    """``200 MB/s cap`` from the note ``benchmarks/storage.py`` gives a kind, or the kind's name."""
    return note.split(" on ")[0] if note else STORAGE_LABELS.get(kind, kind)


def serve_startup(report: dict) -> tuple[str, list[Bars]]:
    """``bench_serve_startup.py``: per storage kind, each setting's load phase and time to ready (medians)."""
    summary = report["summary"]
    kinds = list(dict.fromkeys(key.rpartition("-")[2] for key in summary))
    settings = list(dict.fromkeys(key.rpartition("-")[0] for key in summary))

    def panel(key: str, title: str) -> Bars:
        unit = "seconds (median)" if report.get("repeats", 1) > 1 else "seconds"
        return Bars(title, unit, [_storage_label(k, report.get("storage", {}).get(k)) for k in kinds],
                    {SETTING_LABELS.get(s, s): [summary.get(f"{s}-{k}", {}).get(key) for k in kinds]
                     for s in settings}, fmt="{:.1f}",
                    baselines=tuple(SETTING_LABELS.get(s, s) for s in settings if s.startswith("omni")))

    return (f"vllm serve --omni startup, {_blocks(report.get('blocks'))} per transformer at A14B width, "
            + (f"medians of {report['repeats']}" if report.get("repeats", 1) > 1 else "one run"),
            [panel("load_s", "workers' load phase (slowest worker)"), panel("ready_s", "launch to ready")])


def distributed_load(report: dict) -> tuple[str, list[Bars]]:
    """``bench_distributed_load.py`` (``--storage`` or not): per storage kind, each strategy's slowest rank."""
    kinds = {k: v for k, v in (report.get("storage") or {"warm": report}).items() if "strategies" in v}
    strategies = ("full", "broadcast", "rank_local")

    def slowest(kind: str, strategy: str, key: str, scale: float = 1.0) -> float | None:
        values = [r.get(key) for r in kinds[kind]["strategies"][strategy]["ranks"]]
        return max(values) / scale if values and None not in values else None

    def panel(key: str, title: str, unit: str, scale: float = 1.0) -> Bars:
        return Bars(title, unit, [_storage_label(k, kinds[k].get("note")) for k in kinds],
                    {(s + " (baseline)" if s == "full" else s): [slowest(k, s, key, scale) for k in kinds]
                     for s in strategies})

    return (f"full / broadcast / rank_local on {report['nproc']} local ranks, {report['bytes'] / GB:.2f} GB DiT",
            [panel("load_s", "load, slowest rank", "seconds"),
             panel("peak_rss_bytes", "peak RSS, largest rank", "GB per rank", GB)])


def nodes(report: dict) -> tuple[str, list[Bars]]:
    """``bench_nodes.py``: per layout, each strategy's load (the median run, the range of runs) and bytes read by
    the busiest node, against the whole DiT."""
    layouts = report["layouts"]
    strategies = ("full", "broadcast", "rank_local")
    label = {s: s + (" (baseline)" if s == "full" else "") for s in strategies}
    runs = {s: [layouts[name]["runs"][s] for name in layouts] for s in strategies}
    groups = [LAYOUT_LABELS.get(name, name) for name in layouts]
    load = Bars("load, slowest rank (median run; range of runs)", "seconds", groups,
                {label[s]: [r["load_s_max_rank"] for r in runs[s]] for s in strategies}, fmt="{:.1f}",
                spans={label[s]: [(min(r["load_s_runs"]), max(r["load_s_runs"])) if r.get("load_s_runs") else None
                                  for r in runs[s]] for s in strategies})
    read = Bars("bytes read by the busiest node", "GB per node", groups,
                {label[s]: [max(r["bytes_read_per_node"]) / GB for r in runs[s]] for s in strategies},
                lines=[("the whole DiT", report["bytes"] / GB)])
    return (f"Two nodes simulated on one host, {report['cap_mbps_per_node']:.0f} MB/s read cap per node, "
            f"{report['bytes'] / GB:.2f} GB DiT", [load, read])


def plan_real_size(report: dict) -> tuple[str, list[Bars]]:
    """``plan_real_size.py``: per S, each strategy's planned host peak per rank (the floor: what a rank holds
    after the load) and bytes read per rank."""
    plans = report["plans"]
    names = {"full": "vllm-omni's own load (= full)", "broadcast": "its broadcast (= broadcast)",
             "rank_local": "ours: rank_local"}

    def get(row: dict, strategy: str, key: str) -> float | None:
        value = row["strategies"][strategy].get(key)
        return None if value is None else value / GB

    groups = [f"S = {row['S']}" for row in plans]
    peak = Bars("planned host peak per rank (largest rank)", "GB per rank",
                groups, {names[s]: [get(row, s, "host_peak_max") for row in plans] for s in names}, fmt="{:.1f}",
                floor=("held after the load (the rank's shards)",
                       [get(row, "rank_local", "held_max") for row in plans]))
    read = Bars("bytes read per rank (largest rank)", "GB per rank", groups,
                {names[s]: [get(row, s, "bytes_read_max") for row in plans] for s in names}, fmt="{:.1f}")
    return "Wan2.2 A14B at its real size, planned by vllm-diffusion plan (both experts, bf16, two rank-64 LoRAs)", [
        peak, read]


def gpu_proof(report: dict) -> tuple[str, list[Bars]]:
    """``gpu_proof.py`` on a GPU: the load onto the GPU against the naive pageable copy and the host's staging floor,
    LoRA fusion against the HBM floor, host-resident weights on each side, the end-to-end Wan2.2 case. Nothing
    from a ``--cpu-check`` run."""
    steps = {name: step.get("result") for name, step in report.get("steps", {}).items()}
    if report.get("mode") != "gpu":
        return "", []
    panels = []
    if load := steps.get("bench_load"):
        t = {name: s["median_s"] for name, s in load["timings"].items()}
        lines = [("naive pageable safetensors -> GPU copy", t["floor"])]
        if ring := (steps.get("floors") or {}).get("staging_ring_8_threads_gb_s"):
            lines.append(("host floor: page cache -> pinned -> GPU, 8 threads", load["bytes"] / 1e9 / ring))
        panels.append(Bars("a DiT onto the GPU", "seconds (median)",
                           [f"{load['bytes'] / GB:.2f} GB, medians of {load.get('repeats', '?')}"],
                           {"diffusers from_pretrained (baseline)": [t.get("diffusers_from_pretrained")],
                            "ours, build + load": [t.get("ours_build_and_load")],
                            "ours, into a preallocated module": [t.get("ours_preallocated")]}, fmt="{:.3f}",
                           lines=lines))
    if lora := steps.get("lora_device"):
        bars = {"ours: fuse_lora on the GPU": [lora["device_s"] * 1e3]}
        if lora.get("raw_addmm_s"):
            bars["a bare addmm_ loop"] = [lora["raw_addmm_s"] * 1e3]
        panels.append(Bars("LoRA fusion, weights on the GPU", "milliseconds",
                           [f"{lora['layers']} layers, {lora['weight_bytes'] / GB:.1f} GB"], bars, fmt="{:.1f}",
                           baselines=(), lines=[("floor: HBM read + write once", lora["hbm_floor_s"] * 1e3)]))
        if lora.get("host_through_device_s"):
            bars = {"on the CPU": [lora["host_on_cpu_s"]], "through the GPU": [lora["host_through_device_s"]]}
            if lora.get("host_auto_s"):
                bars["as the rule picks"] = [lora["host_auto_s"]]
            panels.append(Bars("LoRA fusion, weights in host memory", "seconds", ["the same layers"], bars,
                               baselines=()))
    if e2e := steps.get("e2e_lora"):
        med = e2e["medians"]
        panels.append(Bars("Wan2.2 A14B width, both experts, two LoRAs: files to fused weights", "seconds",
                           [f"{e2e['dit_bytes'] / GB:.1f} GB of DiT"],
                           {"diffusers + PEFT (baseline)": [med["diffusers"]["wall_s"]],
                            "ours: vllm-diffusion load": [med["ours"]["wall_s"]]}, fmt="{:.1f}"))
    return "GPU proof: loads and LoRA fusion against the floors of the same run", panels


KINDS = {f.__name__: f for f in (capacity, serve_startup, distributed_load, nodes, plan_real_size, gpu_proof)}


def caption_of(report: dict) -> str:
    env = report.get("environment", {})
    host = report.get("host") or (f"{env['gpu']} ({env['gpu_memory_gb']} GiB), {env['cpu_count']} CPU cores, torch "
                                  f"{env['torch']}" if env.get("gpu") else this_host())
    source = f" Figures: {report['source']}." if report.get("source") else ""
    return f"Run on {host}, {report.get('date') or time.strftime('%Y-%m-%d')}.{source}"


def plot(kind: str, report: dict, path: Path | str) -> bool:
    """Draw ``report`` (the benchmark ``kind``'s JSON) into the PNG ``path``; False, said on stderr, when the
    report holds nothing to chart."""
    title, panels = KINDS[kind](report)
    panels = [p for p in panels if not p.empty()]
    if not panels:
        print(f"charts: no chart for this {kind} report (no figures to draw)", file=sys.stderr)
        return False
    draw(title, panels, Path(path), caption_of(report))
    print(f"charts: {path}", file=sys.stderr)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", type=Path,
                        help="JSON reports (default: every docs/charts/*.json); each PNG is written beside its JSON")
    parser.add_argument("--kind", choices=sorted(KINDS), help="the benchmark a report is from (default: its "
                        "'chart' key)")
    args = parser.parse_args(argv)
    paths = args.results or sorted(DOCS_CHARTS.glob("*.json"))
    for path in paths:
        report = json.loads(path.read_text())
        kind = args.kind or report.get("chart")
        if kind not in KINDS:
            parser.error(f"{path}: say which benchmark it is from with --kind ({', '.join(sorted(KINDS))})")
        plot(kind, report, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
