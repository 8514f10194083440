"""When did this allocation start? For "allocation start -> first step" (start-up cost) reports."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from slurmclock.commands import CommandError, Runner, default_runner
from slurmclock.deadline import parse_time, process_start_time
from slurmclock.job import job_id as _job_id

__all__ = ["AllocationStart", "allocation_start"]

log = logging.getLogger("slurmclock")

_NOT_A_TIME = {"", "n/a", "unknown", "none", "(null)"}


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
) -> AllocationStart:
    """The start of the current allocation (after a requeue: of this run, not the first).

    Sources in order: ``SLURM_JOB_START_TIME`` (set by newer SLURM; not 22.05), ``squeue -h -o
    %S -j $SLURM_JOB_ID`` (one call to the controller), the start of this process. Never raises:
    problems are logged and the next source answers.
    """
    e = os.environ if env is None else env
    raw = e.get("SLURM_JOB_START_TIME", "").strip()
    if raw:
        try:
            return AllocationStart(parse_time(raw), "SLURM_JOB_START_TIME")
        except ValueError as err:
            log.warning("ignoring SLURM_JOB_START_TIME: %s", err)
    job = _job_id(e)
    if job is not None:
        found = _from_squeue(job, default_runner if runner is None else runner, timeout)
        if found is not None:
            return AllocationStart(found, "squeue")
    return AllocationStart(process_start_time(), "process")


def _from_squeue(job: str, runner: Runner, timeout: float) -> float | None:
    try:
        out = runner(["squeue", "-h", "-o", "%S", "-j", job], timeout)
    except CommandError as err:
        log.warning("squeue failed for job %s (start time): %s", job, err)
        return None
    except Exception as err:  # a custom runner's bug must not crash a training run
        log.warning("squeue runner raised %s: %s", type(err).__name__, err)
        return None
    text = next((ln.strip() for ln in out.splitlines() if ln.strip()), "")
    if text.lower() in _NOT_A_TIME:
        log.warning("squeue gives job %s no start time (%r)", job, text)
        return None
    try:
        return parse_time(text)
    except ValueError as err:
        log.warning("cannot read squeue's start time for job %s: %s", job, err)
        return None
