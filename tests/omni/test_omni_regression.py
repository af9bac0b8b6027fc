"""The regression gate (``doors/omni/regression.py``) on a tiny synthetic vllm-omni "checkout": real pytest
processes over the installed vllm-omni, disabled and enabled, with tests whose outcome our patches change."""

from __future__ import annotations

import textwrap

import pytest
from omni_support import import_omni

from vllm_diffusion_plugin.doors.omni import patch_lora_device
from vllm_diffusion_plugin.doors.omni import regression as omni_regression
from vllm_diffusion_plugin.doors.omni.regression import Run, compare, render_table, run_regression

import_omni()  # skips this module where vllm-omni is not installed

SYNTHETIC = '''
import pytest
import vllm_omni.diffusion.lora.loader as lora_loader


def test_unchanged():
    assert callable(lora_loader._prepare_lora_delta)


def test_changed_on_purpose():
    assert not hasattr(lora_loader._prepare_lora_delta, "__wrapped__"), "delta function patched"


def test_changed_by_accident():
    assert not hasattr(lora_loader._resolve_lora_compute_device, "__wrapped__"), "resolver patched"


@pytest.mark.parametrize("case", ["a"])
def test_skipped(case):
    pytest.skip("skipped both ways")
'''
ON_PURPOSE = "tests/test_synthetic.py::test_changed_on_purpose"
BY_ACCIDENT = "tests/test_synthetic.py::test_changed_by_accident"


@pytest.fixture(scope="module")
def synthetic_report(tmp_path_factory):
    """One gate run (two pytest processes) over the synthetic checkout, with the on-purpose change declared by
    the unit that makes it (``patch_lora_device`` wraps ``_prepare_lora_delta``)."""
    checkout = tmp_path_factory.mktemp("checkout")
    (checkout / "tests").mkdir()
    (checkout / "tests" / "__init__.py").write_text("")
    (checkout / "tests" / "test_synthetic.py").write_text(textwrap.dedent(SYNTHETIC))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(patch_lora_device, omni_regression.DECLARATION,
                   {"*::test_changed_on_purpose": ("wrapped for the CPU fallback", "*delta function patched*")},
                   raising=False)
        report = run_regression(checkout, ["tests/test_synthetic.py"], workdir=checkout / "out", timeout=900)
    return report


def test_gate_reports_declared_and_undeclared_differences_and_fails_on_the_undeclared(synthetic_report):
    report = synthetic_report
    assert report.problems == []
    assert report.runs["disabled"].probe["patch_status"] == {}  # disabled: register() returned at once
    assert report.runs["enabled"].probe["patch_status"]["lora-device"] == "applied"
    assert report.runs["disabled"].outcomes == {
        "tests/test_synthetic.py::test_unchanged": "passed", ON_PURPOSE: "passed", BY_ACCIDENT: "passed",
        "tests/test_synthetic.py::test_skipped[a]": "skipped"}
    assert [(d["test"], d["disabled"], d["enabled"], d["expected"], d["unit"]) for d in report.differences] == [
        (BY_ACCIDENT, "passed", "failed", False, None),
        (ON_PURPOSE, "passed", "failed", True, "patch_lora_device")]
    assert report.exit_code == 1
    table = render_table(report)
    rows = {line.split()[0]: line.split(None, 3)[1:] for line in table.splitlines() if line.startswith("tests/")}
    assert rows == {ON_PURPOSE: ["passed", "failed", "expected (patch_lora_device): wrapped for the CPU fallback"],
                    BY_ACCIDENT: ["passed", "failed", "UNEXPECTED: AssertionError: resolver patched"]}
    assert table.rstrip().endswith("1 unexpected difference(s).")
    assert report.to_dict()["exit_code"] == 1


def test_gate_passes_when_every_difference_is_declared_with_its_failure(synthetic_report):
    from vllm_diffusion_plugin.doors.omni.regression import Declaration

    declared = [Declaration("patch_lora_device", "*::test_changed_*", "both wrapped", "*patched*")]
    report = compare(synthetic_report.runs, declared)
    assert report.exit_code == 0 and all(d["expected"] for d in report.differences)
    assert "same outcomes with and without the plugin (2 expected difference(s))." in render_table(report)
    # a declared test failing for another reason than the declared one is still unexpected
    wrong_reason = [Declaration("patch_lora_device", ON_PURPOSE, "wrapped", "*some other failure*")]
    assert compare(synthetic_report.runs, wrong_reason).exit_code == 1


def test_gate_refuses_a_comparison_where_the_plugin_was_not_active(synthetic_report):
    runs = dict(synthetic_report.runs)
    inactive = runs["disabled"]
    runs["enabled"] = Run("enabled", inactive.exit_code, inactive.outcomes, inactive.messages, inactive.probe)
    report = compare(runs, [])
    assert report.differences == [] and report.exit_code == 2
    assert "enabled run: no vllm-omni patch was applied" in report.problems[0]
    runs["enabled"] = Run("enabled", 1, inactive.outcomes, inactive.messages, None)
    assert "the probe wrote no record" in compare(runs, []).problems[0]


def test_gate_names_missing_test_files_before_running_anything(tmp_path, capsys):
    assert omni_regression.main([str(tmp_path)]) == 2
    assert f"{tmp_path} has no tests/diffusion/model_loader/test_diffusers_loader.py" in capsys.readouterr().err


def test_declared_differences_come_from_the_patch_units_and_name_real_tests():
    declared = omni_regression.declared_differences()
    assert [(d.unit, d.pattern) for d in declared] == [
        ("patch_postprocess", "*test_diffusers_loader.py::test_process_weights_skips_completed_online_quant_layer")]
    assert declared[0].matches(
        "tests/diffusion/model_loader/test_diffusers_loader.py::test_process_weights_skips_completed_online_quant_layer",
        "AssertionError: expected call not found.\nExpected: mock(M, model_config=None)\n"
        "  Actual: mock(M, OmniModelConfigView(dtype=torch.float32))")
    assert not declared[0].matches(
        "tests/diffusion/model_loader/test_diffusers_loader.py::test_process_weights_skips_completed_online_quant_layer",
        "AssertionError: Expected 'mock' to be called once. Called 0 times.")  # finalize skipped: a bug, not ours
