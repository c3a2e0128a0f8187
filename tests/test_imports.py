"""Imports flow one way: core types -> prompt / index / fleet / schedule -> gateway
(router/http/app.py) -> ops (explain, diagnose, admin, offline) -> cli, and loadtest sits above
router. Checked on the source: the import graph from every file's AST, module-level and
function-level imports alike (only ``if TYPE_CHECKING:`` blocks are left out: they never run).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("router", "loadtest")
OPS = ("router.ops", "router.cli")


def module_files() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every import statement and string constant under ``node``, at any depth, except inside
    ``if TYPE_CHECKING:``. A string that is exactly a submodule's dotted name counts as an import
    of it: that is how dynamic imports name their target (``importlib.import_module(
    "loadtest.cli")``, the cli's table of delegated subcommands)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _import_nodes_of(stmt)
            continue
        yield from _import_nodes_of(child)


def _import_nodes_of(node: ast.AST) -> Iterator[ast.AST]:
    if isinstance(node, (ast.Import, ast.ImportFrom)) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str)
    ):
        yield node
    yield from _import_nodes(node)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of our modules (None: outside them)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import sub`` imports the submodule; ``from pkg import name`` the package
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        elif isinstance(node, ast.Constant) and "." in node.value and node.value in modules:
            names = [node.value]  # dotted only: a bare "loadtest" is the subcommand's name
        for name in names:
            target = _known(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


@functools.cache
def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]], prefix: str) -> list[list[str]]:
    """Strongly connected components of more than one module among ``prefix``'s modules
    (Tarjan's algorithm)."""
    nodes = sorted(m for m in graph if m == prefix or m.startswith(prefix + "."))
    inside = set(nodes)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v] & inside):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_function_level_imports_and_skips_type_checking(tmp_path):
    # the checker itself: a circle through a function-level import is an edge; TYPE_CHECKING
    # is not; relative imports resolve
    files = {
        "pkg": tmp_path / "pkg" / "__init__.py",
        "pkg.a": tmp_path / "pkg" / "a.py",
        "pkg.b": tmp_path / "pkg" / "b.py",
    }
    files["pkg"].parent.mkdir()
    files["pkg"].write_text("")
    files["pkg.a"].write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n"
    )
    files["pkg.b"].write_text("def f():\n    from . import a\n    return a\n")
    files["pkg"].write_text('COMMANDS = {"b": ("pkg.b", "help text"), "doc": "pkg.b.f"}\n')
    graph = {m: imports_of(m, p, files) for m, p in files.items()}
    assert graph == {"pkg": {"pkg.b"}, "pkg.a": set(), "pkg.b": {"pkg.a"}}
    files["pkg.a"].write_text("def g():\n    from pkg.b import f\n    return f\n")
    graph = {m: imports_of(m, p, files) for m, p in files.items()}
    assert cycles(graph, "pkg") == [["pkg.a", "pkg.b"]]


def test_router_has_no_import_cycle():
    assert cycles(import_graph(), "router") == []


def test_the_gateway_imports_no_ops_module():
    graph = import_graph()
    below = [m for m in graph if m.startswith("router.") and not m.startswith(OPS)]
    for module in below:
        ops = sorted(t for t in graph[module] if t.startswith(OPS))
        assert not ops, f"{module} imports {ops}: ops modules sit above the gateway"


def test_router_never_imports_loadtest():
    graph = import_graph()
    up = {m: sorted(t for t in ts if t.split(".")[0] == "loadtest") for m, ts in graph.items()}
    assert {m: ts for m, ts in up.items() if m.split(".")[0] == "router" and ts} == {}


def test_loadtest_has_no_import_cycle():
    assert cycles(import_graph(), "loadtest") == []
