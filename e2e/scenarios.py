"""Drivers of the long SLURM scenarios: they act on the jobs and record what happened; the
tests assert. Each runs in a background thread from the session's start (see conftest)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2e_helpers import (
    TIME_LIMIT_MIN,
    Job,
    JobRecord,
    last_step,
    trainer_flags,
    wait_until,
)

# The preemption scenario's run: long enough (tens of seconds) for three interventions mid-run.
PREEMPT_STEPS = 2000


def preempt_flags(corpus: Path, cache: Path, ckpt: Path) -> list[str]:
    return trainer_flags(corpus, cache, ckpt, PREEMPT_STEPS, 100, "--log-every", "10")


def drive_time_limit(job: Job, flags: list[str]) -> JobRecord:
    """The shipped script with only `--time` changed: no --stop-margin, no --signal override (its
    USR2@300 comes at once in a 3-minute job). The job goes round allocations until done."""
    record = job.submit([f"--time={TIME_LIMIT_MIN}"], flags)
    return job.finish(record, timeout=2400)


def drive_preemption(job: Job, flags: list[str]) -> JobRecord:
    """What real preemption and a user do to a job with plenty of time left, each mid-run:
    (1) `scontrol requeue` -- what preemption in REQUEUE mode does: SIGTERM to every process of
    the job, SIGKILL KillWait = 5 s later, and the job goes back to the queue by itself; (2) in
    the requeued run, a SIGUSR2 to the batch shell that says the end comes earlier than SLURM's
    end time (a preemption notice): the deadline moves, the run trains on; (3) `slurmclock stop
    JOBID`: save and stop for good, not requeued; (4) the user resubmits with --continue."""
    record = job.submit(["--time=10"], flags)
    at = PREEMPT_STEPS // 6

    def run_at(index: int, step: int) -> Callable[[], bool]:
        return lambda: last_step(job.metrics, run_index=index) >= step

    wait_until(f"{job.name}: step {at}", run_at(0, at), timeout=600)
    record.notes["requeue_after_step"] = last_step(job.metrics, run_index=0)
    job.cluster.run(["scontrol", "requeue", job.id])

    wait_until(f"{job.name}: the requeued run at step {2 * at}", run_at(1, 2 * at), timeout=600)
    record.notes["usr2_after_step"] = last_step(job.metrics, run_index=1)
    job.cluster.run(["scancel", "--batch", "--signal=USR2", job.id])
    wait_until(f"{job.name}: the notice read", lambda: "using the earlier end" in job.log(), 120)
    wait_until(f"{job.name}: step {3 * at}", run_at(1, 3 * at), timeout=600)
    record.notes["stop_after_step"] = last_step(job.metrics, run_index=1)
    record.notes["stop_said"] = job.cluster.run(["slurmclock", "stop", job.id]).stdout
    first = job.finish(record, timeout=600)
    again = job.submit(["--time=10"], ["--continue", *flags])
    again.notes = {**first.notes, "first": first}
    return job.finish(again, timeout=600)


def drive_distributed(job: Job, corpus: Path, cache: Path) -> dict[str, Any]:
    """``srun -n 2`` (gloo, DCP) stopped by SLURM's time limit and not requeued; then the same
    experiment resumed by a 1-task job: DCP reshards 2 -> 1, the data continues at the global
    position the two ranks reached together."""
    flags = trainer_flags(corpus, cache, Path("ckpt"), 3000, 100, "--log-every", "10")
    # The shipped defaults: no --stop-margin, the script's own --signal=B:USR2@300.
    two = job.submit(
        ["--time=1", "--ntasks-per-node=2"],  # the script asks for 1
        ["--distributed", "--use_torch_distributed_ckpt", *flags],
        PYRECOVER_CHAIN="1",  # this job only stops; the next job resumes (as in a chain)
        MASTER_ADDR="127.0.0.1",  # the test node's name does not resolve; a real one does
    )
    job.finish(two, timeout=600)
    # The rest of 3000 steps on one process: ~1 minute on a quiet machine, several under the
    # load of the other scenarios; the slot must hold them all, or the job is requeued.
    one = job.submit(
        ["--time=15", "--ntasks=1"], ["--continue", "--use_torch_distributed_ckpt", *flags]
    )
    job.finish(one, timeout=1200)
    return {"two": two, "one": one, "metrics": job.metrics, "ckpt": job.ckpt / job.name}
