"""Every command in README.md and docs/ parses as written (see ``docs_commands``): no stale flag can ship; every
image they show (the charts of ``docs/charts``) exists.

The ``vllm serve ... --omni`` commands need vllm-omni's parser: ``tests/omni/test_docs_serve_commands.py``.

The blocks marked for CI (``<!-- ci: install|test ENV -->``) are the ones ``.ci/run`` runs as written: each of its
environments has both, each builds or tests only its own environment, and README's install, demo and tests follow one
another in one environment, as a newcomer pastes them.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from docs_commands import (
    CI_KINDS, PAGES, ROOT, Command, MarkedBlock, all_commands, bash_blocks, block_commands, commands, commands_in_block,
    extras, marked_blocks, parse_only, requested_extras, script_main, serve_errors)

COMMANDS = all_commands()
MARKED = marked_blocks()
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


def ci_environments() -> set[str]:
    """The environments ``.ci/run`` names (``.venv``, ``.venv-omni``, ...)."""
    return set(re.findall(r"(?<![\w.-])\.venv[\w-]*", (ROOT / ".ci" / "run").read_text()))


def marked_block_errors(block: MarkedBlock) -> list[str]:
    """What is wrong with a block marked for CI: an install block makes ``ENV`` with ``python3 -m venv ENV`` and then
    runs only ``ENV/bin/pip install ...``; a test block is one ``ENV/bin/python -m pytest ...`` command."""
    found, env = block.commands(), block.env
    if block.kind == "install":
        errors = [] if found and found[0].argv == ["python3", "-m", "venv", env] else [
            f"{block.where}: an install block starts with `python3 -m venv {env}`"]
        errors += [f"{c.where}: {' '.join(c.argv)}: only `{env}/bin/pip install ...` after the venv"
                   for c in found[1:] if c.argv[:2] != [f"{env}/bin/pip", "install"] or c.env]
        return errors + ([] if len(found) > 1 else [f"{block.where}: an install block installs"])
    if len(found) != 1 or found[0].argv[:3] != [f"{env}/bin/python", "-m", "pytest"]:
        return [f"{block.where}: a test block is one `{env}/bin/python -m pytest ...` command"]
    return []


def test_ci_has_an_install_and_a_test_block_for_each_of_its_environments():
    envs = ci_environments()
    assert envs >= {".venv", ".venv-omni"}, envs
    missing = [f"<!-- ci: {kind} {env} -->" for env in sorted(envs) for kind in CI_KINDS if (kind, env) not in MARKED]
    assert not missing, f"no block marked {missing} in README.md or docs/"
    assert {env for _, env in MARKED} <= envs, f"blocks marked for environments .ci/run does not build: {MARKED}"


@pytest.mark.parametrize("block", MARKED.values(), ids=[f"{b.kind} {b.env}" for b in MARKED.values()])
def test_a_marked_block_builds_or_tests_its_own_environment(block):
    assert not marked_block_errors(block)


def test_the_readme_installs_runs_the_demo_and_tests_in_one_environment():
    """README's first three commands, as a newcomer pastes them one after the other in a fresh clone: the install
    block, the demo from the environment it made, the test block of that environment."""
    readme = ROOT / "README.md"
    install, demo, test = [list(block_commands(lines, readme.name, start)) for start, lines in bash_blocks(readme)][:3]
    env = MARKED["install", ".venv-omni"]
    assert install == env.commands() and test == MARKED["test", ".venv-omni"].commands(), (install, test)
    assert [c.argv[0] for c in demo] == [".venv-omni/bin/vllm-diffusion"], demo


@pytest.mark.parametrize("page, error", [
    ("<!-- ci: install .venv -->\n\n```bash\npython3 -m venv .venv\n```\n", "right above"),
    ("<!-- ci: build .venv -->\n```bash\npython3 -m venv .venv\n```\n", "not one of"),
    ("<!-- ci: test .venv -->\n```bash\n.venv/bin/python -m pytest\n```\n" * 2, "a second"),
])
def test_a_misplaced_or_repeated_ci_marker_is_an_error(tmp_path, page, error):
    (tmp_path / "page.md").write_text(page)
    with pytest.raises(ValueError, match=error):
        marked_blocks((tmp_path / "page.md",))


@pytest.mark.parametrize("kind, text", [
    ("install", "python3 -m venv .venv-omni && .venv/bin/pip install -e ."),
    ("install", "python3 -m venv .venv && pip install -e ."),
    ("install", "python3 -m venv .venv"),
    ("install", ".venv/bin/pip install -e ."),
    ("test", ".venv/bin/python -m pytest && .venv/bin/python -m pytest tests/omni"),
    ("test", "python -m pytest"),
])
def test_a_marked_block_that_builds_or_tests_another_environment_fails_the_check(tmp_path, kind, text):
    (tmp_path / "page.md").write_text(f"<!-- ci: {kind} .venv -->\n```bash\n{text}\n```\n")
    assert marked_block_errors(marked_blocks((tmp_path / "page.md",))[kind, ".venv"])
