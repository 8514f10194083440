"""The job: what this process knows about the batch job it runs in, and the job's contract.

Every other module of slurmclock asks this one (or the :class:`Scheduler` it defines) and
never reads a scheduler's variable or runs a scheduler's command itself:

* **facts** -- :func:`this_job` (:class:`JobFacts`: id, array task, restart count, cluster,
  nodes, global rank) from the environment SLURM gives the job's processes; :func:`job_facts`
  for another job, asked of the scheduler (a login shell has none of those variables);
* **who leads** -- :func:`is_leader`: the rank a caller passes, else :func:`global_rank`, the one
  reading of every launcher's variables (:data:`RANK_VARIABLES`, the MPI ones before SLURM's:
  Open MPI's ``mpirun`` inside ``sbatch`` gives every child ``SLURM_PROCID=0``). The leader
  writes the job's timeline and watches the clock;
* **exit codes** of a training step (``EXIT_*``, :data:`EXIT_CODES`) and the **timeline events**
  (:data:`EVENTS`, :data:`RESERVED_KEYS`): the contract with batch scripts, the supervisor and
  the packages beside this one (DESIGN.md, "Contracts");
* the **scheduler interface** -- :class:`Scheduler` (end time, job record, requeue, update,
  signal, host names, nodes, cluster name; the job's steps, ending one, probing a node, placing
  a launch) with the data it answers in (:class:`EndTime`, :class:`JobView`, :class:`Node`,
  :class:`Step`). :class:`slurmclock.slurm.Slurm` is the real one (squeue, scontrol, scancel,
  sinfo, srun through an injectable runner); another scheduler is one more class.

A job id is turned into file names (the job's timeline) and command arguments, so every one goes
through :func:`check_job_id` first: ``../../escape``, ``abc`` or ``--all`` never reach a path or a
command. A value from the environment that cannot be used is named in one warning (what, where
from, what happens instead), once per process.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from slurmclock.commands import CommandError

__all__ = [
    "SLURM_VARIABLES",
    "VARIABLES",
    "JobState",
    "Variables",
    "variables",
    "EVENTS",
    "EXIT_CODES",
    "EXIT_ERROR",
    "EXIT_FINISHED",
    "EXIT_PEER_LOST",
    "EXIT_STOPPED",
    "EXIT_STORE_UNAVAILABLE",
    "EXIT_USAGE",
    "RANK_VARIABLES",
    "RESERVED_KEYS",
    "SLURM_ENDS",
    "TERM_KINDS",
    "COMMAND_TIMEOUT",
    "EndTime",
    "JobFacts",
    "JobView",
    "Node",
    "PROBE_NAME",
    "Scheduler",
    "Step",
    "array_task",
    "check_job_id",
    "cluster_name",
    "global_rank",
    "in_slurm",
    "is_cluster_name",
    "is_leader",
    "job_facts",
    "job_id",
    "job_id_problem",
    "num_nodes",
    "restart_count",
    "tasks_per_node",
    "this_job",
]

log = logging.getLogger("slurmclock")

# -- exit codes of a training step (what a batch script and the supervisor see) -------------------

EXIT_FINISHED = 0  # training is done
EXIT_ERROR = 1  # an error of this process (a crash): retried from the newest checkpoint
EXIT_USAGE = 2  # a bad flag or input: never retried
EXIT_PEER_LOST = 69  # EX_UNAVAILABLE: a peer rank died or froze (ddpkit's watchdog)
EXIT_STORE_UNAVAILABLE = 74  # EX_IOERR: the checkpoint store could not be reached; nothing lost
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped with a durable checkpoint, steps left: resume
EXIT_CODES = {
    EXIT_FINISHED: "finished",
    EXIT_ERROR: "failed (an error of this process)",
    EXIT_USAGE: "usage error (not retried)",
    EXIT_PEER_LOST: "a peer rank died or froze",
    EXIT_STORE_UNAVAILABLE: "the checkpoint store could not be reached",
    EXIT_STOPPED: "stopped with a checkpoint, steps left",
}
"""Every exit code with a meaning of its own; 128+N is "killed by signal N", as a shell says."""

# -- the job's timeline (slurmclock.timeline writes and reads it) ----------------------------------

EVENTS = (
    "start",
    "signal",
    "saved",
    "exited",
    "requeued",
    "checkpoint",
    "failed",
    "gave_up",
    "first_step",
    "fault",
    "relaunched",
    "node",
)
"""The timeline's event names: who writes each, and its fields, in slurmclock.timeline."""
# What a SIGTERM to the batch script meant: the ``kind`` of a ``signal`` event.
STOP, LIMIT, PREEMPTED, REQUEUED, CANCELLED = "stop", "limit", "preempted", "requeued", "cancelled"
TERM_KINDS = (STOP, LIMIT, PREEMPTED, REQUEUED, CANCELLED)
SLURM_ENDS = (LIMIT, PREEMPTED, REQUEUED, CANCELLED)
"""The kinds of SIGTERM by which SLURM ended the run: never a failure of the step."""
RESERVED_KEYS = ("event", "time", "restart", "host", "pid")
"""The keys every timeline line has, set by the writer: an event's details use other names."""

