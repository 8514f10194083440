"""Who this process is, read by two packages that may not import each other: ddpkit's launcher
detection (rank, world, process group) and slurmclock's ``global_rank`` (who leads: writes the
job's timeline, watches the clock). Every launcher ddpkit knows must give the same rank in
both, or under that launcher every rank leads (DESIGN.md, "Seams": a new launcher)."""

from __future__ import annotations

import pytest

import ddpkit
import slurmclock
from ddpkit.mpi import FAMILIES, Family

# What the launchers ddpkit detects outside its table export, rank 3 of 4.
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
SRUN = {"SLURM_PROCID": "3", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"}
SRUN |= {"SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2"}
SLURM_JOB = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]", "MASTER_PORT": "29400"}


def family_env(fam: Family, rank: int) -> dict[str, str]:
    """What ``fam``'s launcher exports, inside a batch job: its ranks also inherit the batch
    shell's ``SLURM_PROCID=0``."""
    env = {fam.rank: str(rank), fam.size: "4", fam.local_rank[0]: str(rank % 2)}
    return env | {fam.local_size[0]: "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}


def launches() -> list[tuple[str, dict[str, str], dict[str, str]]]:
    """(launcher, the environment of rank 3, of rank 0) of every launcher ddpkit detects."""
    out = [("torchrun", TORCHRUN, {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"})]
    out.append(("srun", SRUN, {**SRUN, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}))
    out += [(f.launcher, family_env(f, 3), family_env(f, 0)) for f in FAMILIES]
    return out


LAUNCHES = launches()


def test_every_launcher_ddpkit_detects_is_tested_here() -> None:
    named = {name for name, _, _ in LAUNCHES} | {"single"}
    assert named == set(ddpkit.env.LAUNCHERS)


@pytest.mark.parametrize(("launcher", "rank3", "rank0"), LAUNCHES, ids=[n for n, *_ in LAUNCHES])
def test_ddpkit_and_slurmclock_read_the_same_rank(
    launcher: str, rank3: dict[str, str], rank0: dict[str, str]
) -> None:
    info = ddpkit.detect({**SLURM_JOB, **rank3})
    assert (info.launcher, info.rank) == (launcher, 3)
    assert slurmclock.job.global_rank(rank3) == 3
    assert not slurmclock.is_leader(env=rank3)
    assert ddpkit.detect({**SLURM_JOB, **rank0}).rank == 0 and slurmclock.is_leader(env=rank0)
