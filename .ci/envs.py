"""What ``.ci/run`` reads from the pages and how it names a cached environment.

    python3 .ci/envs.py block install|test ENV      the text of the block marked ``<!-- ci: KIND ENV -->``
    python3 .ci/envs.py argv ENV                    the test block's one command, its words NUL-separated
                                                    (``env NAME=VALUE ...`` first when it sets variables)
    python3 .ci/envs.py key ENV --python PY --out F the cache key of ENV's install block (printed) and what it
                                                    stands for (written to F): what the block's ``pip install``
                                                    commands would install into a fresh environment, resolved by
                                                    PY's pip (PY: a fresh ``python3 -m venv``'s, so the pip the block
                                                    will run) with ``--dry-run --report``, with the block's text and
                                                    the Python and pip versions. ``--inputs``: pyproject.toml's
                                                    requirements and pip's configuration instead of a resolution
                                                    (instant, but blind to new releases within the ranges)

The blocks are parsed by ``tests/docs_commands.py``, the module ``tests/test_docs_commands.py`` checks them with.
Standard library only: run by the host's ``python3``, not an environment's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from docs_commands import Command, MarkedBlock, marked_blocks


def marked(kind: str, env: str) -> MarkedBlock:
    try:
        return marked_blocks()[kind, env]
    except KeyError:
        raise SystemExit(f"envs.py: no block marked '<!-- ci: {kind} {env} -->' in README.md or docs/") from None


def test_argv(env: str) -> list[str]:
    """The test block's command as words; ``env NAME=VALUE ...`` first when it sets variables."""
    found = marked("test", env)
    commands = found.commands()
    if len(commands) != 1:
        raise SystemExit(f"envs.py: {found.where}: a test block holds one command, not {len(commands)}")
    command = commands[0]
    return [*(["env", *(f"{k}={v}" for k, v in command.env.items())] if command.env else []), *command.argv]


def pip_installs(commands: list[Command]) -> list[list[str]]:
    """The arguments after ``install`` of each ``pip install`` (``pip``, ``pip3`` or ``python -m pip``)."""
    found = []
    for command in commands:
        argv = command.argv[2:] if command.program.startswith("python") and command.argv[1:3] == ["-m", "pip"] \
            else command.argv if re.fullmatch(r"pip3?(\.\d+)?", command.program) else []
        if argv[1:2] == ["install"]:
            found.append(argv[2:])
    return found


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(python: str, args: list[str]) -> list[str]:
    """``name==version file`` of each distribution ``pip install ARGS`` would install into PYTHON's environment (a
    fresh one: the whole set), sorted; the project itself (an editable install of this checkout) left out."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        done = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                               *args], cwd=ROOT, check=False, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"envs.py: pip install --dry-run {' '.join(args)} failed ({done.returncode}):\n"
                             f"{done.stderr[-3000:]}")
        items = json.loads(report.read_text())["install"]
    lines = []
    for item in items:
        info = item["download_info"]
        if info.get("dir_info", {}).get("editable") or info["url"].rstrip("/") == ROOT.as_uri():
            continue
        meta = item["metadata"]
        lines.append(f"{canonical(meta['name'])}=={meta['version']} {info['url'].rsplit('/', 1)[-1]}")
    return sorted(lines)


_ABOUT = ("import platform, sys, pip; "
          "print(sys.version.replace(chr(10), ' '), platform.machine(), *platform.libc_ver(), 'pip', pip.__version__)")


def inputs(python: str) -> list[str]:
    """What decides a resolution, short of resolving: pyproject.toml's requirements and pip's configuration."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    config = subprocess.run([python, "-m", "pip", "config", "list"], check=False, capture_output=True,
                            text=True).stdout
    constraints = [Path(path).read_text() for path in re.findall(r"\.constraint='([^']+)'", config)
                   if Path(path).is_file()]
    return [json.dumps([project["build-system"], project["project"].get("dependencies", []),
                        project["project"].get("optional-dependencies", {})], sort_keys=True),
            config, *constraints, *sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("PIP_"))]


def key(env: str, python: str, out: Path, *, by_inputs: bool) -> str:
    """The cache key of ``env``: a hash of what ``out`` is given (the Python and pip, the install block, then what it
    resolves to or, ``by_inputs``, what decides that)."""
    install = marked("install", env)
    about = subprocess.run([python, "-c", _ABOUT], capture_output=True, text=True, check=True).stdout.strip()
    if by_inputs:
        found = ["by inputs", *inputs(python)]
    else:
        found = ["by resolution", *(line for args in pip_installs(install.commands())
                                     for line in resolve(python, args))]
    out.write_text("\n".join([f"python {about}", f"block {install.text}", *found]) + "\n")
    return hashlib.sha256(out.read_bytes()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("block")
    one.add_argument("kind", choices=("install", "test"))
    one.add_argument("env")
    sub.add_parser("argv").add_argument("env")
    keyed = sub.add_parser("key")
    keyed.add_argument("env")
    keyed.add_argument("--python", required=True)
    keyed.add_argument("--out", type=Path, required=True)
    keyed.add_argument("--inputs", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "block":
        print(marked(args.kind, args.env).text)
    elif args.command == "argv":
        sys.stdout.write("".join(f"{word}\0" for word in test_argv(args.env)))
    else:
        print(key(args.env, args.python, args.out, by_inputs=args.inputs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
