"""DESIGN.md stays true where a test can tell: each package's "Modules:" line names exactly the
modules its src/ holds, and every file, name and test the design refers to exists."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path
from types import ModuleType

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


# -- the tables of "Contracts" against the code ---------------------------------------------------

SLURMCLOCK_SRC = SOURCES["slurmclock"]
ENV_PREFIXES = ("PYRECOVER_", "SLURMCLOCK_", "DDPKIT_", "PARQUETLM_")
# Where the environment variables of the table are read or set (not the tests: they set them).
ENV_READERS = [*(SOURCES[p] for p in SOURCES), ROOT / "apps/train/slurm", ROOT / ".ci"]


def table_after(marker: str, text: str = DESIGN) -> list[list[str]]:
    """The rows (cells, stripped) of the first Markdown table after ``marker``, header and rule
    left out."""
    start = text.index(marker)
    match = re.search(r"^\|.*?\n(?=[^|]|\Z)", text[start:] + "\n\n", re.M | re.S)
    assert match, f"DESIGN.md has no table after {marker!r}"
    rows = [line.strip().strip("|").split("|") for line in match.group(0).splitlines()]
    return [[cell.strip() for cell in row] for row in rows[2:]]


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def module_constant(path: Path, name: str) -> object:
    """A constant's literal value, read from ``path`` without importing it (the repo session
    has no torch; ddpkit imports it)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} defines no {name}")


def slurmclock_job() -> ModuleType:
    """slurmclock.job of this checkout (stdlib only: importable in any session)."""
    sys.path.insert(0, str(SLURMCLOCK_SRC.parent))
    try:
        return importlib.import_module("slurmclock.job")
    finally:
        sys.path.remove(str(SLURMCLOCK_SRC.parent))


def exit_table(text: str = DESIGN) -> dict[str, int]:
    rows = table_after("**Exit codes of a training step**", text)
    return {ticked(name)[0]: int(code) for code, name, *_ in rows if code.isdigit()}


def test_the_exit_code_table_is_slurmclocks() -> None:
    job = slurmclock_job()
    names = [n for n in dir(job) if re.fullmatch(r"EXIT_[A-Z_]+", n) and n != "EXIT_CODES"]
    code = {name: getattr(job, name) for name in names}
    assert exit_table() == code, "DESIGN.md's exit-code table: fix it or slurmclock/job.py EXIT_*"
    assert set(job.EXIT_CODES) == set(code.values())


def event_table(text: str = DESIGN) -> set[str]:
    rows = table_after("**The job's timeline**", text)
    return {ticked(row[0])[0] for row in rows}


def test_the_event_table_is_slurmclocks() -> None:
    assert event_table() == set(slurmclock_job().EVENTS), "DESIGN.md's events vs slurmclock.EVENTS"


def fault_keys(text: str = DESIGN) -> list[str]:
    start = text.index("**ddpkit's fault record**")
    record = re.search(r"`\{(.*?)\}`", text[start:], re.S)
    assert record, "DESIGN.md's fault record has no `{...}` sketch"
    return re.findall(r'"(\w+)":', record.group(1))


def test_the_fault_record_keys_are_ddpkits() -> None:
    keys = module_constant(SOURCES["ddpkit"] / "faults.py", "FAULT_RECORD_KEYS")
    assert tuple(fault_keys()) == keys, "DESIGN.md's fault record vs ddpkit.faults"


def env_table(text: str = DESIGN) -> set[str]:
    """The variables of the table: ``PYRECOVER_REQUIRE_SLURM``, ``_S3`` read as
    ``PYRECOVER_REQUIRE_S3``."""
    found: set[str] = set()
    for row in table_after("**Environment variables**", text):
        names = ticked(row[0])
        found.add(names[0])
        stem = names[0].rsplit("_", 1)[0]
        found.update(stem + name if name.startswith("_") else name for name in names[1:])
    return found


def env_in_code() -> set[str]:
    pattern = re.compile(rf"\b(?:{'|'.join(ENV_PREFIXES)})[A-Z0-9_]*[A-Z0-9]\b")
    found: set[str] = set()
    for where in ENV_READERS:
        for path in [where] if where.is_file() else sorted(where.rglob("*")):
            if path.is_file() and path.suffix in ("", ".py", ".sh"):
                found.update(pattern.findall(path.read_text(encoding="utf-8", errors="replace")))
    return found


def test_the_environment_table_is_what_the_code_reads() -> None:
    table, code = env_table(), env_in_code()
    assert not code - table, f"the code reads {sorted(code - table)}: add rows to DESIGN.md"
    assert not table - code, f"DESIGN.md names {sorted(table - code)}, which no code reads"


def protocol_methods() -> set[str]:
    tree = ast.parse((SLURMCLOCK_SRC / "job.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


def design_protocol(text: str = DESIGN) -> set[str]:
    match = re.search(r"the `Scheduler` protocol: (.*?)`Slurm", text, re.S)
    assert match, "DESIGN.md lists no methods after 'the `Scheduler` protocol: '"
    return set(re.findall(r"`(\w+)\(", match.group(1)))


def test_the_scheduler_methods_are_the_protocols() -> None:
    assert design_protocol() == protocol_methods(), "DESIGN.md's Scheduler vs job.py's Protocol"


def seam_rows(text: str = DESIGN) -> list[list[str]]:
    return table_after("| change | src | tests | docs |", text)


def test_every_seam_row_has_counts_and_names_its_files() -> None:
    """Each row says how many files of each kind (numbers, measured with a scratch branch's
    ``git diff --stat``) and names the files; each file it names exists (above)."""
    rows = seam_rows()
    assert len(rows) >= 6, rows
    for change, *counts, files in rows:
        assert len(counts) == 3 and all(c.isdigit() for c in counts), f"{change!r}: {counts}"
        assert ticked(files), f"seam {change!r} names no file"


@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ("| 74 | `EXIT_STORE_UNAVAILABLE`", "| 73 | `EXIT_STORE_UNAVAILABLE`"),
        ("| `relaunched` |", "| `relaunched2` |"),
        ('"silent_s": <float>, ', ""),
        ("| `PARQUETLM_CACHE` |", "| `PARQUETLM_CACHES` |"),
        ("`cluster_name() -> str`, ", ""),
    ],
)
def test_a_changed_table_fails(good: str, bad: str) -> None:
    """A copy of DESIGN.md with one value changed no longer matches the code."""
    assert good in DESIGN
    copy = DESIGN.replace(good, bad, 1)
    checks = [
        exit_table(copy) == exit_table(),
        event_table(copy) == event_table(),
        fault_keys(copy) == fault_keys(),
        env_table(copy) == env_table(),
        design_protocol(copy) == design_protocol(),
    ]
    assert not all(checks)
