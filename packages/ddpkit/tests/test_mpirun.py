"""Under a real Open MPI ``mpirun`` (Debian's openmpi-bin): the ranks join one gloo group (not N
worlds of one), and the watchdog ends the run when one of them is killed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("_watchdog_child.py")
START_S = 180


def mpirun(n: int, *argv: str) -> list[str]:
    exe = shutil.which("mpirun")
    if exe is None:
        if os.environ.get("PYRECOVER_REQUIRE_MPI") == "1":
            pytest.fail("PYRECOVER_REQUIRE_MPI=1 but mpirun is not installed")
        pytest.skip("mpirun not installed (apt-get install openmpi-bin)")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    # --oversubscribe: more ranks than cores is fine for gloo on CPU.
    return [exe, "-n", str(n), *root, "--oversubscribe", sys.executable, *argv]


def mpi_env(launch: Any, tmp: Path, **extra: str) -> dict[str, str]:
    # mpirun's session folder goes to TMPDIR: the test's own, so nothing is left in /tmp.
    return launch.clean_env(TMPDIR=str(tmp), **extra)


def test_ddpkit_check_under_mpirun_is_one_world_of_two(launch: Any, tmp_path: Path) -> None:
    argv = mpirun(2, "-m", "ddpkit", "check", "--json", "--timeout", "60")
    out = subprocess.run(
        argv, env=mpi_env(launch, tmp_path), capture_output=True, text=True, timeout=START_S
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = sorted(
        (json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")),
        key=lambda d: d["rank"],
    )
    assert [(d["rank"], d["world_size"], d["launcher"]) for d in lines] == [
        (0, 2, "openmpi"),
        (1, 2, "openmpi"),
    ]
    assert all(d["sum"] == 3 and d["ok"] and d["backend"] == "gloo" for d in lines)
    assert lines[0]["master"] == lines[1]["master"]
    assert lines[0]["master"].startswith("127.0.0.1:")  # every rank on this node
    assert [d["local_rank"] for d in lines] == [0, 1]


def test_stale_torchrun_variables_under_mpirun_are_refused(launch: Any, tmp_path: Path) -> None:
    """`mpirun -x RANK=0 -x WORLD_SIZE=1 -x LOCAL_RANK=0` (issue 30): each rank said `ok: 1
    rank(s) via torchrun`, two silent copies. Now every rank says one line and exits 2."""
    stale = ["-x", "RANK=0", "-x", "WORLD_SIZE=1", "-x", "LOCAL_RANK=0"]
    argv = mpirun(2, "-m", "ddpkit", "check", "--timeout", "60")
    argv[3:3] = stale  # after `mpirun -n 2`
    out = subprocess.run(
        argv, env=mpi_env(launch, tmp_path), capture_output=True, text=True, timeout=START_S
    )
    assert out.returncode != 0, out.stdout + out.stderr
    assert "ok:" not in out.stdout, out.stdout
    lines = [x for x in out.stderr.splitlines() if x.startswith("ddpkit: error:")]
    assert len(lines) == 2, out.stderr
    for rank, line in zip((0, 1), sorted(lines), strict=True):
        assert "RANK=0 WORLD_SIZE=1 (torchrun's variables" in line, line
        assert f"Open MPI's OMPI_COMM_WORLD_RANK={rank} OMPI_COMM_WORLD_SIZE=2" in line, line
        assert "unset RANK WORLD_SIZE LOCAL_RANK" in line, line


def test_ddpkit_info_under_mpirun(launch: Any, tmp_path: Path) -> None:
    argv = mpirun(2, "-m", "ddpkit", "info", "--json")
    out = subprocess.run(
        argv, env=mpi_env(launch, tmp_path), capture_output=True, text=True, timeout=START_S
    )
    assert out.returncode == 0, out.stdout + out.stderr
    infos = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert sorted((d["rank"], d["world_size"], d["launcher"]) for d in infos) == [
        (0, 2, "openmpi"),
        (1, 2, "openmpi"),
    ]
    assert len({d["master_port"] for d in infos}) == 1  # from mpirun's job id, on both ranks
    assert all(d["derived_port"] for d in infos)


def test_a_killed_rank_ends_mpirun(launch: Any, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = mpi_env(
        launch, tmp_path, TEST_TIMEOUT="60", DDPKIT_FAULT_FILE=str(out_dir / "faults.jsonl")
    )
    proc, out, took = launch.signal_a_rank(
        mpirun(2, str(CHILD), str(out_dir)), env, out_dir, 2, victim=1, sig="KILL"
    )
    print(f"mpirun -n 2, SIGKILL of rank 1: mpirun gone after {took:.2f} s")
    assert proc.returncode != 0, out
    assert took < 30, out  # the target for a dead rank
    assert "rank 1 on " in out and "is dead" in out, out
    (fault,) = launch.fault_lines(out_dir)
    assert (fault["rank"], fault["what"], fault["reporter"]) == (1, "dead", 0)
