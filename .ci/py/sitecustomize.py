"""CI only: ``.ci/run`` puts this folder first on ``PYTHONPATH`` for a stage's tests, with ``CI_PROC_LOG`` set.

Each Python process then appends one line to ``CI_PROC_LOG`` as it starts -- ``start``, its pid, its parent's pid,
its command line -- so the stage can count the processes it started, per kind (``.ci/imports.py report``). One
``write`` of one short line (atomic with ``O_APPEND``), nothing imported that ``site`` has not imported already; then
the next ``sitecustomize`` on ``sys.path``, if the interpreter or the environment has one, runs as it would have.
"""

import os


def _record() -> None:
    path = os.environ.get("CI_PROC_LOG")
    if not path:
        return
    try:
        with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
            argv = f.read().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
        line = f"start\t{os.getpid()}\t{os.getppid()}\t{argv[:300]}\n".encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:
        pass


def _chain() -> None:
    """Run the ``sitecustomize`` this one hides (the next one on ``sys.path``), as ``site`` would have."""
    import importlib.machinery
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != here])
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_record()
_chain()