COMMAND_TIMEOUT = 10.0  # seconds a scheduler command may take, unless a caller says otherwise

# -- the scheduler's variables (submitit's habit: one table per scheduler) -------------------------


@dataclass(frozen=True, slots=True)
class Variables:
    """The environment variables through which a scheduler tells a job's processes about their
    job: what :func:`this_job` and the functions below read, by meaning. ``num_nodes``: the
    first that is set wins. A second scheduler is one more table in :data:`VARIABLES`."""

    scheduler: str  # its name in slurmclock.schedulers.SCHEDULERS
    job_id: str
    array_job: str
    array_task: str
    restart: str  # how often the job was requeued
    cluster: str
    node_list: str  # the allocation's nodes, compressed (n[1-4])
    num_nodes: tuple[str, ...]
    tasks_per_node: str  # as asked (--ntasks-per-node)
    task_counts: str  # per node, as the scheduler writes them (4(x2))
    num_tasks: str
    rank: str  # the scheduler's launcher's global rank (RANK_VARIABLES has every launcher's)
    end_time: str  # the allocation's end (epoch seconds), where the scheduler sets one
    start_time: str  # the allocation's start, likewise


SLURM_VARIABLES = Variables(
    scheduler="slurm",
    job_id="SLURM_JOB_ID",
    array_job="SLURM_ARRAY_JOB_ID",
    array_task="SLURM_ARRAY_TASK_ID",
    restart="SLURM_RESTART_COUNT",
    cluster="SLURM_CLUSTER_NAME",
    node_list="SLURM_JOB_NODELIST",
    num_nodes=("SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    tasks_per_node="SLURM_NTASKS_PER_NODE",
    task_counts="SLURM_TASKS_PER_NODE",
    num_tasks="SLURM_NTASKS",
    rank="SLURM_PROCID",
    end_time="SLURM_JOB_END_TIME",
    start_time="SLURM_JOB_START_TIME",
)
VARIABLES: dict[str, Variables] = {"slurm": SLURM_VARIABLES}
"""Every scheduler's table, by name; the first whose job id is set is this process's."""


def variables(env: Mapping[str, str] | None = None) -> Variables:
    """The table of the scheduler this process runs under: the first of :data:`VARIABLES`
    whose job-id variable is set; SLURM's outside any job."""
    e = _env(env)
    return next((v for v in VARIABLES.values() if e.get(v.job_id, "").strip()), SLURM_VARIABLES)


# -- a job's state, in no scheduler's words (JobView.state) ----------------------------------------


class JobState(str, Enum):
    """What a job is doing, as the supervisor needs to know it: each :class:`Scheduler` maps
    its own states (and reasons) to these."""

    ACTIVE = "active"  # its processes run (or are suspended, or start)
    QUEUED = "queued"  # waiting for an allocation: pending, requeued, held
    TIMED_OUT = "timed_out"  # ended, or ending, at its time limit
    PREEMPTED = "preempted"  # ended, or ending, for a job of higher priority
    ENDING = "ending"  # ending for another reason (cancelled, its steps done)
    ENDED = "ended"
    UNKNOWN = "unknown"  # the scheduler said nothing this table knows


# SLURM job ids are uint32 (at most 10 digits); an array task is JOBID_TASK, a heterogeneous
# job's component JOBID+OFFSET.
_JOB_ID = re.compile(r"([0-9]{1,10})(?:(_|\+)([0-9]{1,10}))?")
_NUMBER = re.compile(r"[0-9]{1,10}")
_CLUSTER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
JOB_ID_FORMS = "give digits (1234), 1234_7 for an array task or 1234+1 for a het job component"

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def check_job_id(value: object, what: str = "job id") -> str:
    """``value`` (text, or an int) as a SLURM job id (``1234``, ``1234_7``, ``1234+1``; outer
    spaces and leading zeros dropped), or a one-line ValueError naming ``what`` (e.g.
    ``"--job-id"``) and the accepted forms."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        value = str(value)
    text = value.strip() if isinstance(value, str) else None
    m = _JOB_ID.fullmatch(text) if text else None
    if m is None:
        shown = value[:60] if isinstance(value, str) else value
        raise ValueError(f"{what} {shown!r} is not a SLURM job id: {JOB_ID_FORMS}")
    first, sep, second = m.groups()
    return str(int(first)) + (f"{sep}{int(second)}" if sep else "")


# -- what SLURM tells the job's processes ----------------------------------------------------------


def job_id_problem(env: Mapping[str, str] | None = None) -> str | None:
    """Why ``SLURM_JOB_ID`` cannot be used (one line), or None when it is fine or unset."""
    name = variables(env).job_id
    raw = _env(env).get(name, "")
    if not raw.strip():
        return None
    try:
        check_job_id(raw, name)
    except ValueError as e:
        return str(e)
    return None


def job_id(env: Mapping[str, str] | None = None) -> str | None:
    """``SLURM_JOB_ID`` (the id ``scontrol``/``squeue`` take), or None outside a job.

    A value that is not a SLURM job id is named in one warning and treated as "not in a job"
    (no timeline file, no squeue). In an array job every task has its own ``SLURM_JOB_ID``;
    :func:`array_task` gives the ``ARRAYID_TASKID`` form users see in ``squeue``.
    """
    name = variables(env).job_id
    raw = _env(env).get(name, "")
    if not raw.strip():
        return None
    try:
        return check_job_id(raw, name)
    except ValueError as e:
        _warn_once(f"{e}; treating this process as outside a SLURM job")
        return None


def array_task(env: Mapping[str, str] | None = None) -> str | None:
    """``"1234_7"`` from ``SLURM_ARRAY_JOB_ID``/``SLURM_ARRAY_TASK_ID``; None if not an array
    (or, with one warning, when they are not whole numbers)."""
    e, v = _env(env), variables(env)
    array, task = e.get(v.array_job, "").strip(), e.get(v.array_task, "").strip()
    if not array and not task:
        return None
    if not (_NUMBER.fullmatch(array) and _NUMBER.fullmatch(task)):
        _warn_once(
            f"{v.array_job}={array[:30]!r} and {v.array_task}={task[:30]!r} are not "
            "both whole numbers; reporting no array task"
        )
        return None
    return f"{int(array)}_{int(task)}"


def in_slurm(env: Mapping[str, str] | None = None) -> bool:
    """True inside a SLURM job (``SLURM_JOB_ID`` set to a job id)."""
    return job_id(env) is not None


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How often SLURM requeued this job (``SLURM_RESTART_COUNT``); 0 when unset, or (with one
    warning) when it is not a whole number >= 0."""
    name = variables(env).restart
    raw = _env(env).get(name, "").strip()
    if not raw:
        return 0
    if not _NUMBER.fullmatch(raw):
        _warn_once(
            f"{name}={raw[:30]!r} is not a whole number >= 0; counting this run as restart 0"
        )
        return 0
    return int(raw)


def cluster_name(env: Mapping[str, str] | None = None) -> str | None:
    """``SLURM_CLUSTER_NAME`` when it can be part of a file name (it is, from SLURM); None when
    unset, or (with one warning) when it could escape a folder."""
    name = variables(env).cluster
    cluster = _env(env).get(name, "").strip()
    if not cluster:
        return None
    if not is_cluster_name(cluster):
        _warn_once(
            f"{name}={cluster[:40]!r} cannot be part of a file name (letters, digits, "
            "'_', '.', '-'); naming the job's timeline job-JOBID.jsonl instead"
        )
        return None
    return cluster


def is_cluster_name(text: str) -> bool:
    """Could ``text`` be a cluster's name in a file name (nothing that leaves a folder)?"""
    return _CLUSTER.fullmatch(text) is not None


def tasks_per_node(env: Mapping[str, str] | None = None) -> int | None:
    """Tasks per node of this job: ``SLURM_NTASKS_PER_NODE`` (``--ntasks-per-node``), else
    ``SLURM_TASKS_PER_NODE`` when every node has the same count (``4(x2)``; not ``2(x3),1``),
    else ``SLURM_NTASKS`` over the nodes when it divides; None outside SLURM or when none of
    them says."""
    e, v = _env(env), variables(env)
    raw = e.get(v.tasks_per_node, "").strip()
    if _NUMBER.fullmatch(raw) and int(raw) > 0:
        return int(raw)
    counts = {
        m.group(1)
        for part in e.get(v.task_counts, "").split(",")
        if (m := re.fullmatch(r"\s*([0-9]{1,6})(?:\(x[0-9]+\))?\s*", part))
    }
    if len(counts) == 1 and int(next(iter(counts))) > 0:
        return int(next(iter(counts)))
    tasks = e.get(v.num_tasks, "").strip()
    nodes = num_nodes(e)
    if _NUMBER.fullmatch(tasks) and int(tasks) > 0 and int(tasks) % nodes == 0:
        return int(tasks) // nodes
    return None


def num_nodes(env: Mapping[str, str] | None = None) -> int:
    """The nodes of this job (``SLURM_JOB_NUM_NODES``, else ``SLURM_NNODES``); 1 outside SLURM
    or when neither is a whole number."""
    e = _env(env)
    raw = next((e[n] for n in variables(e).num_nodes if e.get(n, "").strip()), "1").strip()
    return int(raw) if _NUMBER.fullmatch(raw) and int(raw) > 0 else 1


# -- who leads -------------------------------------------------------------------------------------

RANK_VARIABLES = (
    "RANK",
    "OMPI_COMM_WORLD_RANK",
    "MV2_COMM_WORLD_RANK",
    "PMI_RANK",
    "PMIX_RANK",
    *(v.rank for v in VARIABLES.values()),
)
"""Where a process's global rank is read, first set wins: torchrun's, then Open MPI's,
MVAPICH2's, MPICH's and Intel MPI's, PMIx's, then srun's (every launcher ddpkit detects:
``tests/contracts/test_launchers.py``). The MPI ones come before ``SLURM_PROCID``: ``mpirun``
inside a batch job leaves the batch shell's ``SLURM_PROCID=0`` in every rank it starts."""


def global_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's global rank from the first of :data:`RANK_VARIABLES` that is set; None in
    a process no launcher started. A value that is not a whole number is named in one warning
    and read as -1 (not the leader: two leaders would write the timeline twice)."""
    e = _env(env)
    for name in RANK_VARIABLES:
        value = e.get(name, "").strip()
        if not value:
            continue
        if _NUMBER.fullmatch(value):
            return int(value)
        _warn_once(f"{name}={value[:30]!r} is not a whole number: this process does not lead")
        return -1
    return None


def is_leader(rank: int | None = None, *, env: Mapping[str, str] | None = None) -> bool:
    """Does this process lead the job (write its timeline, watch its clock)? Global rank 0, or a
    process that is not one of several. ``rank``: the rank the caller knows (a trainer's
    process group); None reads the launcher's variables (:func:`global_rank`)."""
    if rank is None:
        rank = global_rank(env)
    return rank is None or rank == 0


# -- the facts at once ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobFacts:
    """What is known about one job. ``restart`` is None when the scheduler was asked about
    another job and did not say; ``nodes`` is the compressed node list (``n[1-4]``);
    ``source``: ``"environment"`` (this process's job) or the scheduler's command that said so
    (``"scontrol"``), ``"none"`` when it did not answer."""

    job_id: str | None
    array_task: str | None = None
    restart: int | None = 0
    cluster: str | None = None
    nodes: str = ""
    num_nodes: int = 1
    rank: int | None = None
    source: str = "environment"

    @property
    def leader(self) -> bool:
        return is_leader(self.rank)


def this_job(env: Mapping[str, str] | None = None, *, rank: int | None = None) -> JobFacts:
    """The facts of the job this process runs in, from its environment (no command runs).
    ``rank``: the caller's global rank, when it knows it better than the launcher's variables."""
    e = _env(env)
    return JobFacts(
        job_id=job_id(e),
        array_task=array_task(e),
        restart=restart_count(e),
        cluster=cluster_name(e),
        nodes=e.get(variables(e).node_list, "").strip(),
        num_nodes=num_nodes(e),
        rank=global_rank(e) if rank is None else rank,
    )


def job_facts(
    job: str,
    scheduler: Scheduler,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = COMMAND_TIMEOUT,
) -> JobFacts:
    """The facts of job ``job`` (checked by :func:`check_job_id`), from the scheduler's record:
    a login shell, or another job's process, has none of its variables. Never raises for the
    scheduler: what it does not answer stays unknown (``restart`` None, ``source`` ``"none"``,
    one warning). When ``job`` is this process's own job, its environment answers. The cluster
    is this shell's (``SLURM_CLUSTER_NAME``: a job id is a cluster's), else None."""
    job = check_job_id(job)
    e = _env(env)
    if job_id_problem(e) is None and job_id(e) == job:
        return this_job(e)
    cluster = cluster_name(e)
    try:
        view = scheduler.show_job(job, timeout=timeout)
    except CommandError as err:
        _warn_once(f"{err}; the facts of job {job} stay unknown")
        return JobFacts(job_id=job, restart=None, cluster=cluster, source="none")
    return JobFacts(
        job_id=job,
        array_task=view.array_task,
        restart=view.restarts,
        cluster=cluster,
        nodes=view.nodes,
        num_nodes=view.num_nodes,
        source=view.source,
    )


# -- the scheduler interface -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EndTime:
    """A job's end as a scheduler said it: ``end`` as printed (epoch seconds or ISO-8601;
    without a UTC offset: local time, SLURM's way), ``limit`` the time limit in seconds (inf:
    none; None: unknown), ``source`` the command that said so (a :attr:`Deadline.source`)."""

    end: str
    limit: float | None
    source: str


@dataclass(frozen=True, slots=True)
class JobView:
    """A job's record as the scheduler shows it (``scontrol show job -o``): ``state`` in no
    scheduler's words (:class:`JobState`; the scheduler's own in ``native_state``, e.g.
    ``COMPLETING``, and ``reason``), ``restarts`` None when not shown, ``preempt_time`` None
    when never preempted, ``nodes``/``exc_nodes`` compressed node lists."""

    state: JobState = JobState.UNKNOWN
    native_state: str = ""
    reason: str = ""
    restarts: int | None = None
    preempt_time: str | None = None
    partition: str = ""
    nodes: str = ""
    exc_nodes: str = ""
    num_nodes: int = 1
    array_task: str | None = None
    source: str = "scontrol"


@dataclass(frozen=True, slots=True)
class Node:
    """One node of a partition: ``state`` as the scheduler prints it (``idle``, ``down*``), and
    whether a job can be given it now or soon (``usable``: not down, drained, failing, ...);
    ``reason``: why an administrator or the scheduler set that state ("" when none);
    ``condition``: that state in the supervisor's terms, whatever the scheduler -- ``"gone"``
    (down, failing, rebooting: no step runs there), ``"drained"`` (it finishes its running
    work, gets no new allocation) or ``""`` (in service). The scheduler sets it: only it knows
    what its states mean."""

    name: str
    state: str
    usable: bool
    reason: str = ""
    condition: str = ""


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a job as the scheduler lists it: ``id`` (``1234.0``, ``1234.batch``),
    ``nodes`` (a compressed node list), ``name`` (the command's, or ``--job-name``'s)."""

    id: str
    nodes: str = ""
    name: str = ""

    @property
    def number(self) -> int | None:
        """0 for ``1234.0``; None for the batch, extern or interactive step."""
        tail = self.id.rpartition(".")[2]
        return int(tail) if _NUMBER.fullmatch(tail) else None


PROBE_NAME = "slurmclock-probe"
"""The name of the no-op steps :meth:`Scheduler.probe_node` runs (told apart from training)."""


class Scheduler(Protocol):
    """What slurmclock asks of a batch scheduler. Each method raises
    :class:`slurmclock.CommandError` when the scheduler cannot answer: ``kind`` ``missing``
    (no such command here), ``failed``, ``timeout``, ``output`` (an answer that cannot be
    read; the message says what it was) or ``error`` (an injected runner's bug). ``timeout``
    bounds each command in seconds."""

    name: str

    def end_time(
        self, job: str, *, thorough: bool = False, timeout: float = COMMAND_TIMEOUT
    ) -> EndTime:
        """The job's end time and limit; ``thorough``: from the full job record (slower; where
        the quick query failed)."""
        ...

    def start_time(self, job: str, *, timeout: float = COMMAND_TIMEOUT) -> float:
        """When the job's current allocation started (epoch seconds)."""
        ...

    def show_job(self, job: str, *, timeout: float = COMMAND_TIMEOUT) -> JobView:
        """The job's record."""
        ...

    def requeue(self, job: str, *, timeout: float = COMMAND_TIMEOUT) -> None:
        """Put the job back in the queue (it ends now and starts again, restart count + 1)."""
        ...

    def signal(
        self, job: str, sig: str = "TERM", *, batch: bool = False, timeout: float = COMMAND_TIMEOUT
    ) -> None:
        """Send ``sig`` to the job's steps, or (``batch``) to its batch shell only."""
        ...

    def hostnames(self, nodelist: str, *, timeout: float = COMMAND_TIMEOUT) -> list[str]:
        """A compressed node list (``n[1-3],m4``) as host names."""
        ...

    def nodes(self, partition: str, *, timeout: float = COMMAND_TIMEOUT) -> list[Node]:
        """The nodes of ``partition`` with their states."""
        ...

    def cluster_name(self, *, timeout: float = COMMAND_TIMEOUT) -> str:
        """The cluster's name (the first part of a job's timeline file name)."""
        ...

    def steps(self, job: str, *, timeout: float = COMMAND_TIMEOUT) -> list[Step]:
        """The job's steps that run (the batch and extern steps too)."""
        ...

    def cancel_step(self, step: str, *, timeout: float = COMMAND_TIMEOUT) -> None:
        """End one step (``1234.5``): its tasks are killed on every node that answers."""
        ...

    def step_command(
        self,
        argv: Sequence[str],
        nodes: Sequence[str] | None,
        *,
        tasks_per_node: int | None = None,
        overlap: bool = False,
    ) -> list[str]:
        """``argv`` -- a launch of the step with the scheduler's launcher (``srun ...``) --
        placed on ``nodes`` (host names; None: where the launcher puts it) with
        ``tasks_per_node`` tasks each; ``overlap``: sharing what a step that did not end cleanly
        may still hold. A command that is not the launcher comes back as it is (it cannot be
        placed). Runs nothing."""
        ...

    def probe_node(self, job: str, node: str, *, timeout: float = COMMAND_TIMEOUT) -> None:
        """Run a no-op on ``node`` inside the job's allocation: a CommandError when the node
        does not answer within ``timeout``."""
        ...

    def node_starts(
        self, nodes: Sequence[str], *, timeout: float = COMMAND_TIMEOUT
    ) -> dict[str, str]:
        """{node: when its scheduler daemon last started} for ``nodes``, as an opaque stamp:
        a later stamp than before means the node restarted (a reboot, a crashed daemon) and
        what ran there is gone, although the node is in service again. Nodes the scheduler
        cannot say are left out."""
        ...

    def helper_command(self, job: str, node: str, argv: Sequence[str], *, name: str) -> list[str]:
        """``argv`` launched as one task on ``node`` inside the job's allocation, beside the
        steps that run there (taking none of their resources), named ``name`` so that it is
        told from the training's steps: the supervisor's own helper (the batch node's
        sentinel). The launcher is the first word (looked up on PATH). Runs nothing."""
        ...

    def exclude_nodes(
        self, job: str, nodes: Sequence[str], *, timeout: float = COMMAND_TIMEOUT
    ) -> None:
        """Keep ``nodes`` (the whole list) out of the job's next allocations."""
        ...

    def resize(
        self,
        job: str,
        nodes: int | None = None,
        *,
        tasks_per_node: int | None = None,
        exclude: Sequence[str] | None = None,
        log: Callable[[str], None] | None = None,
        timeout: float = COMMAND_TIMEOUT,
    ) -> Callable[[], None]:
        """What the requeued job asks for when it is next allocated: ``nodes`` nodes (None:
        as it is) with ``tasks_per_node`` tasks each, and (``exclude``: the whole list; None:
        as it is) nodes kept out. A scheduler that holds such changes for a while (SLURM 22.05:
        a job that gave nodes back) goes on asking in the background and says so through
        ``log``, as it says a refusal; returns what to call as this process ends (one more try
        of what is still held; a no-op where nothing is)."""
        ...

    def release_nodes(
        self, job: str, keep: Sequence[str], *, timeout: float = COMMAND_TIMEOUT
    ) -> None:
        """Give every node of the running job's allocation but ``keep`` back to the
        scheduler (a job may shrink itself; it waits for no lost node to end)."""
        ...
