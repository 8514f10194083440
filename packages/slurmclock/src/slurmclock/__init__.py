"""SLURM job deadline, time budget, stop signals, self-requeue and the batch job's supervisor
(stdlib only).

:class:`DeadlineWatcher` knows when the job ends (and notices extensions), :class:`TimeBudget`
says when to stop so the final checkpoint is durable and the job requeued before the kill,
:class:`TimeLoop` is the time-aware loop protocol every trainer drives (stop, saves, extra saves,
exit codes), :class:`StopSignals` turns SLURM's signals into a flag, :class:`JobTimeline`
remembers what the end of each allocation took, :func:`requeue` puts the job back in the queue.
:mod:`slurmclock.job` is the job: its facts (:func:`this_job`), who leads (:func:`is_leader`),
the exit codes and timeline events, and the :class:`Scheduler` interface (:class:`Slurm`).
:mod:`slurmclock.supervisor` is the batch script's last command (``slurmclock supervise``): it
forwards SLURM's signals to the training step, requeues at the time limit, and after a crash or
a lost node starts the step again inside the allocation (a hot spare, or fewer nodes) or requeues.
See README.md.
"""

from slurmclock.allocation import AllocationStart, allocation_start
from slurmclock.budget import (
    SAVE_PRIOR_SPREAD,
    BudgetConfig,
    Decision,
    ExtraSave,
    RobustEstimate,
    SaveTail,
    TimeBudget,
)
from slurmclock.commands import CommandError, Runner, SubprocessRunner, default_runner
from slurmclock.deadline import (
    SOURCES,
    Deadline,
    DeadlineWatcher,
    find_deadline,
    parse_time,
    process_start_time,
    watches_the_clock,
)
from slurmclock.durations import (
    check_seconds,
    checkpoint_interval,
    parse_duration,
    parse_human_duration,
    parse_slurm_time,
    parse_time_limit,
    young_daly_interval,
)
from slurmclock.job import (
    EVENTS,
    EXIT_CODES,
    EXIT_ERROR,
    EXIT_FINISHED,
    EXIT_PEER_LOST,
    EXIT_STOPPED,
    EXIT_STORE_UNAVAILABLE,
    EXIT_USAGE,
    RANK_VARIABLES,
    EndTime,
    JobFacts,
    JobView,
    Node,
    Scheduler,
    Step,
    array_task,
    check_job_id,
    global_rank,
    in_slurm,
    is_leader,
    job_facts,
    job_id,
    restart_count,
    this_job,
)
from slurmclock.loop import Action, TimeLoop, end_process, measured_launch
from slurmclock.requeue import RequeueResult, requeue
from slurmclock.signals import (
    STOP_SIGNALS,
    AnyFlag,
    SignalMeaning,
    StopFlag,
    StopSignals,
    signal_lead_from_env,
    signal_number,
)
from slurmclock.slurm import Slurm
from slurmclock.timeline import Event, ExitSample, JobTimeline, find_timeline, timeline_dir

__version__ = "0.1.0"

__all__ = [
    "EVENTS",
    "EXIT_CODES",
    "EXIT_ERROR",
    "EXIT_FINISHED",
    "EXIT_PEER_LOST",
    "EXIT_STOPPED",
    "EXIT_STORE_UNAVAILABLE",
    "EXIT_USAGE",
    "RANK_VARIABLES",
    "SAVE_PRIOR_SPREAD",
    "SOURCES",
    "STOP_SIGNALS",
    "Action",
    "AllocationStart",
    "AnyFlag",
    "BudgetConfig",
    "CommandError",
    "Deadline",
    "DeadlineWatcher",
    "Decision",
    "EndTime",
    "Event",
    "ExitSample",
    "ExtraSave",
    "JobFacts",
    "JobTimeline",
    "JobView",
    "Node",
    "RequeueResult",
    "RobustEstimate",
    "Runner",
    "SaveTail",
    "Scheduler",
    "Step",
    "SignalMeaning",
    "Slurm",
    "StopFlag",
    "StopSignals",
    "SubprocessRunner",
    "TimeBudget",
    "TimeLoop",
    "__version__",
    "allocation_start",
    "array_task",
    "check_job_id",
    "check_seconds",
    "checkpoint_interval",
    "default_runner",
    "end_process",
    "find_deadline",
    "find_timeline",
    "global_rank",
    "in_slurm",
    "is_leader",
    "job_facts",
    "job_id",
    "measured_launch",
    "parse_duration",
    "parse_human_duration",
    "parse_slurm_time",
    "parse_time",
    "parse_time_limit",
    "process_start_time",
    "requeue",
    "restart_count",
    "signal_lead_from_env",
    "signal_number",
    "this_job",
    "timeline_dir",
    "watches_the_clock",
    "young_daly_interval",
]
