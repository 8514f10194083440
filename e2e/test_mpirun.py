"""Scenario 6 of issue 21: ``mpirun -n 2`` (Debian's openmpi-bin) trains two ranks of one
job -- not two trainings of one rank each -- and ends bitwise equal to ``torchrun
--nproc-per-node 2`` on the same configuration (CPU, gloo)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import events, one, trainer_flags
from train_helpers import assert_bitwise_equal, child_env, final_state, run_torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

STEPS, EVERY = 40, 10
# Variables an enclosing MPI launch would leave in this process's environment.
_MPI_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "MV2_", "PALS_", "HYDRA_")


def mpirun_argv(n: int, args: list[str]) -> list[str]:
    exe = shutil.which("mpirun")
    if exe is None:
        if os.environ.get("PYRECOVER_REQUIRE_MPI") == "1":
            pytest.fail("PYRECOVER_REQUIRE_MPI=1 but mpirun is not installed")
        pytest.skip("mpirun not installed (apt-get install openmpi-bin)")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [
        exe,
        "-n",
        str(n),
        *root,
        "--oversubscribe",
        sys.executable,
        "-m",
        "pyrecover_train",
    ] + args


def test_mpirun_trains_two_ranks_bitwise_equal_to_torchrun(
    corpus: Path, cache_dir: Path, tmp_path: Path, figures: dict[str, Any]
) -> None:
    """6. mpirun -n 2: two ranks, bitwise equal to torchrun"""
    by_mpirun, by_torchrun = tmp_path / "mpirun", tmp_path / "torchrun"
    flags = ["--distributed", "--log-every", "10"]
    scratch = tmp_path / "mpi-tmp"  # mpirun's session folder: not left in the system's /tmp
    scratch.mkdir()
    env = {
        k: v for k, v in child_env(TMPDIR=str(scratch)).items() if not k.startswith(_MPI_PREFIXES)
    }
    t0 = time.monotonic()
    mpi = subprocess.run(
        mpirun_argv(2, [*trainer_flags(corpus, cache_dir, by_mpirun, STEPS, EVERY), *flags]),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    mpi_s = time.monotonic() - t0
    assert mpi.returncode == 0, mpi.stdout + mpi.stderr
    t0 = time.monotonic()
    ref = run_torchrun([*trainer_flags(corpus, cache_dir, by_torchrun, STEPS, EVERY), *flags])
    torchrun_s = time.monotonic() - t0
    assert ref.returncode == 0, ref.stdout + ref.stderr

    # One training of two ranks: one metrics stream (rank 0's), a world of 2, every step once.
    run = events(by_mpirun / "default-exp" / "metrics.jsonl")
    assert one(run, "start")["world_size"] == 2, one(run, "start")
    steps = [e["step"] for e in run if e["event"] == "step"]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS, steps
    manifest, got = final_state(by_mpirun)
    assert manifest.step == STEPS and manifest.world_size == 2
    _, want = final_state(by_torchrun)
    assert_bitwise_equal(want, got)
    figures["mpirun"] = f"{mpi_s:.0f} s"
    figures["torchrun"] = f"{torchrun_s:.0f} s"
    figures["bitwise"] = "equal"
