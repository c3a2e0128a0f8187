"""The layout of router/, held so later work does not undo it (issue 40): no import cycle,
counting every import (function-level, ``if TYPE_CHECKING:`` and a submodule importing its own
package's ``__init__`` alike), and router/core/ imports nothing above it; at most 12 modules
directly in router/, the rest in folders that show the layers; no file under router/ over 500
lines. Checked on the source, with ast.
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from pathlib import Path

from tests.test_imports import ROOT, _known, cycles, module_files

ROUTER = ROOT / "router"
MAX_ROOT_MODULES = 12
MAX_LINES = 500


def every_import(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules ``module`` imports anywhere in its file, whether or not the import runs: at
    module level, in a function, under ``if TYPE_CHECKING:``, and dotted-name strings (what
    ``importlib.import_module`` is handed)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import x`` runs pkg's __init__ whether x is a name or a submodule: a
            # submodule doing it while that __init__ imports the submodule is a cycle
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and "." in node.value
            and node.value in modules
        ):
            names = [node.value]
        for name in names:
            target = _known(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {m: every_import(m, p, modules) for m, p in modules.items()}


def a_cycle(g: dict[str, set[str]], component: list[str]) -> list[str]:
    """One closed path through a strongly connected component, for the failure message."""
    inside = set(component)
    start = component[0]
    came: dict[str, str] = {}
    todo = deque([start])
    while todo:
        v = todo.popleft()
        for w in sorted(g[v] & inside):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w not in came:
                came[w] = v
                todo.append(w)
    return component


def router_files() -> list[Path]:
    return sorted(p for p in ROUTER.rglob("*.py") if "assets" not in p.relative_to(ROUTER).parts)


def test_the_graph_counts_type_checking_and_a_package_init(tmp_path):
    # the checker itself: an import under TYPE_CHECKING is an edge, and so is a submodule
    # taking a name from its package's __init__ that imports it back
    files = {
        "pkg": tmp_path / "pkg" / "__init__.py",
        "pkg.a": tmp_path / "pkg" / "a.py",
        "pkg.b": tmp_path / "pkg" / "b.py",
    }
    files["pkg"].parent.mkdir()
    files["pkg"].write_text("from pkg.a import A\nB = 1\n")
    files["pkg.a"].write_text("from pkg.b import f\nclass A: ...\n")
    files["pkg.b"].write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
        "def f():\n    from pkg import B\n"
    )
    g = {m: every_import(m, p, files) for m, p in files.items()}
    assert g == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg", "pkg.a"}}
    assert cycles(g, "pkg") == [["pkg", "pkg.a", "pkg.b"]]
    assert a_cycle(g, ["pkg.a", "pkg.b"]) == ["pkg.a", "pkg.b", "pkg.a"]


def test_router_has_no_import_cycle_counting_every_import():
    g = graph()
    found = [f"{' -> '.join(a_cycle(g, c))} (in all: {', '.join(c)})" for c in cycles(g, "router")]
    assert not found, "import cycles (every import counted):\n" + "\n".join(found)


def test_core_imports_nothing_above_it():
    # router/core/ is the lowest layer: every other folder may import it, it imports none
    g = graph()
    up = {
        m: sorted(t for t in ts if t.startswith("router") and not t.startswith("router.core"))
        for m, ts in g.items()
        if m.startswith("router.core")
    }
    up = {m: ts for m, ts in up.items() if ts}
    assert not up, f"router/core/ imports above it: {up}"


def test_at_most_12_modules_directly_in_router():
    root = sorted(p.name for p in ROUTER.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, (
        f"{len(root)} modules directly in router/ (at most {MAX_ROOT_MODULES}; put new ones in "
        f"the folder of their layer): {', '.join(root)}"
    )


def test_no_file_under_router_over_500_lines():
    long = {}
    for p in router_files():
        with p.open(encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long[p.relative_to(ROOT).as_posix()] = n
    assert not long, f"over {MAX_LINES} lines (split by job): " + ", ".join(
        f"{p} ({n})" for p, n in sorted(long.items())
    )
