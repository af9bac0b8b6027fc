"""vllm-omni's own loader tests as a regression gate for this plugin's vllm-omni patches.

    python -m vllm_diffusion_plugin.doors.omni.regression /path/to/vllm-omni [--tests FILE ...] [--json]

Runs the named test files of a vllm-omni checkout (default: its ``DiffusersPipelineLoader`` and LoRA loader
unit tests) twice with this interpreter, each in its own pytest process with a junit XML: once with the
plugin disabled (``VLLM_DIFFUSION_PLUGIN=0``), once enabled (``=1``). The checkout provides the tests; the
vllm-omni that is tested is whichever this interpreter imports (the installed one, or the checkout itself
when it is installed editable); the report names it. Each run loads the general plugins as a vllm-omni
diffusion worker does (:mod:`.regression_probe`), so the enabled run has our patches armed before the
tests import vllm-omni's loader, and records each patch unit's state: a run in which the plugin was not
active (enabled) or was active (disabled) is an error, not a pass.

Every test whose outcome differs between the runs is printed. A difference is *expected* when a patch unit
declares it: a module-level ``EXPECTED_UPSTREAM_TEST_DIFFERENCES = {"<test id pattern>": "<why>"}`` (fnmatch
pattern over pytest node ids such as ``tests/diffusion/lora/test_loader.py::test_x``) in the unit whose
docstring explains the deliberate behaviour; the value may be ``("<why>", "<failure message pattern>")``, so
that the test failing for any other reason is still unexpected. Exit status: 0 no unexpected difference, 1 unexpected
differences, 2 the comparison could not be made (missing files, a run without a junit report, the plugin not
active when it should be).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import importlib
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from vllm_diffusion_plugin.doors import omni
from vllm_diffusion_plugin.doors.omni.regression_probe import PROBE_ENV

DEFAULT_TESTS = (
    "tests/diffusion/model_loader/test_diffusers_loader.py",
    "tests/diffusion/lora/test_loader.py",
)
DECLARATION = "EXPECTED_UPSTREAM_TEST_DIFFERENCES"
RUNS = ("disabled", "enabled")
APPLIED = ("applied", "already applied")


@dataclasses.dataclass(frozen=True)
class Declaration:
    """An expected difference: the patch unit that declares it, the test id pattern, why, and optionally a
    pattern the test's failure message must match (so the test failing for another reason is still caught)."""

    unit: str
    pattern: str
    why: str
    message: str | None = None

    def matches(self, test_id: str, message: str) -> bool:
        return fnmatch.fnmatchcase(test_id, self.pattern) and (
            self.message is None or fnmatch.fnmatchcase(message, self.message))


@dataclasses.dataclass
class Run:
    """One pytest run: each test's outcome (``passed``/``failed``/``error``/``skipped``/``xfailed``) and its
    failure message, pytest's exit status, and what the probe recorded (None: no record)."""

    name: str
    exit_code: int
    outcomes: dict[str, str]
    messages: dict[str, str]
    probe: dict | None

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for outcome in self.outcomes.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        return dict(sorted(counts.items()))


@dataclasses.dataclass
class Report:
    runs: dict[str, Run]
    differences: list[dict]
    problems: list[str]
    declared_not_seen: list[Declaration]

    @property
    def exit_code(self) -> int:
        if self.problems:
            return 2
        return 1 if any(not d["expected"] for d in self.differences) else 0

    def to_dict(self) -> dict:
        enabled = self.runs.get("enabled")
        probe = (enabled.probe if enabled else None) or {}
        return {
            "vllm_omni": {"version": probe.get("vllm_omni_version"), "file": probe.get("vllm_omni_file")},
            "runs": {name: {"pytest_exit_code": run.exit_code, "counts": run.counts(),
                            "patch_status": (run.probe or {}).get("patch_status")}
                     for name, run in self.runs.items()},
            "differences": self.differences,
            "declared_not_seen": [dataclasses.asdict(d) for d in self.declared_not_seen],
            "problems": self.problems,
            "exit_code": self.exit_code,
        }


def declared_differences() -> list[Declaration]:
    """Every ``EXPECTED_UPSTREAM_TEST_DIFFERENCES`` entry of the vllm-omni patch units (imports no vllm-omni).
    An entry's value is the reason, or ``(reason, failure message pattern)``."""
    found = []
    for name in omni.PATCH_UNITS:
        unit = importlib.import_module(f"{omni.__name__}.{name}")
        for pattern, value in getattr(unit, DECLARATION, {}).items():
            why, message = (value, None) if isinstance(value, str) else value
            found.append(Declaration(unit=name, pattern=pattern, why=why, message=message))
    return found


