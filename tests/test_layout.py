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


# ---- the house rules (docs/architecture.md): one direction of arrows, imports at the top, small modules ----------
ENTRY_MODULES = (  # a door's entry (start-up: load what the command or the framework asks for, when it asks)
    "vllm_diffusion_plugin/__init__.py",  # register(): every vLLM process, plugin enabled or not
    "vllm_diffusion_plugin/doors/cli/__init__.py",  # the command: --help imports no torch
    "vllm_diffusion_plugin/doors/omni/__init__.py", "vllm_diffusion_plugin/doors/omni/_patching.py",
    "vllm_diffusion_plugin/doors/omni/patch_*.py",  # wrappers run in vllm-omni's processes, on vllm-omni's calls
    "vllm_diffusion_plugin/testing/__init__.py", "vllm_diffusion_plugin/testing/pytest_plugin.py",  # every pytest
    "vllm_diffusion_plugin/testing/cpu_fp8.py",  # a vllm.general_plugins entry point
)
MAX_INNER_IMPORTS = 40
MAX_MODULE_LINES = 400


def modules_of(package: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def internal_imports(module: str, path: Path, modules: dict[str, Path]):
    """``(line, imported module, inside a function, names)`` of every package-internal import of ``module``; a name
    that is a module counts as that module."""
    tree = ast.parse(path.read_text(), str(path))
    inner = {id(sub) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for sub in ast.walk(fn) if sub is not fn}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(anchor[:len(anchor) - node.level + 1] + ([node.module] if node.module else []))
            if base.split(".")[0] != PACKAGE.name:
                continue
            for alias in node.names:
                name = f"{base}.{alias.name}"
                yield node.lineno, name if name in modules else base, id(node) in inner, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE.name:
                    yield node.lineno, alias.name, id(node) in inner, None


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = modules_of(package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for _, target, _, _ in internal_imports(module, path, modules):
            while target not in modules:
                target = target.rpartition(".")[0]
            if target != module:
                graph[module].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_counting_imports_inside_functions():
    assert circles(import_graph(PACKAGE)) == []


def test_the_circle_check_sees_a_circle_through_an_import_inside_a_function(tmp_path):
    package = tmp_path / PACKAGE.name
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(f"from {PACKAGE.name}.b import x\n")
    (package / "b.py").write_text(f"x = 1\n\ndef f():\n    from {PACKAGE.name} import a\n")
    assert circles(import_graph(package)) == [[f"{PACKAGE.name}.a", f"{PACKAGE.name}.b"]]


def entry(path: Path) -> bool:
    relative = path.relative_to(PACKAGE.parent)
    return any(relative.match(pattern) for pattern in ENTRY_MODULES)


def test_package_imports_are_at_the_top_but_at_a_doors_entry():
    modules = modules_of(PACKAGE)
    inner = [(path, line, target) for module, path in modules.items()
             for line, target, inside, _ in internal_imports(module, path, modules) if inside]
    misplaced = [f"{p.relative_to(PACKAGE.parent)}:{line} imports {target}" for p, line, target in inner
                 if not entry(p)]
    assert not misplaced, "\n".join(misplaced)
    assert len(inner) <= MAX_INNER_IMPORTS, f"{len(inner)} imports inside functions at doors' entries"


def test_no_module_is_over_400_lines():
    big = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, big


def test_no_private_name_is_imported_across_modules():
    modules = modules_of(PACKAGE)
    private = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name} from {target}"
               for module, path in modules.items()
               for line, target, _, name in internal_imports(module, path, modules)
               if name and name.startswith("_") and not name.startswith("__") and not target.endswith(f".{name}")
               and target != module]
    assert not private, "\n".join(private)
