"""examples/slurm/requeue-on-75.sh without SLURM: how it finds slurmclock (PATH, beside the
command's python, $SLURMCLOCK) and the one line when it cannot; shellcheck. Its requeue under a
real SLURM is in test_examples.py (own_loop) and e2e/ (the fault matrix)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "slurm" / "requeue-on-75.sh"
VENV_BIN = Path(sys.executable).parent
FAKE_SRUN = """#!/bin/bash
# Runs the task command once, as a 1-task srun would.
while [ $# -gt 0 ] && [[ $1 == --* ]]; do shift; done
exec "$@"
"""


def run(tmp_path: Path, *command: str, path: str, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMCLOCK"))}
    base.update(PATH=f"{bin_dir}{os.pathsep}{path}", SLURM_JOB_ID="77", **env)
    base["SLURMCLOCK_DIR"] = str(tmp_path / "timelines")
    return subprocess.run(
        ["bash", str(SCRIPT), *command],
        capture_output=True,
        text=True,
        timeout=120,
        env=base,
        cwd=tmp_path,
    )


def path_without_slurmclock() -> str:
    return os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != str(VENV_BIN)
    )


def test_without_slurmclock_it_says_one_line_and_runs_nothing(tmp_path: Path) -> None:
    if shutil.which("python3", path=path_without_slurmclock()) is None:
        pytest.skip("no python3 outside the venv")
    r = run(tmp_path, "python3", "-c", "open('ran', 'w')", path=path_without_slurmclock())
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if "slurmclock not found" in line]
    assert len(lines) == 1, r.stdout
    assert "activate its environment before sbatch" in lines[0]
    assert "SLURMCLOCK=/path/to/slurmclock" in lines[0]
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("how", ["python-path", "SLURMCLOCK"])
def test_it_finds_slurmclock_beside_the_python_or_from_the_variable(
    tmp_path: Path, how: str
) -> None:
    env = {"SLURMCLOCK": str(VENV_BIN / "slurmclock")} if how == "SLURMCLOCK" else {}
    python = sys.executable if how == "python-path" else "python3"
    path = path_without_slurmclock()
    if how == "SLURMCLOCK" and shutil.which("python3", path=path) is None:
        pytest.skip("no python3 outside the venv")
    r = run(tmp_path, python, "-c", "raise SystemExit(0)", path=path, **env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "requeue-on-75: training step exited with status 0" in r.stdout
    assert "requeue-on-75: training finished" in r.stdout


def test_the_script_passes_shellcheck() -> None:
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    r = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