def run_pytest(checkout: Path, tests: list[str], *, enabled: bool, workdir: Path,
               pytest_args: list[str] = (), timeout: float | None = None) -> Run:
    """One pytest process over ``tests`` with the checkout as rootdir and working folder."""
    name = RUNS[int(enabled)]
    junit, probe, log = (workdir / f"{kind}-{name}.{ext}" for kind, ext in
                         (("junit", "xml"), ("probe", "json"), ("pytest", "log")))
    for stale in (junit, probe):  # a report left by an earlier run in the same --out must never be read as this one's
        stale.unlink(missing_ok=True)
    env = dict(os.environ, VLLM_DIFFUSION_PLUGIN="1" if enabled else "0", **{PROBE_ENV: str(probe)})
    command = [sys.executable, "-m", "pytest", *tests, "--rootdir", str(checkout), "-q", "-p", "no:cacheprovider",
               "-p", "vllm_diffusion_plugin.doors.omni.regression_probe", "-o", "junit_family=xunit1",
               f"--junitxml={junit}", *pytest_args]
    with open(log, "w") as output:
        try:
            exit_code = subprocess.run(command, cwd=checkout, env=env, timeout=timeout, stdout=output,
                                       stderr=subprocess.STDOUT).returncode
        except subprocess.TimeoutExpired:
            exit_code = -1
    outcomes, messages = parse_junit(junit) if junit.exists() else ({}, {})
    record = json.loads(probe.read_text()) if probe.exists() else None
    return Run(name=name, exit_code=exit_code, outcomes=outcomes, messages=messages, probe=record)


