"""tools/cidigest.py: a failed CI run ends with why, per failed session, however long its log."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cidigest", ROOT / "tools" / "cidigest.py")
assert _spec is not None and _spec.loader is not None
cidigest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cidigest)

LOG = """\
nox > Running session ckptstore
FAILED packages/ckptstore/tests/test_x.py::test_passing_later - nope
nox > Session ckptstore was successful in 5 minutes.
nox > Running session parquetlm
nox > python -m pip install ./packages/parquetlm
E       AssertionError: assert 3 == 4
FAILED packages/parquetlm/tests/test_cache.py::test_a - AssertionError: assert 3 == 4
tempguard: the tests left 1 entry in their temp folder: moto-x
nox > Command python tools/tempguard.py -- python -m pytest packages/parquetlm/tests failed
nox > Session parquetlm failed.
nox > Running session e2e
nox > Command python -m pip install ./apps/train failed with exit code 1
nox > Session e2e failed.
nox > Running session bench_smoke
 1.139x >= 1.500x NOT MET
nox > Session bench_smoke was successful in 5 minutes.
"""


def test_each_failed_session_is_named_with_its_reasons() -> None:
    out = cidigest.digest(LOG.splitlines(keepends=True))
    assert out[0] == "CI digest: 2 session(s) failed: parquetlm, e2e"
    text = "\n".join(out)
    parquetlm = text.split("--- parquetlm")[1].split("--- e2e")[0]
    assert "E       AssertionError: assert 3 == 4" in parquetlm
    assert "FAILED packages/parquetlm/tests/test_cache.py::test_a" in parquetlm
    assert "tempguard: the tests left 1 entry" in parquetlm
    assert "Command python -m pip install ./apps/train failed" in text.split("--- e2e")[1]
    assert "ckptstore" not in text and "NOT MET" not in text  # passed sessions stay out


def test_a_huge_or_garbled_log_stays_a_short_digest(tmp_path: Path) -> None:
    log = tmp_path / "ci.log"
    with open(log, "wb") as f:
        f.write(b"nox > Running session slurmclock\n")
        f.write(b"\xff\xfe garbage \x00\n" * 1000)
        f.writelines(b"E   " + b"x" * 10_000 + b"\n" for _ in range(500))
        f.writelines(b"FAILED t.py::test_%d - boom\n" % i for i in range(500))
        f.write(b"nox > Session slurmclock failed.\n")
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "cidigest.py"), str(log)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "CI digest: 1 session(s) failed: slurmclock"
    assert len(lines) == 2 + cidigest.PER_SESSION
    assert sum(ln.strip().startswith("E ") for ln in lines) == cidigest.FIRST_E_LINES
    assert max(len(ln) for ln in lines) <= cidigest.WIDTH + 2


def test_no_log_is_one_line_and_no_digest(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "cidigest.py"), str(tmp_path / "none.log")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "cannot read" in r.stderr


def test_ci_run_ends_a_failure_with_the_digest() -> None:
    ci = (ROOT / ".ci/run").read_text()
    assert 'tee "$log"' in ci and 'tools/cidigest.py "$log"' in ci and 'exit "$rc"' in ci
