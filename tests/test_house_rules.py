"""House rules of the monorepo, checked on every CI run.

- no package under packages/ imports a sibling package (only apps/ may compose them);
- every package has the standard layout (src/, py.typed, tests/, README.md, pyproject.toml);
- slurmclock stays stdlib-only (its trainer integrations are optional extras);
- .ci/run runs the README's test command;
- CI builds the documentation site with every link and reference checked.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if p.is_dir())
APP_IMPORT_NAMES = {"pyrecover_train"}


def imported_top_levels(source: str, filename: str) -> set[str]:
    """Top-level module names a Python file imports (absolute imports only)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    # importlib.import_module("x") / __import__("x") with a literal name count too.
    for node in ast.walk(ast.parse(source, filename=filename)):
        if (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in {"import_module", "__import__"}:
                names.add(node.args[0].value.split(".")[0])
    return names


def sibling_imports(package: str) -> list[str]:
    forbidden = (set(PACKAGES) - {package}) | APP_IMPORT_NAMES
    problems = []
    pkg_dir = ROOT / "packages" / package
    for path in sorted(pkg_dir.rglob("*.py")):
        if ".nox" in path.parts or "build" in path.parts:
            continue
        bad = imported_top_levels(path.read_text(encoding="utf-8"), str(path)) & forbidden
        problems.extend(f"{path.relative_to(ROOT)} imports {name}" for name in sorted(bad))
    return problems


def test_packages_exist() -> None:
    assert PACKAGES == ["ckptstore", "ddpkit", "parquetlm", "slurmclock"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_package_imports_a_sibling(package: str) -> None:
    problems = sibling_imports(package)
    assert not problems, (
        "packages must not import each other (only apps/ composes them); pass what you need as an "
        "argument instead:\n  " + "\n  ".join(problems)
    )


def test_detector_catches_a_sibling_import(tmp_path: Path) -> None:
    src = "import os\nfrom ckptstore.store import CheckpointStore\nimport importlib\n"
    src += "m = importlib.import_module('ddpkit')\n"
    assert {"ckptstore", "ddpkit"} <= imported_top_levels(src, "x.py")
    assert "parquetlm" not in imported_top_levels("from . import parquetlm\n", "x.py")
    lazy = "import os\ndef f():\n    import wandb\nclass C:\n    def g(self):\n        import x\n"
    assert imported_at_import_time(lazy, "x.py") == {"os"}
    assert "wandb" in imported_at_import_time("try:\n    import wandb\nexcept: pass\n", "x.py")


@pytest.mark.parametrize("package", PACKAGES)
def test_package_layout(package: str) -> None:
    d = ROOT / "packages" / package
    for rel in (
        "pyproject.toml",
        "README.md",
        f"src/{package}/__init__.py",
        f"src/{package}/py.typed",
    ):
        assert (d / rel).is_file(), f"packages/{package}/{rel} is missing"
    assert any((d / "tests").glob("test_*.py")), f"packages/{package}/tests has no test_*.py"
    meta = tomllib.loads((d / "pyproject.toml").read_text())["project"]
    assert meta["name"] == package
    assert meta["requires-python"] == ">=3.10"
    deps = " ".join(meta.get("dependencies", []))
    for other in set(PACKAGES) - {package}:
        assert other not in deps, f"{package} declares a dependency on its sibling {other}"


# Trainer integrations: optional extras of slurmclock, importable only with their library; the
# core never imports them (module file -> the extra that must declare its libraries).
SLURMCLOCK_INTEGRATIONS = {"lightning.py": "lightning", "hf.py": "hf"}
# The app's modules that import an extra's library lazily, inside a function (never when the app
# is imported): module file -> (library, the app's extra that declares it).
APP_LAZY = {"wandb_log.py": ("wandb", "wandb"), "report.py": ("matplotlib", "plot")}


def imported_at_import_time(source: str, filename: str) -> set[str]:
    """imported_top_levels, leaving out what function bodies import (run only when called)."""
    tree = ast.parse(source, filename=filename)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.body = [ast.Pass()]
    return imported_top_levels(ast.unparse(tree), filename)


def test_slurmclock_is_stdlib_only() -> None:
    meta = tomllib.loads((ROOT / "packages/slurmclock/pyproject.toml").read_text())["project"]
    assert meta.get("dependencies", []) == []
    extras = meta.get("optional-dependencies", {})
    stdlib = set(sys.stdlib_module_names) | {"slurmclock", "__future__"}
    for path in (ROOT / "packages/slurmclock/src").rglob("*.py"):
        if path.name in SLURMCLOCK_INTEGRATIONS:
            assert extras.get(SLURMCLOCK_INTEGRATIONS[path.name]), f"no extra for {path.name}"
            continue
        source = path.read_text()
        modules = {
            alias.name if isinstance(node, ast.Import) else (node.module or "")
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        }
        for module in SLURMCLOCK_INTEGRATIONS:
            name = module.removesuffix(".py")
            assert not modules & {f"slurmclock.{name}", name}, (
                f"{path.relative_to(ROOT)} imports the optional integration {name}"
            )
        third_party = imported_top_levels(source, str(path)) - stdlib
        assert not third_party, f"{path.relative_to(ROOT)} imports non-stdlib {third_party}"


@pytest.mark.parametrize("module", APP_LAZY)
def test_app_imports_optional_libraries_lazily(module: str) -> None:
    """An optional library (W&B, matplotlib) is the app's extra and comes in when it is used:
    pyrecover-train starts without it."""
    project = tomllib.loads((ROOT / "apps/train/pyproject.toml").read_text())["project"]
    declared = project.get("optional-dependencies", {})
    library, extra = APP_LAZY[module]
    assert library in " ".join(declared.get(extra, [])), f"the app's [{extra}] lacks {library}"
    path = ROOT / "apps/train/src/pyrecover_train" / module
    source = path.read_text()
    assert library in imported_top_levels(source, str(path)), f"{module} no longer uses {library}"
    assert library not in imported_at_import_time(source, str(path)), (
        f"{path.relative_to(ROOT)} imports {library} at import time (import it lazily)"
    )


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "<!-- test-command -->" in readme
    ci = (ROOT / ".ci/run").read_text()
    assert "test-command" in ci and "README.md" in ci


def test_app_depends_on_the_four_packages() -> None:
    meta = tomllib.loads((ROOT / "apps/train/pyproject.toml").read_text())["project"]
    names = {d.split("[")[0].split(">")[0].split("=")[0].strip() for d in meta["dependencies"]}
    assert set(PACKAGES) <= names


def test_ci_installs_every_tool_a_test_would_skip_without() -> None:
    """A test that CI skips is not a test: .ci/run installs what the skip reasons ask for."""
    ci = (ROOT / ".ci/run").read_text()
    tools = (("slurmctld", "slurm-wlm"), ("shellcheck", "shellcheck"), ("ip", "iproute2"))
    for command, package in tools:
        assert f"[{command}]={package}" in ci, f".ci/run must apt-get install {package}"


def test_nox_counts_no_tests_collected_as_a_failure() -> None:
    noxfile = (ROOT / "noxfile.py").read_text()
    assert "success_codes" not in noxfile, "pytest's exit 5 (no tests collected) must fail"
    assert "tempguard.py" in noxfile, "every pytest run goes through tools/tempguard.py"


def test_ci_builds_the_docs_with_every_link_checked() -> None:
    """`nox` (what CI runs) builds the site with --strict, and mkdocs.yml keeps every link check
    at "warn", which --strict turns into a failure: a broken link is fixed where it is written."""
    noxfile = (ROOT / "noxfile.py").read_text()
    defaults = noxfile.split("nox.options.sessions = [", 1)[1].split("]", 1)[0]
    assert '"docs"' in defaults, "the docs session must be one of nox's default sessions"
    assert '"--strict"' in noxfile
    mkdocs = (ROOT / "mkdocs.yml").read_text()
    for check in ("omitted_files", "absolute_links", "unrecognized_links", "anchors"):
        assert f"{check}: warn" in mkdocs, f"mkdocs.yml: validation {check} must stay at warn"
