"""tools/tempguard.py: a test run that leaves something in its temp folder fails, by name."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tempguard", ROOT / "tools" / "tempguard.py")
assert _spec is not None and _spec.loader is not None
tempguard = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tempguard)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_clean_command_passes_and_leaves_nothing(tmp_path: Path) -> None:
    code = (
        "import os, tempfile\n"
        "assert tempfile.gettempdir() == os.environ['TMPDIR']\n"  # children get the folder
        "with tempfile.TemporaryDirectory() as d: open(os.path.join(d, 'x'), 'w').close()\n"
        "os.makedirs(os.path.join(os.environ['TMPDIR'], 'pytest-of-me', 'empty'))\n"
        "os.makedirs(os.path.join(os.environ['TMPDIR'], 'torchinductor_me', 'empty'))\n"
    )
    assert tempguard.run(python(code), parent=str(tmp_path)) == 0
    assert list(tmp_path.iterdir()) == []


def test_a_leak_fails_with_its_name_and_is_removed(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code = (
        "import os, tempfile\n"
        "d = tempfile.mkdtemp(); open(os.path.join(d, 'f'), 'wb').write(b'12345')\n"
        "tempfile.mkstemp(prefix='moto_server-', suffix='.log')\n"
        "os.makedirs(os.path.join(tempfile.gettempdir(), 'pytest-of-me', 'kept'))\n"
        "open(os.path.join(tempfile.gettempdir(), 'pytest-of-me', 'kept', 'x'), 'w').close()\n"
        "os.makedirs(os.path.join(tempfile.gettempdir(), 'tmpabc'))\n"  # empty, other name
    )
    assert tempguard.run(python(code), parent=str(tmp_path)) == tempguard.LEAK_EXIT
    err = capfd.readouterr().err
    assert "left 4 entries in their temp folder" in err and "tmpabc  (folder, 0 bytes)" in err
    assert "moto_server-" in err and "(file, 0 bytes)" in err
    assert "(folder, 5 bytes)" in err and "pytest-of-me" in err
    assert list(tmp_path.iterdir()) == []


def test_job_timelines_go_to_the_temp_folder_and_count_as_leftovers(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that writes slurmclock timelines without its own SLURMCLOCK_DIR is caught; the
    user's own SLURMCLOCK_DIR (and ~/.cache/slurmclock) is never written."""
    mine = tmp_path / "users-own"
    monkeypatch.setenv("SLURMCLOCK_DIR", str(mine))
    parent = tmp_path / "tmp"
    parent.mkdir()
    code = (
        "import os\n"
        "d = os.environ['SLURMCLOCK_DIR']; assert d.startswith(os.environ['TMPDIR']), d\n"
        "os.makedirs(d); open(os.path.join(d, 'job-1.jsonl'), 'w').write('{}')\n"
    )
    assert tempguard.run(python(code), parent=str(parent)) == tempguard.LEAK_EXIT
    err = capfd.readouterr().err
    assert f"{tempguard.TIMELINES}  (folder, 2 bytes; job timelines: set SLURMCLOCK_DIR" in err
    assert not mine.exists() and list(parent.iterdir()) == []
    clean = "import os; assert os.environ['SLURMCLOCK_DIR'].startswith(os.environ['TMPDIR'])"
    assert tempguard.run(python(clean), parent=str(parent)) == 0


def test_a_failing_command_keeps_its_folder_and_exit_code(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code = "import tempfile, sys; tempfile.mkdtemp(); sys.exit(3)"
    assert tempguard.run(python(code), parent=str(tmp_path)) == 3
    (kept,) = tmp_path.iterdir()
    assert kept.name.startswith(tempguard.PREFIX) and len(list(kept.iterdir())) == 1
    assert f"kept: {kept}" in capfd.readouterr().err


def test_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempguard.tempfile, "tempdir", str(tmp_path))
    assert tempguard.main(["--", *python("pass")]) == 0
    assert tempguard.main([]) == 2
    assert os.listdir(tmp_path) == []
