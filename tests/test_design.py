"""DESIGN.md stays true where a test can tell: each package's "Modules:" line names exactly the
modules its src/ holds, and every file, name and test the design refers to exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = (ROOT / "DESIGN.md").read_text(encoding="utf-8")
SOURCES = {
    "slurmclock": ROOT / "packages/slurmclock/src/slurmclock",
    "ddpkit": ROOT / "packages/ddpkit/src/ddpkit",
    "ckptstore": ROOT / "packages/ckptstore/src/ckptstore",
    "parquetlm": ROOT / "packages/parquetlm/src/parquetlm",
    "apps/train": ROOT / "apps/train/src/pyrecover_train",
}


def section(heading: str) -> str:
    """The text under the first heading that starts with ``heading``, to the next heading."""
    match = re.search(rf"^#+ {re.escape(heading)}.*?\n(.*?)(?=^#)", DESIGN, re.M | re.S)
    assert match, f"DESIGN.md has no heading '{heading}'"
    return match.group(1)


def named_modules(text: str) -> set[str]:
    """The names of a "Modules: `a` (what it does), `b`, ..." paragraph: backticked words
    outside the parentheses."""
    match = re.search(r"^Modules: (.*?)(?:\n\n|\Z)", text, re.M | re.S)
    assert match, "no paragraph starting with 'Modules: '"
    names = match.group(1)
    while re.search(r"\([^()]*\)", names):
        names = re.sub(r"\([^()]*\)", "", names)
    return set(re.findall(r"`([^`]+)`", names))


def modules_in(src: Path) -> set[str]:
    """Every module of a package: ``store``, ``formats`` (a sub-package), ``formats/dcp``."""
    out = set()
    for path in src.rglob("*.py"):
        rel = path.relative_to(src).with_suffix("").as_posix()
        if rel in ("__init__", "__main__"):
            continue
        out.add(rel.removesuffix("/__init__"))
    return out


@pytest.mark.parametrize("package", SOURCES)
def test_design_names_every_module_of_each_package(package: str) -> None:
    named, real = named_modules(section(package)), modules_in(SOURCES[package])
    missing, stale = sorted(real - named), sorted(named - real)
    assert not missing, (
        f"DESIGN.md does not name {missing} of {package}: add each to the 'Modules:' paragraph "
        f"under '### {package}', with a few words on its job"
    )
    assert not stale, f"DESIGN.md names {stale} under '### {package}', which has no such module"


def test_the_module_reader_sees_names_not_glosses() -> None:
    text = "Modules: `job` (facts, `Scheduler`), `cli` (the `x` command (nested)), `a/b`.\n\nrest"
    assert named_modules(text) == {"job", "cli", "a/b"}


def test_every_file_the_design_names_exists() -> None:
    """``path`` and ``path:NAME`` (NAME defined or used in that file), relative to the
    repository or to a package (``tests/conftest.py`` of the package the text is about)."""
    refs = re.findall(r"`((?:packages|apps|tests)/[\w./-]+?)(?::(\w+))?`", DESIGN)
    assert len(refs) >= 10, refs
    for path, name in refs:
        bases = [ROOT, *ROOT.glob("packages/*"), *ROOT.glob("apps/*")]
        found = [base / path for base in bases if (base / path).exists()]
        assert found, f"DESIGN.md names {path}, which does not exist"
        if name:
            assert any(name in f.read_text() for f in found), f"DESIGN.md: {path} has no {name}"


def test_every_test_the_design_names_exists() -> None:
    tests = set(re.findall(r"`(test_\w+\.py)`", DESIGN))
    assert tests
    found = {p.name for p in ROOT.glob("**/tests/**/test_*.py") if ".nox" not in p.parts}
    assert not tests - found, f"DESIGN.md names tests that do not exist: {tests - found}"
