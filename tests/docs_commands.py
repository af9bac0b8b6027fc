"""The commands of README.md and docs/: every fenced ``bash`` block is one a reader may paste (illustrations go in
``text`` blocks), so each of its commands is checked against the real parser it will meet -- our CLI, a module's or
benchmark's own ``argparse``, vLLM's and vllm-omni's ``vllm serve``, pyproject's extras. Nothing is run: each
``parse_args`` stops the command right after parsing (:func:`parse_only`).

``tests/test_docs_commands.py`` checks what the main environment has; ``tests/omni/test_docs_serve_commands.py``
the ``vllm serve ... --omni`` commands against vllm-omni's parser.

A block marked ``<!-- ci: install ENV -->`` or ``<!-- ci: test ENV -->`` on the line before its fence is one ``.ci/run``
runs as it is written (:func:`marked_blocks`): how CI builds the environment ``ENV`` and tests in it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import os
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*ci:\s*(\S+)\s+(\S+)\s*-->\s*$")
CI_KINDS = ("install", "test")
"""What a marked block is to ``.ci/run``: the commands that build an environment, the command that tests in it."""
_SEPARATORS = {"&&", "||", ";", "|"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Command:
    """One command of a ``bash`` block: where it is, its environment assignments and its words."""

    where: str
    env: dict[str, str]
    argv: list[str]

    @property
    def program(self) -> str:
        return Path(self.argv[0]).name


def bash_blocks(page: Path) -> Iterator[tuple[int, list[str]]]:
    """``(first line number, lines)`` of each fenced ``bash`` block of ``page``."""
    block, start, lang = None, 0, ""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = _FENCE.match(line)
        if fence and block is None:
            block, start, lang = [], number + 1, fence.group(1)
        elif fence:
            if lang == "bash":
                yield start, block
            block = None
        elif block is not None:
            block.append(line)


@dataclass(frozen=True)
class MarkedBlock:
    """A ``bash`` block marked for CI: ``<!-- ci: KIND ENV -->`` on the line before its fence."""

    kind: str
    env: str
    where: str
    text: str

    def commands(self) -> list[Command]:
        page, _, line = self.where.rpartition(":")
        return list(block_commands(self.text.splitlines(), page, int(line) + 2))


def marked_blocks(pages: tuple[Path, ...] = PAGES) -> dict[tuple[str, str], MarkedBlock]:
    """``{(kind, env): block}`` of the blocks of ``pages`` marked for CI. A marker not right above a ``bash`` fence,
    of an unknown kind, or given twice for the same ``(kind, env)``, is an error naming where it is."""
    found: dict[tuple[str, str], MarkedBlock] = {}
    for page in pages:
        name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
        marks = {number: mark.groups() for number, line in enumerate(page.read_text().splitlines(), 1)
                 if (mark := _MARK.match(line))}
        for start, lines in bash_blocks(page):
            if (mark := marks.pop(start - 2, None)) is None:
                continue
            kind, env = mark
            where = f"{name}:{start - 2}"
            if kind not in CI_KINDS:
                raise ValueError(f"{where}: ci marker kind {kind!r} is not one of {CI_KINDS}")
            if (kind, env) in found:
                raise ValueError(f"{where}: a second 'ci: {kind} {env}' block (the first: {found[kind, env].where})")
            found[kind, env] = MarkedBlock(kind, env, where, "\n".join(lines))
        if marks:
            raise ValueError(f"{name}:{min(marks)}: a ci marker must be the line right above a ```bash fence")
    return found


def logical_lines(lines: list[str]) -> Iterator[tuple[int, str]]:
    """Lines joined across trailing backslashes and across quotes left open (a JSON argument on several lines)."""
    pending, first = "", 0
    for offset, line in enumerate(lines):
        if not pending:
            first = offset
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote still open
            continue
        yield first, pending
        pending = ""
    if pending:
        raise ValueError(f"unterminated command: {pending!r}")


def commands(page: Path) -> Iterator[Command]:
    name = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    for start, lines in bash_blocks(page):
        yield from block_commands(lines, name, start)


def block_commands(lines: list[str], name: str | Path, start: int) -> Iterator[Command]:
    """The commands of a block's ``lines`` whose first line is line ``start`` of page ``name``."""
    for offset, text in logical_lines(lines):
        words: list[str] = []
        for word in [*shlex.split(text, comments=True), ";"]:
            if word not in _SEPARATORS:
                words.append(word)
                continue
            env = {}
            while words and _ASSIGNMENT.match(words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            if words and words[0] != "export":
                yield Command(f"{name}:{start + offset}", env, words)
            words = []


def commands_in_block(text: str, folder: Path) -> list[Command]:
    """The commands of a page (written into ``folder``) holding ``text`` as its one ``bash`` block."""
    page = folder / "page.md"
    page.write_text(f"text\n\n```bash\n{text}\n```\n")
    return list(commands(page))


def all_commands() -> list[Command]:
    return [command for page in PAGES for command in commands(page)]


class _Parsed(Exception):
    pass


def parse_only(main: Callable[[list[str]], object], argv: list[str], where: str) -> argparse.Namespace:
    """Run ``main(argv)`` until its ``parse_args`` returns, and stop there; a parser error fails naming ``where``."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args):
        try:
            main(argv)
        except _Parsed as parsed:
            return parsed.args[0]
        except SystemExit as exc:
            raise AssertionError(f"{where}: {argv} is refused by the parser (exit {exc.code})") from None
    raise AssertionError(f"{where}: {argv} ran without parsing arguments")


def parse_subcommand(cmd_init: Callable[[], list], parser: argparse.ArgumentParser, argv: list[str], where: str):
    """``argv`` parsed by ``parser`` with the subcommands of ``cmd_init()`` (vLLM's and vllm-omni's CLI shape)."""
    subparsers = parser.add_subparsers(dest="subparser")
    for cmd in cmd_init():
        cmd.subparser_init(subparsers)
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{where}: {argv} is refused by the parser (exit {exc.code})") from None


def script_main(path: Path):
    spec = importlib.util.spec_from_file_location(f"_docs_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does: a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module.main


def extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def requested_extras(word: str) -> list[str]:
    """``[a,b]`` of a pip requirement such as ``-e ".[omni,test]"`` or ``vllm-diffusion-plugin[cli]``."""
    found = re.search(r"\[([^\]]+)\]", word)
    return [e.strip() for e in found.group(1).split(",")] if found else []


def check_json_options(argv: list[str], where: str) -> None:
    """Our keys in ``--additional-config`` (``diffusion_hsdp``) and ``--model-loader-extra-config`` are known."""
    from vllm_diffusion_plugin.doors.omni.serve_options import omni_options
    from vllm_diffusion_plugin.engine.config import LoadOptions

    for flag, check in (("--additional-config", omni_options), ("--model-loader-extra-config",
                                                                 LoadOptions.from_extra_config)):
        if flag in argv:
            value = json.loads(argv[argv.index(flag) + 1])
            try:
                check(value)
            except (ValueError, TypeError) as exc:
                raise AssertionError(f"{where}: {flag} {value}: {exc}") from None


def check_serve(argvs: list[list[str]], *, omni: bool) -> list[str | None]:
    """Each ``vllm serve ...`` argv parsed by vLLM's (``omni``: vllm-omni's) own ``serve`` subcommand parser and its
    JSON options checked: ``None`` when fine, else the error. Run in a fresh interpreter (:func:`serve_errors`)."""
    if omni:
        from vllm_omni.entrypoints.cli import serve
        from vllm_omni.utils.tracking_parser import TrackingArgumentParser as Parser
    else:
        from vllm.entrypoints.cli import serve
        from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser
    errors: list[str | None] = []
    for argv in argvs:
        try:
            parse_subcommand(serve.cmd_init, Parser(), argv[1:], " ".join(argv))
            check_json_options(argv, " ".join(argv))
            errors.append(None)
        except AssertionError as exc:
            errors.append(str(exc))
    return errors


_SERVE_CHECK = """
import json, sys
sys.path.insert(0, sys.argv[1])
from docs_commands import check_serve
print("RESULT " + json.dumps(check_serve(json.loads(sys.argv[2]), omni=sys.argv[3] == "1")))
"""


def serve_errors(commands: list[Command], *, omni: bool) -> dict[str, str | None]:
    """:func:`check_serve` for ``commands`` in a fresh interpreter on vLLM's CPU platform: building vLLM's CLI
    resolves the platform and reconfigures logging, which must not leak into the test process."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", _SERVE_CHECK, str(Path(__file__).parent),
                           json.dumps([c.argv for c in commands]), "1" if omni else "0"],
                          env=env, capture_output=True, text=True, timeout=300)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and line, done.stderr[-3000:]
    return dict(zip((c.where for c in commands), json.loads(line[0].removeprefix("RESULT "))))
