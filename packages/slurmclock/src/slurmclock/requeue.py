"""Self-requeue: put this job back in the queue so it resumes from its checkpoint."""

from __future__ import annotations

import logging
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slurmclock.commands import CommandError, Runner, last_line
from slurmclock.durations import check_seconds
from slurmclock.job import Scheduler, check_job_id, restart_count
from slurmclock.job import job_id as _job_id
from slurmclock.schedulers import default_scheduler

if TYPE_CHECKING:
    from slurmclock.timeline import JobTimeline

__all__ = ["RequeueResult", "requeue"]

log = logging.getLogger("slurmclock")


@dataclass(frozen=True, slots=True)
class RequeueResult:
    """``ok`` when SLURM accepted the requeue; ``message`` says what happened and what to do."""

    ok: bool
    message: str
    job_id: str | None = None

    def __bool__(self) -> bool:
        return self.ok


def requeue(
    job_id: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    runner: Runner | None = None,
    timeout: float = 30.0,
    timeline: JobTimeline | None = None,
    scheduler: Scheduler | None = None,
) -> RequeueResult:
    """Run ``scontrol requeue JOB`` (JOB defaults to ``$SLURM_JOB_ID``); never raises (but for
    a ``timeout`` that is not a finite number of seconds > 0: ValueError).

    Call it last, after the final checkpoint is durable: SLURM ends the running job soon after
    (SIGTERM to every process of the job, SIGKILL ``KillWait`` seconds later) and starts it again
    with ``SLURM_RESTART_COUNT`` one higher. The SIGTERM may arrive before this function returns:
    keep :class:`~slurmclock.StopSignals` installed (or SIGTERM ignored) across the call so it
    only raises the flag, then log the message and exit. (``slurmclock requeue`` ignores SIGTERM
    itself.) If scontrol is killed by that signal, the result says the requeue is unconfirmed.
    With a ``timeline``, an accepted (or unconfirmed) requeue is marked ``requeued`` there, so the
    next allocation knows how long the end of this one took. ``scheduler`` requeues (default:
    :class:`slurmclock.slurm.Slurm` through ``runner``).
    """
    timeout = check_seconds("timeout", timeout, positive=True)
    try:
        job = check_job_id(job_id, "job_id") if job_id is not None else _job_id(env)
    except ValueError as e:
        return RequeueResult(False, f"not requeued: {e}")
    if not job:
        return RequeueResult(
            False, "not requeued: not in a SLURM job (SLURM_JOB_ID is unset); pass the job id"
        )
    asked = default_scheduler(runner, env=env) if scheduler is None else scheduler
    killed = False  # scontrol killed by a signal: most likely SLURM accepted and is ending us
    try:
        asked.requeue(job, timeout=timeout)
    except CommandError as e:
        killed = e.kind == "failed" and e.returncode is not None and e.returncode < 0
        result = RequeueResult(False, _explain(job, e), job)
    else:
        n = restart_count(env) if job_id is None else None
        then = f" (restart {n + 1})" if n is not None else ""
        result = RequeueResult(
            True, f"requeued job {job}{then}; SLURM now ends this run and starts it again", job
        )
    log.info("%s", result.message)  # the caller decides how loud a failure is
    if timeline is not None and (result.ok or killed):
        timeline.mark("requeued", confirmed=result.ok)
    return result


def _explain(job: str, e: CommandError) -> str:
    text = last_line(e.stderr) or str(e)  # one line; the whole output for the checks below
    low = f"{e.stderr} {e}".lower()
    if e.kind == "missing":
        return (
            f"not requeued: job {job}: scontrol not found on PATH (inside a container?); requeue "
            f"from the batch script instead: scontrol requeue {job}"
        )
    if e.kind == "error":  # an injected runner's bug: its own words
        return f"not requeued: job {job}: {e}"
    if e.kind == "failed" and e.returncode is not None and e.returncode < 0:
        try:
            name = signal.Signals(-e.returncode).name
        except ValueError:
            name = f"signal {-e.returncode}"
        return (
            f"requeue of job {job} not confirmed: scontrol was killed by {name} before it "
            "answered -- most likely SLURM is ending this run because the requeue was accepted; "
            f"`scontrol show job {job}` shows Restarts= one higher if so"
        )
    if e.kind == "timeout":
        return f"not requeued: job {job}: scontrol requeue timed out (controller busy?): {text}"
    if "disabled" in low:
        return (
            f"not requeued: job {job} is not requeueable (submitted with --no-requeue, or "
            "JobRequeue=0 in slurm.conf); submit it with `#SBATCH --requeue`"
        )
    if "invalid job id" in low:
        return f"not requeued: SLURM does not know job {job} (finished, or another cluster?)"
    if "access" in low or "permission" in low or "not authorized" in low:
        return f"not requeued: job {job}: permission denied by SLURM: {text}"
    return f"not requeued: job {job}: {text}"
