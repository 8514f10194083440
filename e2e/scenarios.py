"""Drivers of the long SLURM scenarios: they act on the jobs and record what happened; the
tests assert. Each runs in a background thread from the session's start (see conftest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from e2e_helpers import Job, JobRecord, last_step, runs, trainer_flags, wait_until


def drive_time_limit(job: Job, flags: list[str], margin: int) -> JobRecord:
    """SLURM's minimum time limit; the job goes round allocations by itself until done."""
    # The script asks for a 300 s warning, longer than the whole job: ask for SLURM's shortest
    # (it arrives 5..35 s before the end, as SLURM's timer ticks every 30 s).
    record = job.submit(["--time=1", "--signal=B:USR2@5"], [*flags, "--stop-margin", str(margin)])
    return job.finish(record, timeout=1500)


def drive_preemption(job: Job, flags: list[str], steps: int) -> JobRecord:
    """Two interruptions mid-step of a job with plenty of time: SLURM's warning signal to the
    batch shell, then a preemption-style requeue (SIGTERM to every process of the job, SIGKILL
    KillWait = 5 s later)."""
    record = job.submit(["--time=10"], flags)
    first_at = steps // 6

    wait_until(
        f"{job.name}: step {first_at}",
        lambda: last_step(job.metrics, run_index=0) >= first_at,
        timeout=600,
    )
    record.notes["usr2_sent_after_step"] = last_step(job.metrics, run_index=0)
    job.cluster.run(["scancel", "--batch", "--signal=USR2", job.id])

    def second_run_going() -> bool:
        rs = runs(job.metrics)
        return len(rs) >= 2 and last_step(job.metrics, run_index=1) >= 2 * first_at

    wait_until(f"{job.name}: the requeued run at step {2 * first_at}", second_run_going, 600)
    record.notes["requeue_sent_after_step"] = last_step(job.metrics, run_index=1)
    job.cluster.run(["scontrol", "requeue", job.id])
    return job.finish(record, timeout=900)


def drive_distributed(job: Job, corpus: Path, cache: Path) -> dict[str, Any]:
    """``srun -n 2`` (gloo, DCP) stopped by SLURM's time limit and not requeued; then the same
    experiment resumed by a 1-task job: DCP reshards 2 -> 1, the data continues at the global
    position the two ranks reached together."""
    flags = trainer_flags(
        corpus, cache, Path("ckpt"), 3000, 100, "--log-every", "10", "--stop-margin", "30"
    )
    two = job.submit(
        ["--time=1", "--signal=B:USR2@5", "--ntasks-per-node=2"],  # the script asks for 1
        ["--distributed", "--use_torch_distributed_ckpt", *flags],
        REQUEUE="0",  # this job only stops; the next job resumes (as an array task would)
        MASTER_ADDR="127.0.0.1",  # the test node's name does not resolve; a real one does
    )
    job.finish(two, timeout=600)
    # The script's 300 s warning would arrive at once in a 5-minute job: ask for a short one.
    one = job.submit(
        ["--time=5", "--signal=B:USR2@5", "--ntasks=1"],
        ["--continue", "--use_torch_distributed_ckpt", *flags],
    )
    job.finish(one, timeout=600)
    return {"two": two, "one": one, "metrics": job.metrics, "ckpt": job.ckpt / job.name}