def parse_junit(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Outcome and failure message per pytest node id from a junit XML written with ``junit_family=xunit1``."""
    outcomes: dict[str, str] = {}
    messages: dict[str, str] = {}
    rank = {"passed": 0, "skipped": 1, "xfailed": 1, "error": 2, "failed": 3}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = node_id(case.get("file"), case.get("classname", ""), case.get("name", ""))
        outcome, message = "passed", ""
        for child in case:
            kind = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if kind is None:
                continue
            if kind == "skipped" and child.get("type") == "pytest.xfail":
                kind = "xfailed"
            if rank[kind] >= rank[outcome]:
                outcome, message = kind, (child.get("message") or child.text or "").strip()
        if test_id not in outcomes or rank[outcome] >= rank[outcomes[test_id]]:
            outcomes[test_id], messages[test_id] = outcome, message
    return outcomes, messages


def node_id(file: str | None, classname: str, name: str) -> str:
    """``tests/x/test_a.py::TestB::test_c[p]`` from junit's file, dotted class name and test name."""
    if not file:
        return f"{classname}::{name}" if classname else name
    module = file[:-3].replace("/", ".").replace("\\", ".") if file.endswith(".py") else file
    inner = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
    return "::".join([file, *filter(None, inner.split(".")), name])


def check_activation(run: Run) -> list[str]:
    """Why ``run`` does not show the plugin in the state its name says (empty: it does)."""
    if run.probe is None:
        return [f"{run.name} run: the probe wrote no record (pytest exit {run.exit_code}); the plugin's state "
                f"in that process is unknown"]
    status = run.probe.get("patch_status") or {}
    load_error = run.probe.get("plugin_load_error")
    if run.name == "disabled":
        return [f"disabled run: the plugin was active with VLLM_DIFFUSION_PLUGIN=0 (patch status {status})"] \
            if status else []
    problems = [f"enabled run: unit `{unit}` is {state}" for unit, state in status.items()
                if state.startswith(("skipped", "failed"))]
    if not any(state in APPLIED for state in status.values()):
        problems.append(f"enabled run: no vllm-omni patch was applied (patch status {status or 'empty'}"
                        f"{', plugin loading failed: ' + load_error if load_error else ''}); an empty "
                        f"comparison would mean nothing")
    return problems


def compare(runs: dict[str, Run], declarations: list[Declaration]) -> Report:
    """The differences between the disabled and enabled runs, each matched against the declarations."""
    problems = [problem for run in runs.values() for problem in check_activation(run)]
    problems += [f"{run.name} run: no junit report (pytest exit {run.exit_code})"
                 for run in runs.values() if not run.outcomes]
    problems += [f"{run.name} run: pytest exceeded --timeout and was stopped; its outcomes are incomplete"
                 for run in runs.values() if run.exit_code == -1]
    off, on = runs["disabled"], runs["enabled"]
    differences, seen = [], set()
    for test_id in sorted(set(off.outcomes) | set(on.outcomes)):
        before, after = off.outcomes.get(test_id, "absent"), on.outcomes.get(test_id, "absent")
        if before == after:
            continue
        message = on.messages.get(test_id) or off.messages.get(test_id) or ""
        matches = [d for d in declarations if d.matches(test_id, message)]
        seen.update(matches)
        differences.append({
            "test": test_id, "disabled": before, "enabled": after, "expected": bool(matches),
            "unit": matches[0].unit if matches else None, "why": matches[0].why if matches else None,
            "message": message,
        })
    return Report(runs=runs, differences=differences, problems=problems,
                  declared_not_seen=[d for d in declarations if d not in seen])


def render_table(report: Report) -> str:
    data = report.to_dict()
    lines = [f"vllm-omni {data['vllm_omni']['version']} ({data['vllm_omni']['file']})"]
    for name, run in data["runs"].items():
        counts = ", ".join(f"{n} {outcome}" for outcome, n in run["counts"].items()) or "no results"
        status = run["patch_status"]
        patches = ", ".join(f"{u}={s}" for u, s in status.items()) if status else "none active"
        lines.append(f"plugin {name:<8}: {counts} (pytest exit {run['pytest_exit_code']}); patches: {patches}")
    if report.differences:
        width = max(len(d["test"]) for d in report.differences)
        lines.append(f"\n{'test':<{width}}  {'disabled':<8}  {'enabled':<8}  verdict")
        for d in report.differences:
            verdict = (f"expected ({d['unit']}): {d['why']}" if d["expected"]
                       else f"UNEXPECTED: {d['message'].splitlines()[0] if d['message'] else ''}")
            lines.append(f"{d['test']:<{width}}  {d['disabled']:<8}  {d['enabled']:<8}  {verdict}")
    lines.extend(f"declared, not seen here ({d.unit}): {d.pattern}" for d in report.declared_not_seen)
    lines.extend(f"PROBLEM: {problem}" for problem in report.problems)
    unexpected = sum(not d["expected"] for d in report.differences)
    lines.append({0: f"\nsame outcomes with and without the plugin ({len(report.differences)} expected "
                     f"difference(s)).",
                  1: f"\n{unexpected} unexpected difference(s).",
                  2: "\nno comparison: see PROBLEM above."}[report.exit_code])
    return "\n".join(lines)


def run_regression(checkout: str | os.PathLike, tests: list[str] | None = None, *, pytest_args: list[str] = (),
                   timeout: float | None = None, workdir: str | os.PathLike | None = None) -> Report:
    """Both runs over ``tests`` (default :data:`DEFAULT_TESTS`) of ``checkout``, compared. Raises
    ``FileNotFoundError`` naming the missing paths before anything runs."""
    root = Path(checkout).resolve()
    tests = list(tests or DEFAULT_TESTS)
    missing = [t for t in tests if not (root / t).exists()]
    if missing:
        raise FileNotFoundError(f"{root} has no {', '.join(missing)} (pass the vllm-omni checkout's root folder, "
                                f"or --tests with paths relative to it)")
    with tempfile.TemporaryDirectory(prefix="omni-regression-") as tmp:
        out = Path(workdir) if workdir else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        runs = {name: run_pytest(root, tests, enabled=name == "enabled", workdir=out, pytest_args=pytest_args,
                                 timeout=timeout) for name in RUNS}
    return compare(runs, declared_differences())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_diffusion_plugin.doors.omni.regression",
        description="Run a vllm-omni checkout's loader tests with this plugin disabled and enabled; print the "
                    "tests whose outcome differs. Exit 0: none unexpected; 1: unexpected differences; 2: no "
                    "comparison possible.")
    parser.add_argument("checkout", help="root folder of a vllm-omni checkout (its tests/ are run)")
    parser.add_argument("--tests", nargs="+", metavar="FILE", help="test files relative to the checkout "
                        f"(default: {' '.join(DEFAULT_TESTS)})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--out", metavar="DIR", help="keep the junit XMLs, pytest logs and probe records in DIR")
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="limit for each pytest run")
    parser.add_argument("--pytest-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for both pytest runs (repeatable), e.g. --pytest-arg=-x")
    args = parser.parse_args(argv)
    try:
        report = run_regression(args.checkout, args.tests, pytest_args=args.pytest_arg, timeout=args.timeout,
                                workdir=args.out)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=1) if args.json else render_table(report))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
