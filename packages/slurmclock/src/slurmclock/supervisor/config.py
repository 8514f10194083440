"""What the supervisor does: :class:`SuperviseConfig`, validated on construction.

Its own module so that the supervisor's decisions (:mod:`.verdict`) and its I/O
(:mod:`.supervise`) both import it from here, and neither imports the other.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from slurmclock.job import (
    EXIT_STOPPED,
    EXIT_STORE_UNAVAILABLE,
    array_task,
    job_id,
    num_nodes,
    tasks_per_node,
)

__all__ = ["CHAIN_ENV", "SuperviseConfig", "contradiction"]

CHAIN_ENV = "PYRECOVER_CHAIN"  # set by submit-chain.sh: a later job of the chain resumes this one


@dataclass(kw_only=True, slots=True)
class SuperviseConfig:
    """What :class:`Supervisor` does; validated on construction (one line says how to fix).

    ``max_failures``: the chain stops at this many failures in a row at the same checkpoint step.
    ``max_restarts``: no requeue once the job was restarted this often (any reason).
    ``requeue``: False never requeues: an unfinished run ends with its status and the line says
    how to resume; with ``next_job_resumes`` (an array task, a chain) it ends 0 instead.
    ``no_retry``: exit statuses that are not failures worth a retry (2: a usage error).
    ``name``: the log lines' prefix. ``resume_hint``: how to resume after giving up (``{job}`` is
    replaced by the job id). ``exclude_failed_nodes``: keep a lost node out of the next
    allocation. ``restart_here``: start a failed step again in the allocation when the time
    left is worth it (``startup_guess`` seconds of start-up until one is measured).
    ``spare_nodes``: nodes of the allocation kept idle to replace a lost one; ``min_nodes``: the
    fewest nodes the step goes on with; ``step_nodes``: the most it trains on (None: the
    allocation's, less the spares); ``tasks_per_node`` (None: the job's). ``relaunch_args``:
    appended to the command when it starts again in the allocation (``--resume-from-checkpoint
    latest``). ``probe_timeout``: seconds a reported node has to answer a no-op step.
    ``successor``: sbatch options, script and arguments of the next job: instead of ``scontrol
    requeue`` a successor (:mod:`.successor`) is submitted, asking for ``successor_time_min``
    minutes at least (raised to the measured floor). ``successor_early``: that successor is
    submitted while this job trains, planned from the chain's waits, and takes over when it
    starts (:mod:`.handover`).
    ``run``: the run's name (the experiment):
    each link of its chain is recorded under it (:mod:`slurmclock.chain`); ``continue_run``: a
    job that is not a successor goes on as the next link of the run's recorded chain (a resubmit
    with ``--continue``), once the chain's newest job has ended.
    """

    max_failures: int = 3
    max_restarts: int = 50
    requeue: bool = True
    next_job_resumes: bool = False
    no_retry: frozenset[int] = frozenset({2})
    name: str = "slurmclock"
    resume_hint: str = "scontrol requeue {job} (while SLURM still lists the job), else submit again"
    exclude_failed_nodes: bool = True
    command_timeout: float = 30.0
    restart_here: bool = True
    startup_guess: float = 60.0
    spare_nodes: int = 0
    min_nodes: int = 1
    step_nodes: int | None = None
    tasks_per_node: int | None = None
    relaunch_args: tuple[str, ...] = ()
    probe_timeout: float = 10.0
    store_pause: tuple[float, float] = (5.0, 300.0)
    successor: tuple[str, ...] = ()
    successor_time_min: int | None = None
    successor_early: bool = False
    run: str = ""
    continue_run: bool = False

    def __post_init__(self) -> None:
        _check_run(self.run, self.continue_run)
        for key, low in (("max_failures", 1), ("max_restarts", 0), ("spare_nodes", 0)):
            _whole(key, getattr(self, key), low)
        _whole("min_nodes", self.min_nodes, 1)
        for key in ("step_nodes", "tasks_per_node"):
            if getattr(self, key) is not None:
                _whole(key, getattr(self, key), 1)
        bad = sorted(c for c in self.no_retry if c in (0, EXIT_STOPPED) or not 0 < c < 256)
        if bad:
            raise ValueError(
                f"no_retry: {bad} cannot be a failure status (0 = done, 75 = stopped early; "
                "give exit statuses 1-255)"
            )
        if EXIT_STORE_UNAVAILABLE in self.no_retry:
            raise ValueError(
                f"no_retry: {EXIT_STORE_UNAVAILABLE} is a store outage, never a failure: the "
                "step waits for the store while the allocation's time holds it, then the job "
                f"is requeued; leave {EXIT_STORE_UNAVAILABLE} out (a bad store setting exits 2)"
            )
        if not self.name or any(c in self.name for c in "\r\n"):
            raise ValueError(f"name must be one non-empty line, got {self.name!r}")
        for key in ("command_timeout", "startup_guess", "probe_timeout"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{key} must be > 0 seconds, got {value!r}")
        if self.successor_time_min is not None:
            _whole("successor_time_min", self.successor_time_min, 1)
        if self.successor_early and not self.successor:
            raise ValueError(
                "successor_early needs a successor (the next job's sbatch options, script and "
                "arguments): give --successor TEXT too, or REQUEUE=successor-early in the "
                "shipped script"
            )
        if self.step_nodes is not None and self.step_nodes < self.min_nodes:
            raise ValueError(
                f"step_nodes {self.step_nodes} is fewer than min_nodes {self.min_nodes}: give "
                "a minimum no larger than the nodes the step trains on"
            )


def _check_run(run: str, continue_run: bool) -> None:
    if len(run) > 200 or any(not c.isprintable() for c in run):
        raise ValueError(f"run must be one line of at most 200 characters, got {run[:60]!r}")
    if continue_run and not run:
        raise ValueError("continue_run needs the run's name: give --run NAME with --continue-run")


def contradiction(config: SuperviseConfig, env: Mapping[str, str] | None = None) -> str | None:
    """Why ``config`` cannot work in this job (``env``: its variables), in one line, or None.
    Asked before anything runs: a setting that contradicts the job would otherwise show only
    as a job that ends COMPLETED with steps left, or as srun's refusal retried as a crash."""
    e = os.environ if env is None else env
    if job_id(e) is None:
        return None
    if config.next_job_resumes and array_task(e) is None and not e.get(CHAIN_ENV, "").strip():
        return (
            "--next-job-resumes in a job that is neither an array task nor part of a chain "
            f"({CHAIN_ENV} unset): nothing would resume it, and an unfinished run would end "
            f"COMPLETED; drop the flag (the job requeues itself), or set {CHAIN_ENV}=1 when a "
            "job submitted after this one resumes it"
        )
    return _too_many(config, num_nodes(e), tasks_per_node(e))


def _too_many(config: SuperviseConfig, nodes: int, tasks: int | None) -> str | None:
    if config.tasks_per_node is not None and tasks is not None and config.tasks_per_node > tasks:
        return (
            f"--tasks-per-node {config.tasks_per_node} is more than the job's {tasks} per node: "
            "srun would refuse (More processors requested than permitted); give at most "
            f"{tasks}, or submit with --ntasks-per-node {config.tasks_per_node}"
        )
    usable = nodes - config.spare_nodes
    for key, value in (("--step-nodes", config.step_nodes), ("--min-nodes", config.min_nodes)):
        if value is not None and value > usable:
            return (
                f"{key} {value} is more than the job's {nodes} node(s) less "
                f"{config.spare_nodes} spare(s): submit with --nodes "
                f"{value + config.spare_nodes}, or give fewer"
            )
    return None


def _whole(key: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key} must be a whole number >= {low}, got {value!r}")
