"""tools/tempguard.py: a test run that leaves something in its temp folder fails, by name."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
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
    assert kept.name.startswith(tempguard.FAILED) and len(list(kept.iterdir())) == 1
    assert len(tempguard.owned_name(4_194_304)) <= len("tg-XXXXXXXX") + 1  # pid_max: short
    assert f"kept: {kept} (the newest 3 failed runs' are" in capfd.readouterr().err


def test_killed_runs_folders_go_and_failed_runs_folders_are_bounded(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 24: failing and interrupted sessions left 137-163 MB folders in /tmp, run after
    run. The next run removes a killed run's folder (its tempguard is gone, nothing runs in it)
    and keeps only the newest KEEP_FAILED failed runs' folders."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is no process now
    dead, live = tempguard.owned_name(gone.pid), tempguard.owned_name(os.getpid())
    (tmp_path / dead).mkdir()
    (tmp_path / dead / "big").write_bytes(b"x" * 1000)
    (tmp_path / live).mkdir()  # its tempguard (this process) runs
    (tmp_path / "tg-abcdefgh").mkdir()  # an older tempguard's: it may still run, left alone
    failed = [f"{tempguard.FAILED}2026010{i}-120000-{i}" for i in range(5)]
    for name in failed:
        (tmp_path / name).mkdir()
    assert tempguard.run(python("pass"), parent=str(tmp_path)) == 0
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([*failed[-3:], live, "tg-abcdefgh"])
    err = capfd.readouterr().err
    assert f"removed the temp folder of a killed run: {tmp_path}/{dead}" in err
    assert err.count("removed an older failed run's temp folder") == 2


def start_guarded(tmp_path: Path, code: str) -> subprocess.Popen[str]:
    """tempguard running ``code`` in a subprocess, its temp folder under tmp_path/parent; returns
    once the command wrote tmp_path/ready."""
    (tmp_path / "parent").mkdir()
    guard = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "tempguard.py"), "--", *python(code)],
        env={**os.environ, "TMPDIR": str(tmp_path / "parent")},
        stderr=subprocess.PIPE,
        text=True,
    )
    end = time.monotonic() + 120
    while not (tmp_path / "ready").exists():
        assert guard.poll() is None and time.monotonic() < end, guard.stderr
        time.sleep(0.05)
    return guard


COUNT_SIGINTS = """
import os, signal, sys, tempfile, time
seen = []
signal.signal(signal.SIGINT, lambda *a: seen.append(1))
open(os.path.join(tempfile.gettempdir(), "work"), "w").close()
open(sys.argv[1] if len(sys.argv) > 1 else {ready!r}, "w").close()
end = time.monotonic() + 60
while not seen and time.monotonic() < end:
    time.sleep(0.05)
time.sleep(1.5)  # the repeats of a Ctrl-C (terminal, nox) would come now
open({count!r}, "w").write(str(len(seen)))
sys.exit(2)  # as pytest after an interrupt
"""


def test_an_interrupt_reaches_the_command_once_and_the_folder_goes(tmp_path: Path) -> None:
    """Ctrl-C under nox: SIGINT from the terminal (pressed twice), SIGTERM from nox, all within
    half a second. The command (pytest) gets one SIGINT -- a second would cut its teardown --
    and the temp folder is removed once it has stopped."""
    code = COUNT_SIGINTS.format(ready=str(tmp_path / "ready"), count=str(tmp_path / "count"))
    guard = start_guarded(tmp_path, code)
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
        guard.send_signal(sig)
        time.sleep(0.1)
    _, err = guard.communicate(timeout=120)
    assert guard.returncode == 2 and (tmp_path / "count").read_text() == "1", err
    assert "interrupted; removed its temp folder" in err
    assert list((tmp_path / "parent").iterdir()) == []


def test_a_killed_tempguard_leaves_the_folder_to_its_janitor(tmp_path: Path) -> None:
    """nox SIGKILLs tempguard half a second after a Ctrl-C. The command goes on to its end
    (its own process group); the janitor removes the folder once nothing runs in it."""
    code = (
        "import os, tempfile, time\n"
        "open(os.path.join(tempfile.gettempdir(), 'work'), 'w').close()\n"
        f"open({str(tmp_path / 'ready')!r}, 'w').close()\n"
        f"time.sleep(3); open({str(tmp_path / 'done')!r}, 'w').close()\n"
    )
    guard = start_guarded(tmp_path, code)
    (folder,) = (tmp_path / "parent").iterdir()
    guard.kill()
    guard.wait(timeout=60)
    assert guard.stderr is not None
    guard.stderr.close()
    assert (folder / "work").exists() and not (tmp_path / "done").exists()  # it still runs
    end = time.monotonic() + 120
    while folder.exists() and time.monotonic() < end:
        time.sleep(0.2)
    assert not folder.exists() and (tmp_path / "done").exists()


def test_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempguard.tempfile, "tempdir", str(tmp_path))
    assert tempguard.main(["--", *python("pass")]) == 0
    assert tempguard.main([]) == 2
    assert os.listdir(tmp_path) == []
