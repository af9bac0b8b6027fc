"""Every command in README.md and docs/ parses as written (see ``docs_commands``): no stale flag can ship; every
image they show (the charts of ``docs/charts``) exists.

The ``vllm serve ... --omni`` commands need vllm-omni's parser: ``tests/omni/test_docs_serve_commands.py``.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from docs_commands import (
    PAGES, ROOT, Command, all_commands, commands, commands_in_block, extras, parse_only, requested_extras, script_main,
    serve_errors)

COMMANDS = all_commands()
_PYTEST_VALUE_FLAGS = {"-m", "-k", "-p", "-W", "--junitxml", "--rootdir"}


def serving(command: Command) -> bool:
    return command.program == "vllm" and "--omni" not in command.argv  # --omni: tests/omni/test_docs_serve_commands


def check(command: Command, serve: dict[str, str | None] | None = None) -> None:
    """Raise naming ``command.where`` when the command would not parse or names a missing file or extra
    (``serve``: :func:`docs_commands.serve_errors` of the ``vllm serve`` commands)."""
    argv, where = command.argv, command.where
    program = command.program
    if program == "vllm-diffusion":
        from vllm_diffusion_plugin.doors import cli

        parse_only(cli.main, argv[1:], where)
    elif program.startswith("python"):
        check_python(argv, where)
    elif program == "pip":
        check_pip(argv, where)
    elif program == "vllm":
        if serving(command):
            error = (serve if serve is not None else serve_errors([command], omni=False))[where]
            assert error is None, f"{where}: {error}"
    elif program == "curl":
        return  # a request to the server started above
    elif argv[0].startswith(".ci/"):
        assert (ROOT / argv[0]).is_file(), f"{where}: {argv[0]} does not exist"
    else:
        raise AssertionError(f"{where}: no check knows {argv[0]!r}: teach tests/test_docs_commands.py, or put the "
                             f"block in a ```text fence if it is not a command to paste")


def check_python(argv: list[str], where: str) -> None:
    if argv[1] == "-c" or argv[1:3] == ["-m", "venv"]:
        return
    if argv[1] == "-m" and argv[2] == "pytest":
        args = argv[3:]
        paths = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] not in
                                                                             _PYTEST_VALUE_FLAGS)]
        missing = [p for p in paths if not (ROOT / p.split("::")[0]).exists()]
        assert not missing, f"{where}: pytest paths {missing} do not exist"
    elif argv[1] == "-m" and argv[2] == "pip":
        check_pip(argv[2:], where)
    elif argv[1] == "-m":
        parse_only(importlib.import_module(argv[2]).main, argv[3:], where)
    else:
        assert (ROOT / argv[1]).is_file(), f"{where}: {argv[1]} does not exist"
        parse_only(script_main(ROOT / argv[1]), argv[2:], where)


def check_pip(argv: list[str], where: str) -> None:
    known = extras()
    for word in argv[2:]:
        unknown = [e for e in requested_extras(word) if e not in known]
        assert not unknown, f"{where}: extras {unknown} are not in pyproject.toml (it has {sorted(known)})"


def test_the_pages_have_commands():
    assert len(COMMANDS) >= 10 and {c.program for c in COMMANDS} >= {"vllm-diffusion", "vllm", "pip"}, COMMANDS


@pytest.fixture(scope="module")
def serve():
    return serve_errors([c for c in COMMANDS if serving(c)], omni=False)


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where} {c.program}" for c in COMMANDS])
def test_each_command_parses(command, serve):
    check(command, serve)


@pytest.mark.parametrize("stale", [
    "vllm-diffusion load /models/x --lora-path a.safetensors",
    'pip install -e ".[omni33,test]"',
    "python benchmarks/bench_load.py --no-such-flag",
    "python -m vllm_diffusion_plugin.doors.omni.regression",
    "vllm serve /models/x --load-format diffusion-hsdp --model-loader-extra-config '{\"lora_pathz\": []}'",
    "torchrun vllm-diffusion load /models/x",
])
def test_a_stale_command_fails_the_check(tmp_path, stale):
    with pytest.raises(AssertionError):
        for command in commands_in_block(stale, tmp_path):
            check(command)


def test_json_arguments_on_several_lines_and_continuations_are_one_command(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nA=1 vllm serve M \\\n    --additional-config '{\"diffusion_hsdp\":\n"
                    "      {\"lora_path\": []}}'  # comment\necho x && pip install -e .\n```\n\n```text\nnot: a command\n```\n")
    found = list(commands(page))
    assert [(c.env, c.argv) for c in found] == [
        ({"A": "1"}, ["vllm", "serve", "M", "--additional-config", '{"diffusion_hsdp":\n      {"lora_path": []}}']),
        ({}, ["echo", "x"]), ({}, ["pip", "install", "-e", "."])]


_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def images(page: Path) -> list[str]:
    """The targets of the markdown images ``page`` shows (``![alt](path)``)."""
    return _IMAGE.findall(page.read_text())


def missing_images(page: Path) -> list[str]:
    """The images ``page`` shows that are not files (paths relative to the page; web addresses not checked)."""
    return [target for target in images(page) if "://" not in target and not (page.parent / target).is_file()]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_image_a_page_shows_exists(page):
    assert not missing_images(page), f"{page.relative_to(ROOT)} shows missing images: {missing_images(page)}"


def test_a_missing_image_fails_the_check(tmp_path):
    (tmp_path / "charts").mkdir()
    (tmp_path / "charts" / "here.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text("![a chart](charts/here.png)\n\ntext ![gone](charts/gone.png) [a link](charts/x.png)\n")
    assert missing_images(page) == ["charts/gone.png"]


def test_the_readme_and_the_figure_pages_show_charts():
    shown = {page.name: [t for t in images(page) if "charts/" in t] for page in PAGES}
    assert shown["README.md"] and shown["performance.md"] and shown["plan-and-memory.md"], shown
