"""When did this allocation start? For "allocation start -> first step" (start-up cost) reports."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from slurmclock.commands import CommandError, Runner
from slurmclock.deadline import process_start_time
from slurmclock.durations import parse_time
from slurmclock.job import Scheduler, variables
from slurmclock.job import job_id as _job_id
from slurmclock.schedulers import default_scheduler

__all__ = ["AllocationStart", "allocation_start"]

log = logging.getLogger("slurmclock")


@dataclass(frozen=True, slots=True)
class AllocationStart:
    """``at`` (epoch seconds) and who said so: ``SLURM_JOB_START_TIME``, ``squeue`` or
    ``process`` (this process's start: outside SLURM, or when SLURM did not answer)."""

    at: float
    source: str

    def seconds_since(self, now: float) -> float:
        return now - self.at


def allocation_start(
    *,
    env: Mapping[str, str] | None = None,
    runner: Runner | None = None,
    timeout: float = 10.0,
    scheduler: Scheduler | None = None,
) -> AllocationStart:
    """The start of the current allocation (after a requeue: of this run, not the first).

    Sources in order: ``SLURM_JOB_START_TIME`` (set by newer SLURM; not 22.05), the scheduler
    (``squeue -h -o %S -j $SLURM_JOB_ID``: one call to the controller), the start of this
    process. Never raises: problems are logged and the next source answers.
    """
    e = os.environ if env is None else env
    name = variables(e).start_time
    raw = e.get(name, "").strip()
    if raw:
        try:
            return AllocationStart(parse_time(raw), name)
        except ValueError as err:
            log.warning("ignoring %s: %s", name, err)
    job = _job_id(e)
    if job is not None:
        asked = default_scheduler(runner, env=e) if scheduler is None else scheduler
        try:
            return AllocationStart(asked.start_time(job, timeout=timeout), "squeue")
        except CommandError as err:
            if err.kind in ("output", "error"):  # the message says what came back
                log.warning("%s", err)
            else:
                log.warning("%s failed for job %s (start time): %s", err.argv[0], job, err)
    return AllocationStart(process_start_time(), "process")
