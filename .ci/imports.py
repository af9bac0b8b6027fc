"""The CPU-seconds a CI stage's Python processes spend importing: per kind of process, measured once in the stage's
environment, and how many processes of each kind the stage started.

    ENV/bin/python .ci/imports.py measure OUT.json   each kind's imports, in a fresh process of ENV's Python
    python3 .ci/imports.py report OUT.json LOG       the stage's processes (LOG: CI_PROC_LOG, written by
                                                      .ci/py/sitecustomize.py and ci_collected.py) counted per kind,
                                                      and the import CPU they add up to

What is measured: CPU time (``time.process_time``: user + system, so a busy host's waits do not count) that a fresh
process of the environment's Python spends on each kind's imports, taken by that process itself, once, with
``-X importtime`` naming the heaviest top-level packages (their wall time). The test process is measured in the stage
itself: its CPU from start to the end of collection (``ci_collected``). A spawned process is counted by what spawned
it (a ``vllm`` server's are its workers, a CLI's are its ranks, a test's are taken as CLI ranks: torch and diffusers);
a process of no known kind counts as a bare interpreter, so the total is a lower bound where kinds are unknown.
Processes that drop ``PYTHONPATH`` from their environment are not seen.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

KINDS = {  # name: (code run in a fresh process, extra environment)
    "interpreter": ("pass", {}),
    "CLI rank": ("import torch\nimport vllm_diffusion_plugin.doors.cli\nfrom diffusers import WanTransformer3DModel",
                 {}),
    "vLLM worker": ("import vllm\ntry:\n    import vllm_omni\nexcept ImportError:\n    pass",
                    {"VLLM_TARGET_DEVICE": "cpu", "VLLM_DIFFUSION_OMNI_CPU": "1"}),
}
PLUGIN = "plugin register()"  # after "vLLM worker"'s imports, in its process: what our plugin's register() imports
# that ``import vllm`` (and vllm_omni) had not -- a vLLM worker imports much of it later anyway (its model loader)
_PLUGIN_CODE = "import vllm_diffusion_plugin\nvllm_diffusion_plugin.register()"

_MARK = "CI-IMPORTS-MARK"
_CHILD = f"""
import os, time
_start = time.process_time()
os.write(2, b"{_MARK}\\n")
{{code}}
_done = time.process_time()
os.write(2, b"{_MARK}\\n")
{{after}}
import json
print("RESULT " + json.dumps([_start, _done - _start, time.process_time() - _done]))
"""
_IMPORTTIME = re.compile(r"^import time:\s+\d+ \|\s+(\d+) \| (\S.*)$")  # top-level: no indent before the name


def heaviest(importtime: str, count: int = 3) -> list[tuple[str, float]]:
    """The top-level packages with the most cumulative import wall time in a part of ``-X importtime`` output."""
    total: Counter[str] = Counter()
    for line in importtime.splitlines():
        if found := _IMPORTTIME.match(line):
            total[found.group(2).split(".")[0]] += int(found.group(1)) / 1e6
    return [(name, round(seconds, 2)) for name, seconds in total.most_common(count)]


def measure_one(code: str, env: dict[str, str], after: str = "") -> tuple[dict, dict]:
    """CPU-seconds of a fresh process: its start, ``code``'s imports, then ``after``'s, each with its heaviest."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", _CHILD.format(code=code, after=after)],
                          env={**os.environ, **env}, capture_output=True, text=True, check=False, timeout=600)
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    parts = done.stderr.split(_MARK)
    if done.returncode or not result or len(parts) != 3:
        error = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": error[:200]}, {"error": error[:200]}
    start, imports, after_s = json.loads(result[0].removeprefix("RESULT "))
    return ({"start": round(start, 2), "imports": round(imports, 2), "heaviest": heaviest(parts[1])},
            {"imports": round(after_s, 2), "heaviest": heaviest(parts[2])})


