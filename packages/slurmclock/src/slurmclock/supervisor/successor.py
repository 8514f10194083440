"""The next allocation as a new job: ``sbatch --dependency=afterany:JOB`` of the same batch
script and arguments, submitted at the stop, instead of ``scontrol requeue``.

Why: SLURM holds a requeued job ``cred_expire`` + 1 s before it may start again (121 s at
SLURM's default, measured on SLURM 22.05) and resets its submit time. A successor that depends on
this job (``afterany``: whatever way this one ends) is eligible the moment this job has ended and
starts at the scheduler's next pass when the nodes are free (``bench/queue_replay.py``, idle
cluster: the next allocation's first step ~1 s + start-up after the stop). It asks for nothing a
requeue does not: one pending job per chain, submitted once per allocation.

The chain is bounded like requeues: ``SLURMCLOCK_CHAIN_INDEX`` (exported to the successor, one
higher each time) counts its allocations against ``--max-restarts``. ``--time-min``: the
successor asks for ``time_min`` minutes, raised to what the measured start-up, a final save and
:data:`FLOOR_STEPS` steps need (one line says so): an allocation shorter than that trains
nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slurmclock.chain import CHAIN_ID, CHAIN_INDEX, chain_id, chain_index
from slurmclock.commands import CommandError, Runner, SubprocessRunner, last_line
from slurmclock.supervisor.history import RestartCost

__all__ = [
    "CHAIN_INDEX",
    "FLOOR_STEPS",
    "Successor",
    "chain_index",
    "successor_argv",
    "submit_successor",
    "time_min_floor",
]

FLOOR_STEPS = 20  # an allocation must hold start-up, a save and this many steps


@dataclass(frozen=True, slots=True)
class Successor:
    """``ok`` when SLURM took the successor (``job_id``); ``message``: one line for the log."""

    ok: bool
    message: str
    job_id: str | None = None


def time_min_floor(cost: RestartCost, *, guess: float) -> int:
    """Whole minutes an allocation needs to train at all: the measured start-up (``guess``
    before one is measured), :data:`FLOOR_STEPS` steps and a final save."""
    return max(1, math.ceil(cost.seconds(guess=guess, steps=FLOOR_STEPS) / 60))


def successor_argv(
    job: str,
    command: Sequence[str],
    *,
    index: int,
    time_min: int | None,
    exports: Mapping[str, str] | None = None,
    early: bool = False,
    chain: str | None = None,
) -> list[str]:
    """``sbatch`` of ``command`` (sbatch options, then the script and its arguments) after
    ``job`` ends (``early``: no dependency, it pends while ``job`` runs), exporting the chain's
    id and next index and ``exports`` (values without commas)."""
    more = "".join(f",{k}={v}" for k, v in (exports or {}).items())
    after = [] if early else [f"--dependency=afterany:{job}", "--kill-on-invalid-dep=yes"]
    ids = f"{CHAIN_INDEX}={index + 1},{CHAIN_ID}={chain or job}"  # slurmclock.chain
    argv = ["sbatch", "--parsable", *after, f"--export=ALL,{ids}{more}"]
    if time_min is not None:
        argv.append(f"--time-min={time_min}")
    return [*argv, *command]


def submit_successor(
    job: str,
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    max_chain: int,
    time_min: int | None = None,
    floor: int | None = None,
    runner: Runner | None = None,
    timeout: float = 30.0,
    exports: Mapping[str, str] | None = None,
    early: bool = False,
) -> Successor:
    """Submit the successor of ``job``; never raises. ``time_min`` is raised to ``floor``;
    ``exports`` and ``early``: as :func:`successor_argv`."""
    index = chain_index(env)
    if index >= max_chain:
        return Successor(
            False, f"no successor: the chain already had {index + 1} allocations (max restarts)"
        )
    said = ""
    if time_min is not None and floor is not None and time_min < floor:
        said = (
            f" (--time-min {time_min} min raised to {floor} min: the measured start-up, a save "
            f"and {FLOOR_STEPS} steps)"
        )
        time_min = floor
    argv = successor_argv(
        job,
        command,
        index=index,
        time_min=time_min,
        exports=exports,
        early=early,
        chain=chain_id(env),
    )
    run = SubprocessRunner() if runner is None else runner
    try:
        out = run(argv, timeout)
    except CommandError as e:
        why = last_line(e.stderr) or str(e)
        return Successor(False, f"no successor: sbatch failed: {why}")
    new = last_line(out).split(";")[0].strip()
    if not new.isdigit():
        return Successor(False, f"no successor: sbatch answered {new[:80]!r}, not a job id")
    when = (
        "now: it waits in the queue while this job trains"
        if early
        else (f"to resume after job {job} ends (no requeue hold)")
    )
    return Successor(True, f"submitted job {new} {when}{said}", new)
