"""The package's layers import only downward (docs/architecture.md): a door never imports ``testing/``, ``testing/``
never imports a door, the engine imports no door and no tool. Read from the source (``ast``), so an import
anywhere in a module -- also one inside a function -- counts."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_diffusion_plugin"
FORBIDDEN = {  # subpackage -> subpackages it must not import
    "engine": ("doors", "tools", "testing", "tiny"),
    "doors": ("testing",),
    "tools": ("doors", "testing"),
    "tiny": ("doors", "tools", "testing"),
    "testing": ("doors", "tools"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def violations(layer: str) -> list[str]:
    out = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, module in imported_modules(path):
            for banned in FORBIDDEN[layer]:
                if module == f"vllm_diffusion_plugin.{banned}" or module.startswith(f"vllm_diffusion_plugin.{banned}."):
                    out.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    return out


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_downward(layer):
    assert not violations(layer), "\n".join(violations(layer))


def test_the_check_sees_an_import_inside_a_function(tmp_path, monkeypatch):
    fake = tmp_path / "vllm_diffusion_plugin" / "doors"
    fake.mkdir(parents=True)
    (fake / "x.py").write_text("def f():\n    from vllm_diffusion_plugin.testing.logs import captured_logs\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "vllm_diffusion_plugin")
    assert violations("doors") == ["vllm_diffusion_plugin/doors/x.py:2 imports vllm_diffusion_plugin.testing.logs",
                                   "vllm_diffusion_plugin/doors/x.py:2 imports "
                                   "vllm_diffusion_plugin.testing.logs.captured_logs"]