def measure(out: Path) -> None:
    found = {}
    for name, (code, env) in KINDS.items():
        if name == "vLLM worker":
            found[name], found[PLUGIN] = measure_one(code, {**env, "VLLM_DIFFUSION_PLUGIN": "1"}, _PLUGIN_CODE)
        else:
            found[name], _ = measure_one(code, env)
    out.write_text(json.dumps(found, indent=1))
    print("imports, CPU-s in a fresh process of this environment (start: the interpreter's own):")
    for name, figures in found.items():
        if "error" in figures:
            print(f"  {name:<18} not measured: {figures['error']}")
            continue
        heavy = ", ".join(f"{package} {seconds}" for package, seconds in figures["heaviest"])
        start = f"start {figures['start']:.2f}; " if "start" in figures else ""
        print(f"  {name:<18} {figures['imports']:6.2f}  ({start}heaviest, wall s: {heavy or '-'})")


SPAWNED_BY = {"pytest": "spawned by a test", "CLI": "CLI rank", "vllm": "vLLM worker"}


def kind_of(argv: str) -> str:
    if re.search(r"(-m pytest|/pytest)( |$)", argv):
        return "pytest"
    if re.search(r"(/vllm-diffusion|-m vllm_diffusion_plugin\.doors\.cli)( |$)", argv):
        return "CLI"
    if re.search(r"/vllm( |$)", argv):
        return "vllm"
    if "multiprocessing.spawn" in argv or "multiprocessing.forkserver" in argv:
        return "spawned"
    return "other"


def report(costs_path: Path, log: Path) -> None:
    costs = json.loads(costs_path.read_text()) if costs_path.is_file() else {}
    cost = {name: figures.get("imports", 0.0) + figures.get("start", 0.0) for name, figures in costs.items()}
    starts, collected = {}, []
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        fields = line.split("\t")
        if fields[0] == "start" and len(fields) == 4:
            starts[fields[1]] = (fields[2], kind_of(fields[3]))
        elif fields[0] == "collected" and len(fields) == 4:
            collected.append(float(fields[2]))
    if not starts:
        print("imports: no process recorded (CI_PROC_LOG)")
        return

    def role(pid: str) -> str:
        """A spawned process's role is its nearest ancestor's that is not itself spawned."""
        parent, kind = starts[pid]
        seen = {pid}
        while kind == "spawned" and parent in starts and parent not in seen:
            seen.add(parent)
            parent, ancestor = starts[parent]
            if ancestor != "spawned":
                return SPAWNED_BY.get(ancestor, "spawned")
        return kind

    roles = Counter(role(pid) for pid in starts)
    worker = cost.get("vLLM worker", 0.0) + cost.get(PLUGIN, 0.0)
    each = {"CLI": cost.get("CLI rank", 0.0), "CLI rank": cost.get("CLI rank", 0.0),
            "spawned by a test": cost.get("CLI rank", 0.0), "vllm": worker, "vLLM worker": worker,
            "spawned": cost.get("interpreter", 0.0), "other": cost.get("interpreter", 0.0)}
    total = sum(collected) + sum(n * each.get(kind, 0.0) for kind, n in roles.items() if kind != "pytest")
    counts = ", ".join(f"{n} {kind}" for kind, n in roles.most_common())
    print(f"imports: {len(starts)} Python processes started: {counts}")
    if collected:
        print(f"imports: pytest processes, CPU-s from start to collected: {' + '.join(f'{c:.1f}' for c in collected)}")
    if costs:
        print(f"imports: ~{total:.0f} CPU-s in imports in this stage (each process at its kind's figure above; "
              f"a process of unknown kind at a bare interpreter's)")


def main(argv: list[str]) -> int:
    if argv[:1] == ["measure"] and len(argv) == 2:
        measure(Path(argv[1]))
    elif argv[:1] == ["report"] and len(argv) == 3:
        report(Path(argv[1]), Path(argv[2]))
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
