"""House rule: no import circle anywhere.

Inside each package (and the app), no two modules may import each other, directly or through a
chain (a -> b -> c -> a). Every import statement counts wherever it stands, in a function too: an
import moved into a function to dodge a circle still ties the two files together. Only imports
under ``if TYPE_CHECKING:`` are left out (they never run). ``from . import NAME`` where NAME is not
a submodule imports the package's ``__init__``, which imports its submodules: a circle too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = {p.name: p / "src" / p.name for p in sorted((ROOT / "packages").iterdir()) if p.is_dir()}
UNITS["pyrecover_train"] = ROOT / "apps" / "train" / "src" / "pyrecover_train"


class Edge(NamedTuple):
    target: str  # the imported module, inside the same package
    line: int


def module_names(src_pkg: Path) -> dict[str, Path]:
    """{dotted module name: file} for every module of the package rooted at ``src_pkg``."""
    out = {}
    for path in sorted(src_pkg.rglob("*.py")):
        parts = list(path.relative_to(src_pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except in the body of ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                yield from _import_nodes(ast.Module(body=[child], type_ignores=[]))
            continue
        yield from _import_nodes(node)


def _base(module: str, is_package: bool, level: int) -> str:
    """The package a relative import of ``level`` dots starts from."""
    parts = module.split(".")
    if not is_package:
        parts.pop()
    return ".".join(parts[: len(parts) - (level - 1)])


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """The modules of the same package that ``module`` (the file ``path``) imports."""
    edges = []
    is_package = path.name == "__init__.py"
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            start = _base(module, is_package, node.level) if node.level else ""
            origin = ".".join(p for p in (start, node.module or "") if p)
            # `from X import name`: the submodule X.name when there is one, else X itself.
            targets = [
                f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin
                for a in node.names
            ]
        edges.extend(Edge(t, node.lineno) for t in targets if t in modules and t != module)
    return edges


def import_graph(src_pkg: Path) -> dict[str, list[Edge]]:
    modules = module_names(src_pkg)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for edge in graph.get(v, []):
            w = edge.target
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def one_loop(graph: dict[str, list[Edge]], group: list[str]) -> list[tuple[str, Edge]]:
    """A shortest import loop through the first module of ``group``, as (importer, edge) pairs."""
    members, start = set(group), group[0]
    paths: dict[str, list[tuple[str, Edge]]] = {start: []}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for edge in graph[v]:
            if edge.target == start:
                return [*paths[v], (v, edge)]
            if edge.target in members and edge.target not in paths:
                paths[edge.target] = [*paths[v], (v, edge)]
                queue.append(edge.target)
    raise AssertionError(f"{group} is not a circle")  # Tarjan's groups always hold one


def report(src_pkg: Path) -> list[str]:
    """One message per circle, naming each import (file:line) along one loop through it."""
    graph = import_graph(src_pkg)
    modules = module_names(src_pkg)
    messages = []
    for group in circles(graph):
        lines = [f"import circle among {len(group)} modules: {', '.join(group)}; one loop:"]
        for importer, edge in one_loop(graph, group):
            where = modules[importer].relative_to(src_pkg.parent)
            lines.append(f"    {where}:{edge.line} imports {edge.target}")
        messages.append("\n".join(lines))
    return messages


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_no_import_circle(unit: str) -> None:
    problems = report(UNITS[unit])
    assert not problems, (
        f"{unit} has import circles (files that import each other, directly or through a chain). "
        "Break each one: move what both sides need into a module of its own that imports "
        "neither, or pass it in as an argument; an import inside a function still counts.\n  "
        + "\n  ".join(problems)
    )


# -- the detector itself ---------------------------------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_finds_two_files_importing_each_other(tmp_path: Path) -> None:
    pkg = _package(tmp_path, {"a.py": "from .b import x\n", "b.py": "from . import a\nx = 1\n"})
    (msg,) = report(pkg)
    assert "pkg.a, pkg.b" in msg
    assert "pkg/a.py:1 imports pkg.b" in msg and "pkg/b.py:1 imports pkg.a" in msg


def test_finds_a_chain_and_an_import_inside_a_function(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path,
        {
            "a.py": "import pkg.b\n",
            "b.py": "from pkg.sub import c\n",
            "sub/__init__.py": "",
            "sub/c.py": "def f():\n    from ..a import g\n",
        },
    )
    assert circles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    assert "pkg/sub/c.py:2 imports pkg.a" in report(pkg)[0]


def test_an_import_of_the_package_init_closes_a_circle(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path, {"__init__.py": "from .store import S\n__version__ = '1'\n", "store.py": ""}
    )
    (pkg / "store.py").write_text("from . import __version__\nclass S: ...\n")
    assert circles(import_graph(pkg)) == [["pkg", "pkg.store"]]


def test_type_checking_imports_and_one_way_imports_are_fine(tmp_path: Path) -> None:
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "from .a import f\nfrom .b import g\n",
            "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import g\n"
            "else:\n    import os\ndef f(): ...\n",
            "b.py": "import os\nfrom .a import f\ndef g(): ...\n",
        },
    )
    assert report(pkg) == []
    (pkg / "a.py").write_text("def f():\n    if True:\n        from .b import g\n")
    assert circles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]
