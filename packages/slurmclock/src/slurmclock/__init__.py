"""SLURM job deadline, time budget, stop signals and self-requeue (stdlib only).

:class:`DeadlineWatcher` knows when the job ends (and notices extensions), :class:`TimeBudget`
says when to stop so the final checkpoint finishes before the kill, :class:`StopSignals` turns
SLURM's warning signal into a flag, :func:`requeue` puts the job back in the queue. See README.md.
"""

from slurmclock.budget import BudgetConfig, Decision, RobustEstimate, StopFlag, TimeBudget
from slurmclock.commands import CommandError, Runner, SubprocessRunner, default_runner
from slurmclock.deadline import (
    SOURCES,
    Deadline,
    DeadlineWatcher,
    find_deadline,
    parse_duration,
    parse_time,
    process_start_time,
)
from slurmclock.job import array_task, in_slurm, job_id, restart_count
from slurmclock.requeue import RequeueResult, requeue
from slurmclock.signals import StopSignals, signal_number

__version__ = "0.1.0"

__all__ = [
    "SOURCES",
    "BudgetConfig",
    "CommandError",
    "Deadline",
    "DeadlineWatcher",
    "Decision",
    "RequeueResult",
    "RobustEstimate",
    "Runner",
    "StopFlag",
    "StopSignals",
    "SubprocessRunner",
    "TimeBudget",
    "__version__",
    "array_task",
    "default_runner",
    "find_deadline",
    "in_slurm",
    "job_id",
    "parse_duration",
    "parse_time",
    "process_start_time",
    "requeue",
    "restart_count",
    "signal_number",
]
