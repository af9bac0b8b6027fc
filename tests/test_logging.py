"""Our log lines reach the output whatever the host configured (``_logging``), and only ours are touched.

vLLM >= 0.31 configures logging only in processes that ask (vllm-omni 0.31rc1's API server and 0.32rc1's
multi-rank workers do not): there our INFO lines -- the load report -- used to vanish under the root logger's
WARNING. Each case runs in a fresh interpreter (logging is per process) with vLLM imported, as in a server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SETUPS = {
    "nothing": "",
    "vllm": "from vllm_diffusion_plugin import compat; compat.configure_vllm_logging()",
    "basicConfig": "import logging; logging.basicConfig(level=logging.WARNING, format='ROOT %(message)s')",
    "quiet": "import logging; logging.getLogger('vllm.vllm_diffusion_plugin').setLevel(logging.WARNING)",
}

SCRIPT = textwrap.dedent("""
    import logging, sys
    import vllm.logger
    {setup}
    before = {{n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers)) for n in (None, "vllm")}}
    from vllm_diffusion_plugin._logging import init_logger
    log = init_logger("vllm_diffusion_plugin.engine.report")
    log.debug("our debug line")
    log.info("diffusion-hsdp load report: component=transformer rank=0")
    log.warning("our warning line")
    logging.getLogger("vllm.other").info("vllm's own info line")
    after = {{n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers)) for n in (None, "vllm")}}
    print("UNTOUCHED", before == after, flush=True)
""")


def run_case(setup: str, *, level: str) -> str:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_STREAM": "ext://sys.stdout",
           "VLLM_LOGGING_LEVEL": level}
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(setup=SETUPS[setup])], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def lines_with(out: str, text: str) -> list[str]:
    return [line for line in out.splitlines() if text in line]


def test_unconfigured_host_still_prints_our_info_lines_once_in_vllms_format():
    out = run_case("nothing", level="INFO")
    (report,) = lines_with(out, "load report")
    assert report.startswith("INFO ") and "[<string>:" in report, report  # vLLM's text format
    assert len(lines_with(out, "our warning line")) == 1, out
    assert not lines_with(out, "our debug line"), out
    assert not lines_with(out, "vllm's own info line"), out  # vLLM's own loggers are left as the host left them
    assert "UNTOUCHED True" in out, out


def test_vllm_logging_level_decides_the_fallback():
    out = run_case("nothing", level="DEBUG")
    assert len(lines_with(out, "our debug line")) == 1, out
    out = run_case("nothing", level="WARNING")
    assert not lines_with(out, "load report") and len(lines_with(out, "our warning line")) == 1, out


def test_host_configured_vllm_logging_prints_through_vllms_handler_only():
    out = run_case("vllm", level="INFO")
    assert len(lines_with(out, "load report")) == 1, out  # not twice: the fallback stays silent
    assert len(lines_with(out, "vllm's own info line")) == 1, out
    out = run_case("vllm", level="WARNING")
    assert not lines_with(out, "load report") and len(lines_with(out, "our warning line")) == 1, out


@pytest.mark.parametrize("setup", ["basicConfig", "quiet"])
def test_a_level_the_host_or_the_cli_chose_is_kept(setup):
    out = run_case(setup, level="INFO")
    assert not lines_with(out, "load report"), out
    assert len(lines_with(out, "our warning line")) == 1, out
    if setup == "basicConfig":
        assert lines_with(out, "our warning line")[0].startswith("ROOT "), out  # the host's handler and format
