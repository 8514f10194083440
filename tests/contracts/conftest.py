"""What the contract tests share: SLURM's client commands faked on PATH (the supervisor runs
them; no cluster is needed to see what one package wrote and the other read), and the
environment of a process inside a batch job."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

# scontrol, sinfo and scancel in one: every call is appended to $FAKE_DIR/calls.log; `scontrol
# show job` prints $FAKE_JOB, `show hostnames` its argument's names, sinfo $FAKE_SINFO.
FAKE_SLURM = r"""#!/bin/bash
echo "$(basename "$0") $*" >> "$FAKE_DIR/calls.log"
case "$(basename "$0") ${1:-} ${2:-}" in
    "scontrol show job") echo "$FAKE_JOB" ;;
    "scontrol show hostnames") echo "$3" | tr ',' '\n' ;;
    "scontrol show config") echo "ClusterName = $FAKE_CLUSTER" ;;
    "sinfo "*) printf '%b' "$FAKE_SINFO" ;;
esac
exit 0
"""


@dataclass(frozen=True)
class Job:
    """A batch job as its processes see it: ``env`` for the supervisor and the step, ``dir``
    the job's timeline folder, ``calls`` what the fake SLURM commands were asked."""

    id: str
    env: dict[str, str]
    dir: Path

    @property
    def calls(self) -> list[str]:
        log = self.dir / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    @property
    def timeline(self) -> Path:
        return self.dir / f"{self.env['SLURM_CLUSTER_NAME']}-{self.id}.jsonl"


def new_job(folder: Path) -> Job:
    """Job 4242 on cluster "ci", one node (this host), with SLURM's commands faked; its
    timeline, the fake commands' log and their folder in ``folder``."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "fake-slurm"
    fake.write_text(FAKE_SLURM)
    fake.chmod(0o755)
    for name in ("scontrol", "sinfo", "scancel"):
        (bin_dir / name).symlink_to(fake)
    host = os.uname().nodename
    launchers = ("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_", "OMPI_", "PMI", "PYRECOVER_")
    env = {k: v for k, v in os.environ.items() if not k.startswith((*launchers, "DDPKIT_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(
        PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]]),
        SLURM_JOB_ID="4242",
        SLURM_CLUSTER_NAME="ci",
        SLURM_JOB_NODELIST=host,
        SLURM_RESTART_COUNT="0",
        SLURMCLOCK_DIR=str(folder),
        FAKE_DIR=str(folder),
        FAKE_CLUSTER="ci",
        FAKE_JOB=f"JobId=4242 JobState=RUNNING Reason=None Restarts=0 Partition=p "
        f"NodeList={host} NumNodes=1 ExcNodeList=(null)",
        FAKE_SINFO=f"{host} alloc\\nspare1 idle\\n",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return Job("4242", env, folder)


@pytest.fixture
def job(tmp_path: Path) -> Job:
    return new_job(tmp_path)


@pytest.fixture(scope="session")
def make_job() -> Callable[[Path], Job]:
    """:func:`new_job`, for a fixture of a wider scope."""
    return new_job
