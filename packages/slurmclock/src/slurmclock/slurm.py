"""SLURM behind :class:`slurmclock.job.Scheduler`: its client commands, and how to read them.

:class:`Slurm` runs ``squeue``, ``scontrol``, ``scancel``, ``sinfo`` and ``srun`` through a
:data:`~slurmclock.commands.Runner` (the real one by default; tests give canned output) and
turns what they print into :class:`~slurmclock.job.EndTime`, :class:`~slurmclock.job.JobView`
and :class:`~slurmclock.job.Node`. It is the one place of slurmclock that runs them; everything
SLURM prints is read here, as SLURM 22.05 prints it, and slurmctld's quirks are met here: the
order of a requeued job's updates, and its holding the updates of a job that gave nodes back
(:meth:`Slurm.resize`).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import PurePath

from slurmclock.commands import CommandError, Runner, default_runner
from slurmclock.durations import parse_slurm_time, parse_time
from slurmclock.job import COMMAND_TIMEOUT, PROBE_NAME, EndTime, JobState, JobView, Node, Step

__all__ = [
    "FIRST_WAIT_S",
    "RESEND_S",
    "STAGGER_S",
    "Slurm",
    "exclude_fields",
    "job_state",
    "parse_job_record",
    "resize_fields",
]

STAGGER_S = 0.1  # between the updates of a requeued job, sent at once
FIRST_WAIT_S = 1.5  # for slurmctld's answers to the first round: more is an update it holds
# Between the starts of rounds while slurmctld holds them: a whole number of its 1 s retries,
# so that the rounds retrying there land in the order of a round when the requeue is done.
RESEND_S = 2.0

# What squeue/scontrol print instead of a time or a value when there is none (yet).
_NOT_SET = {"", "n/a", "unknown", "none", "(null)"}
_UNLIMITED = {"unlimited", "infinite"}
# What squeue's %l and scontrol's TimeLimit= print for a limit: [D-][H:]MM:SS.
_PRINTED_LIMIT = re.compile(r"([0-9]{1,7}-)?[0-9]{1,4}(:[0-9]{2}){1,2}")
# Keys whose value runs to the end of its line and may hold spaces (JobName=my job.sh), in the
# multi-line `scontrol show job` (without -o).
_REST_OF_LINE = ("JobName", "Command", "WorkDir", "StdErr", "StdIn", "StdOut", "Comment")
# sinfo's short states of a node no job gets soon; a trailing * (not responding: SLURM
# schedules nothing there, and marks it DOWN after SlurmdTimeout) too.
_UNUSABLE = ("down", "drain", "fail", "maint", "futr", "inval")
# sinfo's short states in the supervisor's terms (Node.condition): a node no step runs on now
# (down, failing, in maintenance, booting or powering down, future, invalid) and one that
# finishes its work and gets no new allocation (drain, draining).
_GONE = ("down", "fail", "maint", "boot", "reboot", "powe", "pow", "futr", "inval", "npc")
_DRAINED = ("drain", "drng", "drained", "draining")


def node_condition(state: str) -> str:
    """``"gone"``, ``"drained"`` or ``""`` (in service) for a state sinfo prints (``down*``,
    ``drng@``, ``mix``): SLURM's flags (``*`` not responding, ``@`` reboot pending, ...)
    aside."""
    low = state.lower().rstrip("*~#!%$@^-+")
    if low.startswith(_DRAINED) or "drain" in low:
        return "drained"
    if low.startswith(_GONE):
        return "gone"
    return ""


class Slurm:
    """The real :class:`~slurmclock.job.Scheduler`: SLURM's client commands through ``runner``
    (``(argv, timeout) -> stdout``, raising :class:`CommandError`). A runner that raises
    anything else is a bug of the runner: it becomes a CommandError of kind ``error``, so a
    caller's one ``except CommandError`` keeps a training run alive."""

    name = "slurm"

    def __init__(self, runner: Runner | None = None) -> None:
        self.runner = default_runner if runner is None else runner

    def _run(self, argv: Sequence[str], timeout: float) -> str:
        try:
            return self.runner(argv, timeout)
        except CommandError as e:
            if tuple(e.argv) == tuple(argv):
                raise
            # The command it was asked to run, whatever an injected runner put there: callers
            # name it in their messages.
            again = CommandError(argv, e.kind, str(e), returncode=e.returncode, stderr=e.stderr)
            raise again from e
        except Exception as e:
            message = f"{argv[0]} runner raised {type(e).__name__}: {e}"
            raise CommandError(argv, "error", message) from e

    def end_time(
        self, job: str, *, thorough: bool = False, timeout: float = COMMAND_TIMEOUT
    ) -> EndTime:
        """``squeue -h -o "%e %l" -j JOB``; ``thorough``: ``EndTime=`` and ``TimeLimit=`` of
        ``scontrol show job JOB``."""
        if thorough:
            argv = ["scontrol", "show", "job", job]
            out = self._run(argv, timeout)
            fields = scontrol_fields(out)
            if "EndTime" not in fields:
                message = f"scontrol show job {job} printed no EndTime=: {out[:200]!r}"
                raise CommandError(argv, "output", message)
            return EndTime(fields["EndTime"], parse_limit(fields.get("TimeLimit", "")), "scontrol")
        argv = ["squeue", "-h", "-o", "%e %l", "-j", job]
        line = _first_line(self._run(argv, timeout))
        if not line:
            raise CommandError(argv, "output", f"squeue printed nothing for job {job} (job over?)")
        end_text, _, limit_text = line.partition(" ")
        return EndTime(end_text, parse_limit(limit_text), "squeue")

    def start_time(self, job: str, *, timeout: float = COMMAND_TIMEOUT) -> float:
        """``squeue -h -o %S -j JOB``: when the current allocation started."""
        argv = ["squeue", "-h", "-o", "%S", "-j", job]
        text = _first_line(self._run(argv, timeout))
        if text.lower() in _NOT_SET:
            raise CommandError(argv, "output", f"squeue gives job {job} no start time ({text!r})")
        try:
            return parse_time(text)
        except ValueError as e:
            message = f"cannot read squeue's start time for job {job}: {e}"
            raise CommandError(argv, "output", message) from None

    def show_job(self, job: str, *, timeout: float = COMMAND_TIMEOUT) -> JobView:
        """``scontrol show job -o JOB``: the job's record, on one line."""
        return parse_job_record(self._run(["scontrol", "show", "job", "-o", job], timeout))

    def requeue(self, job: str, *, timeout: float = COMMAND_TIMEOUT) -> None:
        """``scontrol requeue JOB``."""
        self._run(["scontrol", "requeue", job], timeout)

    def update_job(self, job: str, *, timeout: float = COMMAND_TIMEOUT, **fields: str) -> None:
        """``scontrol update JobId=JOB KEY=VALUE ...``."""
        pairs = [f"{key}={value}" for key, value in fields.items()]
        self._run(["scontrol", "update", f"JobId={job}", *pairs], timeout)

    def signal(
        self, job: str, sig: str = "TERM", *, batch: bool = False, timeout: float = COMMAND_TIMEOUT
    ) -> None:
        """``scancel [--batch] --signal=SIG JOB``: without ``--batch`` SLURM signals the job's
        steps and not its batch shell; with it, the batch shell only."""
        where = ["--batch"] if batch else []
        self._run(["scancel", *where, f"--signal={sig}", job], timeout)

    def hostnames(self, nodelist: str, *, timeout: float = COMMAND_TIMEOUT) -> list[str]:
        """``scontrol show hostnames LIST``."""
        if not nodelist:
            return []
        return self._run(["scontrol", "show", "hostnames", nodelist], timeout).split()

    def nodes(self, partition: str, *, timeout: float = COMMAND_TIMEOUT) -> list[Node]:
        """``sinfo -h -N -p PARTITION -o "%N %t %E"``: a node in several partitions is listed
        once; one that does not respond (``idle*``, ``mix*``) is not usable; the reason (``%E``,
        ``none`` when there is none) is the rest of the line."""
        out = self._run(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %t %E"], timeout)
        found: dict[str, Node] = {}
        for line in out.splitlines():
            parts = line.split(None, 2)
            if len(parts) >= 2:
                name, state = parts[:2]
                reason = parts[2].strip() if len(parts) > 2 else ""
                usable = not state.startswith(_UNUSABLE) and not state.endswith("*")
                why = "" if reason.lower() in _NOT_SET else reason
                node = Node(name, state, usable, why, node_condition(state))
                found.setdefault(name, node)
        return list(found.values())

    def node_starts(
        self, nodes: Sequence[str], *, timeout: float = COMMAND_TIMEOUT
    ) -> dict[str, str]:
        """``scontrol show node -o LIST``: ``BootTime`` and ``SlurmdStartTime`` of each node
        (a reboot changes both, a restarted slurmd the second)."""
        if not nodes:
            return {}
        out = self._run(["scontrol", "show", "node", "-o", ",".join(nodes)], timeout)
        found: dict[str, str] = {}
        for line in out.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            name = fields.get("NodeName", "")
            times = [fields.get(k, "") for k in ("BootTime", "SlurmdStartTime")]
            if name and any(t.lower() not in _NOT_SET for t in times):
                found[name] = " ".join(times)
        return found

    def cluster_name(self, *, timeout: float = COMMAND_TIMEOUT) -> str:
        """``ClusterName`` of ``scontrol show config``."""
        argv = ["scontrol", "show", "config"]
        out = self._run(argv, timeout)
        m = re.search(r"^\s*ClusterName\s*=\s*(\S+)", out, flags=re.MULTILINE)
        if m is None:
            raise CommandError(argv, "output", "scontrol show config printed no ClusterName")
        return m.group(1)

    def steps(self, job: str, *, timeout: float = COMMAND_TIMEOUT) -> list[Step]:
        """``squeue -h -s -j JOB -o "%i %N %j"``: the job's steps that run."""
        out = self._run(["squeue", "-h", "-s", "-j", job, "-o", "%i %N %j"], timeout)
        found = []
        for line in out.splitlines():
            parts = line.split(None, 2)
            if parts:
                nodes = parts[1] if len(parts) > 1 else ""
                found.append(Step(parts[0], nodes, parts[2].strip() if len(parts) > 2 else ""))
        return found

    def cancel_step(self, step: str, *, timeout: float = COMMAND_TIMEOUT) -> None:
        """``scancel JOB.STEP``: SLURM kills the step's tasks on the nodes that answer, and
        ``srun`` gives up waiting for the others within seconds (not at SlurmdTimeout)."""
        self._run(["scancel", step], timeout)

    def step_command(
        self,
        argv: Sequence[str],
        nodes: Sequence[str] | None,
        *,
        tasks_per_node: int | None = None,
        overlap: bool = False,
    ) -> list[str]:
        """``srun`` with ``--nodes --ntasks --nodelist`` (and ``--overlap``) put first, so
        that the step's own options come after them: give that srun no node or task count.
        ``--overlap``: a step that lost a node stays RUNNING in SLURM's records until the node
        is DOWN, holding the CPUs of its healthy nodes too; without it a new step waits."""
        if not argv or PurePath(argv[0]).name != "srun":
            return list(argv)
        placed = []
        if nodes:
            placed += [f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}"]
            if tasks_per_node:
                placed.append(f"--ntasks={len(nodes) * tasks_per_node}")
        if overlap:
            placed.append("--overlap")
        return [argv[0], *placed, *argv[1:]]

    def exclude_nodes(
        self, job: str, nodes: Sequence[str], *, timeout: float = COMMAND_TIMEOUT
    ) -> None:
        """``scontrol update JobId=JOB ExcNodeList=A,B``."""
        self.update_job(job, timeout=timeout, **exclude_fields(nodes))

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
        """``scontrol update JobId=JOB`` with ``NumTasks``, ``NumNodes=N-N`` (with
        ``ExcNodeList``), both again, ``NumTasks`` last (:func:`resize_fields`), sent
        :data:`STAGGER_S` apart, each in a thread of its own: a task count that reaches
        slurmctld before the node count may be refused (seen in CI: the job pended with 1 node
        and the old 2 tasks at one per node), one after it holds.

        A job that gave a node back (``NodeList=``, or SLURM removing a DOWN node from a
        ``--no-kill`` job) was resized, and slurmctld takes no update of a resized job until
        accounting gives it a new record (SLURM 22.05 ``_update_job``: "the DB index is being
        set"; each update is retried in slurmctld for 5 s, then refused). Without slurmdbd
        (``accounting_storage/none``) that is only when the requeue is done -- after this
        process is gone. So when the first round is not taken within :data:`FIRST_WAIT_S`,
        rounds go on every :data:`RESEND_S` until one is taken or this process ends: the last
        rounds, retrying in slurmctld, land when the requeue is done, if that is within 5 s of
        the end of the batch script (an Epilog of its own may take longer: the ``log`` line
        says how to ask for the size by hand). Returns the last round: call it as this process
        ends (it sends the updates slurmctld still holds, if any)."""
        excluded = None if exclude is None else ",".join(exclude)
        updates = resize_fields(nodes, tasks_per_node, excluded)
        held = _HeldUpdates(self, job, log or (lambda line: None), timeout)
        held.send(updates)
        return held.last_round

    def release_nodes(
        self, job: str, keep: Sequence[str], *, timeout: float = COMMAND_TIMEOUT
    ) -> None:
        """``scontrol update JobId=JOB NodeList=KEEP``: SLURM takes the other nodes back."""
        self.update_job(job, timeout=timeout, NodeList=",".join(keep))

    def probe_node(self, job: str, node: str, *, timeout: float = COMMAND_TIMEOUT) -> None:
        """``srun --jobid=JOB --overlap -N1 -n1 --nodelist=NODE true``: answered in a fraction
        of a second by a live node; SLURM 22.05 takes about ``MessageTimeout`` (10 s) to give
        up on one whose slurmd is gone, and waits longer on one that is frozen or cut off."""
        argv = ["srun", f"--jobid={job}", "--overlap", "--nodes=1", "--ntasks=1"]
        argv += ["--ntasks-per-node=1", f"--nodelist={node}", f"--job-name={PROBE_NAME}"]
        self._run([*argv, "--quiet", "true"], timeout)

    def helper_command(self, job: str, node: str, argv: Sequence[str], *, name: str) -> list[str]:
        """``srun --jobid=JOB --overlap -N1 -n1 --nodelist=NODE --job-name=NAME --quiet ARGV``:
        ``--overlap`` so that it waits for no CPU the training's step holds."""
        head = ["srun", f"--jobid={job}", "--overlap", "--nodes=1", "--ntasks=1"]
        return [*head, f"--nodelist={node}", f"--job-name={name}", "--quiet", *argv]


def exclude_fields(nodes: Sequence[str]) -> dict[str, str]:
    """The ``scontrol update`` field that keeps ``nodes`` out of a job's allocations."""
    return {"ExcNodeList": ",".join(nodes)}


def resize_fields(
    nodes: int | None, tasks_per_node: int | None, exclude: str | None = None
) -> list[dict[str, str]]:
    """The ``scontrol update`` fields of a requeued job's new size (``nodes``: None, as it is)
    and ExcNodeList (``exclude``: None, as it is), in the order they are sent."""
    excluded = {} if exclude is None else {"ExcNodeList": exclude}
    if nodes is None:
        return [excluded] if excluded else []
    counts = {"NumNodes": f"{nodes}-{nodes}"}
    tasks = [] if tasks_per_node is None else [{"NumTasks": str(nodes * tasks_per_node)}]
    return [*tasks, {**counts, **excluded}, *tasks, counts, *tasks]


class _HeldUpdates:
    """The updates of one requeued job, round after round while slurmctld holds them
    (:meth:`Slurm.resize`); ``log`` gets a refusal of the first round and the held line."""

    def __init__(self, slurm: Slurm, job: str, log: Callable[[str], None], timeout: float):
        self.slurm, self.job, self.log, self.timeout = slurm, job, log, timeout
        self._held: list[dict[str, str]] = []  # updates slurmctld did not take yet

    def send(self, updates: list[dict[str, str]]) -> None:
        if not updates:
            return
        first = self._round(updates)
        if first.wait(FIRST_WAIT_S) and not first.unanswered:
            for line in first.refusals:  # refused at once: slurmctld said why, not held
                self.log(line)
            return
        # Held: its refusals, after slurmctld's 5 s, are what this line says.
        by_hand = [next(u for u in updates if "NumTasks" not in u)]
        by_hand += [updates[-1]] if "NumTasks" in updates[-1] else []
        commands = "; ".join(
            f"scontrol update JobId={self.job} " + " ".join(f"{k}={v}" for k, v in u.items())
            for u in by_hand
        )
        self.log(
            f"slurmctld holds the updates of job {self.job} (a job that gave nodes back takes "
            f"none until its requeue is done; or it did not answer in time): sent again every "
            f"{RESEND_S:.0f} s until this script ends. Should the job pend asking for its old "
            f"size: {commands}"
        )
        self._held = updates
        keeper = threading.Thread(target=self._resend, args=(updates, first), daemon=True)
        keeper.start()

    def last_round(self) -> None:
        """Updates slurmctld holds: one more round as this process ends, to be retrying there
        for the longest after it (returns once they are sent)."""
        if self._held:
            self._round(self._held)

    def _resend(self, updates: list[dict[str, str]], first: _Round) -> None:
        rounds, k = [first], 0
        while not any(r.taken for r in rounds):
            rounds = [r for r in rounds if r.taken or not r.finished]
            k += 1  # rounds start on the first's beat: slurmctld's retries keep their order
            time.sleep(max(0.0, first.started + k * RESEND_S - time.monotonic()))
            rounds.append(self._round(updates))
        self._held = []

    def _round(self, updates: list[dict[str, str]]) -> _Round:
        """Send ``updates`` at once, each in a thread of its own, :data:`STAGGER_S` apart."""
        round_ = _Round(len(updates))
        for fields in updates:
            threading.Thread(target=self._update, args=(fields, round_), daemon=True).start()
            time.sleep(STAGGER_S)
        return round_

    def _update(self, fields: dict[str, str], round_: _Round) -> None:
        try:
            self.slurm.update_job(self.job, timeout=self.timeout, **fields)
            round_.done(True)
        except CommandError as e:
            # Unanswered is not refused: slurmctld retries a held update for 5 s before it
            # answers, longer than a command may wait once the job is stopping (1-5 s).
            unanswered = e.kind == "timeout"
            round_.done(False, unanswered=unanswered, why=f"{' '.join(e.argv)}: {e}")


class _Round:
    """The answers to one round of updates: ``taken`` when slurmctld took every one;
    ``refusals``: what it said of those it refused (logged only when none is held)."""

    def __init__(self, size: int) -> None:
        self.started = time.monotonic()
        self._left, self._ok = size, True
        self.unanswered = False  # an update timed out: held (or slurmctld away), not refused
        self.refusals: list[str] = []
        self._all = threading.Event()
        self._lock = threading.Lock()

    def done(self, ok: bool, *, unanswered: bool = False, why: str = "") -> None:
        with self._lock:
            self._left -= 1
            self._ok = self._ok and ok
            self.unanswered = self.unanswered or unanswered
            if not ok and not unanswered:
                self.refusals.append(why)
            if self._left == 0:
                self._all.set()

    @property
    def finished(self) -> bool:
        return self._all.is_set()

    @property
    def taken(self) -> bool:
        return self._all.is_set() and self._ok

    def wait(self, timeout: float) -> bool:
        """Were all answered within ``timeout`` seconds (taken or refused)?"""
        return self._all.wait(timeout)


# What SLURM's job states (scontrol's JobState=) mean in no scheduler's words; what is not here is
# JobState.UNKNOWN. COMPLETING is read with the Reason (TimeLimit) and PreemptTime: SLURM 22.05
# shows COMPLETING at a time limit, a preemption and a cancel alike (slurmclock.supervisor).
_STATES: dict[str, JobState] = {
    **dict.fromkeys(
        ("RUNNING", "SUSPENDED", "CONFIGURING", "RESIZING", "STOPPED"), JobState.ACTIVE
    ),
    **dict.fromkeys(("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD"), JobState.QUEUED),
    **dict.fromkeys(("TIMEOUT", "DEADLINE"), JobState.TIMED_OUT),
    "PREEMPTED": JobState.PREEMPTED,
    **dict.fromkeys(("COMPLETING", "SIGNALING", "STAGE_OUT"), JobState.ENDING),
    **dict.fromkeys(
        ("COMPLETED", "CANCELLED", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"),
        JobState.ENDED,
    ),
}


def job_state(native: str, reason: str, preempt_time: str | None) -> JobState:
    """SLURM's state, reason and preemption time as a :class:`JobState`: a job that runs is
    active whatever its reason; then a time limit, a queued job, a preempted one."""
    state = _STATES.get(native.upper(), JobState.UNKNOWN)
    if state in (JobState.ACTIVE, JobState.TIMED_OUT):
        return state
    if reason == "TimeLimit":
        return JobState.TIMED_OUT
    if state is JobState.QUEUED:
        return state
    return JobState.PREEMPTED if preempt_time is not None else state


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "")


def parse_limit(text: str) -> float | None:
    """squeue's ``%l`` / scontrol's ``TimeLimit=`` in seconds; inf for no limit; None when
    unknown or unreadable (``Partition_Limit``, ``INVALID``, garbage)."""
    t = text.strip()
    if t.lower() not in _UNLIMITED and not _PRINTED_LIMIT.fullmatch(t):
        return None  # not what SLURM prints (a bare "0" or "-5" would read as no limit)
    return parse_slurm_time(t)  # SLURM's own reading: [D-]HH:MM:SS, MM:SS, UNLIMITED


def scontrol_fields(text: str) -> dict[str, str]:
    """``KEY=VALUE`` of ``scontrol show job`` (multi-line), the first record's where there are
    several (an array job)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        for key in _REST_OF_LINE:
            m = re.search(rf"(?:^|\s){key}=(.*)$", line)
            if m:
                fields.setdefault(key, m.group(1).strip())
                line = line[: m.start()]
        for token in line.split():
            key, sep, value = token.partition("=")
            if sep:
                fields.setdefault(key, value)  # first record wins (array job: several)
    return fields


def _value(text: str) -> str | None:
    return None if text.lower() in _NOT_SET else text


def parse_job_record(text: str) -> JobView:
    """The fields of ``scontrol show job -o JOB`` that slurmclock reads."""
    fields: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    preempt = fields.get("PreemptTime", "")
    nodes = fields.get("NumNodes", "1").split("-")[0]
    restarts = fields.get("Restarts", fields.get("RestartCnt", ""))
    excluded = fields.get("ExcNodeList", "")
    array, task = fields.get("ArrayJobId", ""), fields.get("ArrayTaskId", "")
    native, preempt_time = fields.get("JobState", "").upper(), _value(preempt)
    return JobView(
        state=job_state(native, fields.get("Reason", ""), preempt_time),
        native_state=native,
        reason=fields.get("Reason", ""),
        restarts=int(restarts) if restarts.isdigit() else None,
        preempt_time=preempt_time,
        partition=fields.get("Partition", ""),
        nodes="" if fields.get("NodeList", "").lower() in _NOT_SET else fields["NodeList"],
        exc_nodes="" if excluded.lower() in _NOT_SET else excluded,
        num_nodes=int(nodes) if nodes.isdigit() and int(nodes) > 0 else 1,
        array_task=f"{array}_{task}" if array.isdigit() and task.isdigit() else None,
    )
