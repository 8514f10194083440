"""The package's shape (issue 15): parts with public seams, no test hooks in the product, no
import cycles, short functions, tests that share helpers without editing sys.path."""

from __future__ import annotations

import ast
import statistics
from pathlib import Path

from ckpt_helpers import TESTS

SRC = TESTS.parent / "src" / "ckptstore"


def modules() -> dict[str, ast.Module]:
    out = {}
    for f in sorted(SRC.rglob("*.py")):
        rel = f.relative_to(SRC).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(("ckptstore", *parts))] = ast.parse(f.read_text())
    return out


def top_level_imports(name: str, tree: ast.Module, is_pkg: bool) -> set[str]:
    """Sibling modules imported at module level (imports inside functions are lazy)."""
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            pkg = base[: len(base) - node.level + 1]
            mod = ".".join(pkg + ([node.module] if node.module else []))
            out |= {mod} if node.module else {f"{mod}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("ckptstore")}
    return out


def test_no_import_cycles() -> None:
    """Module-level imports between the package's modules form no cycle (e.g. a module taking
    ``__version__`` from the package ``__init__``, which imports that module)."""
    mods = modules()
    pkgs = {n for n in mods if (SRC / Path(*n.split(".")[1:]) / "__init__.py").exists()}

    def resolve(m: str) -> str:  # `from . import name`: a submodule, or a name of the package
        return m if m in mods else m.rpartition(".")[0]

    graph = {
        n: {r for m in top_level_imports(n, t, n in pkgs) if (r := resolve(m)) in mods and r != n}
        for n, t in mods.items()
    }
    done: set[str] = set()

    def visit(n: str, path: tuple[str, ...]) -> None:
        for d in sorted(graph[n]):
            assert d not in path, f"import cycle: {' -> '.join((*path, d))}"
            if d not in done:
                visit(d, (*path, d))
        done.add(n)

    for n in sorted(graph):
        if n not in done:
            visit(n, (n,))


def test_median_function_length_is_at_most_8_lines() -> None:
    lengths = [
        node.end_lineno - node.lineno + 1  # type: ignore[operator]
        for tree in modules().values()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    assert statistics.median(lengths) <= 8


def test_no_test_hooks_in_the_product() -> None:
    for f in SRC.rglob("*.py"):
        text = f.read_text()
        assert "CKPTSTORE_TEST" not in text and "pause_point" not in text, f
    assert not (SRC / "_testing.py").exists()


def test_the_mirror_uses_no_private_members_of_others() -> None:
    tree = ast.parse((SRC / "mirror.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            assert isinstance(node.value, ast.Name) and node.value.id == "self", ast.unparse(node)


def test_tests_share_helpers_without_editing_sys_path() -> None:
    for f in TESTS.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("insert", "append"):
                assert ast.unparse(node.value) != "sys.path", f.name
