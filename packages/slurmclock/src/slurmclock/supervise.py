"""Keep a training step coming back: the batch job's supervisor (``slurmclock supervise``).

A batch script ends with ``exec slurmclock supervise [options] -- srun ... train ...``; the
supervisor runs the step, forwards SLURM's signals, and when the step ends decides whether the
job comes back (``scontrol requeue``, the same job id, ``SLURM_RESTART_COUNT`` + 1):

============================  ====================================================================
what ended the allocation     what the supervisor does
============================  ====================================================================
exit 0                        nothing: training is done
exit 75 (stopped early)       requeue (``--max-restarts`` bounds the chain)
time limit                    requeue **at once**, from the SIGTERM, before the step has exited
preempted, ``CANCEL`` mode    requeue at once, from the SIGTERM
preempted, ``REQUEUE`` mode   nothing: SLURM requeues the job itself
preempted with ``GraceTime``  the step gets SIGTERM (the batch script does not), saves, exits 75
``scancel``                   nothing: a cancelled job stays cancelled
``slurmclock stop``           forwards SIGTERM to the step (it saves and exits); no requeue
any other exit or a signal    a failure: requeue, from the newest durable checkpoint -- unless it
                              is the ``--max-failures``-th failure in a row at the same checkpoint
                              step (the timeline's ``checkpoint`` events): then one ``gave up``
                              line, here and in the job's timeline, and no requeue
exit 2 (``--no-retry``)       a usage error: not retried
============================  ====================================================================

Why the requeue at the time limit cannot wait for the step: SLURM sends SIGTERM to every process
of the job at the limit and SIGKILL ``KillWait`` seconds later -- to the batch script too, and
``srun`` answers its own SIGTERM by killing the step. slurmd waits ``max(KillWait, 5)`` seconds
(SLURM 22.05, ``_rpc_terminate_job``) before that SIGKILL, so a requeue issued within a second of
the SIGTERM is accepted at any ``KillWait``; SLURM keeps the job ``COMPLETING`` until its last
process is gone, so the next allocation never overlaps the final save in flight, which completes
(the next run resumes from it) or is killed (ckptstore commits atomically: the newest durable
checkpoint before it stands).

How the supervisor tells the ends apart (``scontrol show job`` when the SIGTERM arrives; SLURM
22.05 shows ``JobState=COMPLETING`` for all of the first four):

- time limit (also one cut with ``scontrol update``): ``Reason=TimeLimit``;
- requeued by SLURM (preemption in REQUEUE mode, ``scontrol requeue``): ``Restarts`` is one
  higher than this run's ``SLURM_RESTART_COUNT``;
- preempted in CANCEL mode: ``PreemptTime`` is set;
- ``scancel``: none of these;
- ``slurmclock stop`` / ``scancel --batch --signal=TERM``: the job is still ``RUNNING``.

It cannot tell a user's ``scancel`` from an administrator's, nor a SIGTERM sent to the steps only
(``scancel --signal=TERM`` without ``--batch``) from preemption with ``GraceTime`` (both reach the
step and not the batch script: the step saves, exits 75 and the job is requeued).

Everything is written to the job's timeline (:mod:`slurmclock.timeline`): ``start``, ``signal``
(with the ``kind`` above), ``exited``, ``requeued``, ``failed``, ``gave_up``; the trainer adds
``checkpoint step=N`` whenever a checkpoint is durable, which is how "the same step" is known.
``DDPKIT_FAULT_FILE`` is set for the step (``CLUSTER-JOB.faults.jsonl`` beside the timeline):
ranks that see a dead or frozen peer append ``{"time", "rank", "host", "what", "reporter",
"silent_s", "job_id"}`` there (ddpkit's fault record, DESIGN.md "Contracts"); the supervisor names
the node in the log and, where the partition has enough other nodes for the job, excludes it from
the next allocation (``scontrol update JobId= ExcNodeList=``). Every SLURM command goes through
the :class:`~slurmclock.job.Scheduler` it is given (:class:`~slurmclock.slurm.Slurm` by default).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

from slurmclock.budget import signal_lead_from_env
from slurmclock.commands import CommandError, Runner
from slurmclock.deadline import DeadlineWatcher
from slurmclock.durations import parse_time
from slurmclock.job import EXIT_STOPPED, JobView, Scheduler, job_id_problem, this_job
from slurmclock.requeue import requeue
from slurmclock.slurm import Slurm
from slurmclock.timeline import Event, JobTimeline

__all__ = [
    "EXIT_STOPPED",
    "TERM_KINDS",
    "Fault",
    "JobView",
    "Streak",
    "SuperviseConfig",
    "Supervisor",
    "Verdict",
    "classify_term",
    "decide",
    "describe_status",
    "end_kind",
    "failure_streak",
    "gave_up_line",
    "newest_checkpoint",
    "read_faults",
    "vanished_run",
]

# What a SIGTERM to the batch script meant (see the module docstring).
STOP, LIMIT, PREEMPTED, REQUEUED, CANCELLED = "stop", "limit", "preempted", "requeued", "cancelled"
TERM_KINDS = (STOP, LIMIT, PREEMPTED, REQUEUED, CANCELLED)
# SLURM ended the allocation: the run's end is SLURM's doing, never a failure of the step.
_BY_SLURM = (LIMIT, PREEMPTED, REQUEUED, CANCELLED)
_POLL_S = 0.1  # how often the wait for the step looks at arrived signals
_T = TypeVar("_T")


@dataclass(kw_only=True, slots=True)
class SuperviseConfig:
    """What :class:`Supervisor` does; validated on construction (one line says how to fix).

    ``max_failures``: the chain stops at this many failures in a row at the same checkpoint step.
    ``max_restarts``: no requeue once the job was restarted this often (any reason).
    ``requeue``: False where the next job of an array or chain resumes instead.
    ``no_retry``: exit statuses that are not failures worth a retry (2: a usage error).
    ``name``: the log lines' prefix. ``resume_hint``: how to resume after giving up (``{job}`` is
    replaced by the job id). ``exclude_failed_nodes``: keep a node that ddpkit reported out of
    the next allocation, where the partition has enough other nodes.
    """

    max_failures: int = 3
    max_restarts: int = 50
    requeue: bool = True
    no_retry: frozenset[int] = frozenset({2})
    name: str = "slurmclock"
    resume_hint: str = "scontrol requeue {job} (while SLURM still lists the job), else submit again"
    exclude_failed_nodes: bool = True
    command_timeout: float = 30.0

    def __post_init__(self) -> None:
        for key, low in (("max_failures", 1), ("max_restarts", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key} must be a whole number >= {low}, got {value!r}")
        bad = sorted(c for c in self.no_retry if c in (0, EXIT_STOPPED) or not 0 < c < 256)
        if bad:
            raise ValueError(
                f"no_retry: {bad} cannot be a failure status (0 = done, 75 = stopped early; "
                "give exit statuses 1-255)"
            )
        if not self.name or any(c in self.name for c in "\r\n"):
            raise ValueError(f"name must be one non-empty line, got {self.name!r}")
        if not (self.command_timeout > 0 and self.command_timeout < float("inf")):
            raise ValueError(f"command_timeout must be > 0 seconds, got {self.command_timeout!r}")


# -- what SLURM says about the job ----------------------------------------------------------------


def classify_term(view: JobView | None, restart: int, seconds_left: float | None) -> str:
    """What a SIGTERM to the batch script meant: one of :data:`TERM_KINDS`.

    ``view``: the job as SLURM shows it right after the signal (None when scontrol did not
    answer: then only a deadline already passed, ``seconds_left`` <= 2, reads as the limit).
    """
    if view is None:
        return LIMIT if seconds_left is not None and seconds_left <= 2 else STOP
    if view.state in ("RUNNING", "SUSPENDED", "CONFIGURING"):
        return STOP
    if view.reason == "TimeLimit" or view.state == "TIMEOUT":
        return LIMIT
    if view.restarts is not None and view.restarts > restart:
        return REQUEUED
    if view.state in ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD"):
        return REQUEUED
    if view.preempt_time is not None or view.state == "PREEMPTED":
        return PREEMPTED
    return CANCELLED


# -- the job's history ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Streak:
    """Failures in a row at the same newest checkpoint step (``step`` None: before any)."""

    count: int = 0
    step: int | None = None
    last: Event | None = None


def failure_streak(events: Sequence[Event]) -> Streak:
    """The trailing run of ``failed`` events at one checkpoint step. A failure at another step
    starts a new run; a clean end (``exited`` 0 or 75) or ``gave_up`` (someone resumed the job
    after the chain stopped) ends it; time limits and preemptions neither count nor end it."""
    streak = Streak()
    for ev in events:
        if ev.name == "failed":
            step = _int(ev.info.get("step"))
            count = streak.count + 1 if streak.count and step == streak.step else 1
            streak = Streak(count, step, ev)
        elif ev.name == "gave_up" or (ev.name == "exited" and ev.info.get("rc") in (0, 75)):
            streak = Streak()
    return streak


def newest_checkpoint(events: Sequence[Event]) -> int | None:
    """The step of the last ``checkpoint`` event (the newest durable checkpoint), or None."""
    for ev in reversed(events):
        if ev.name == "checkpoint" and (step := _int(ev.info.get("step"))) is not None:
            return step
    return None


def vanished_run(events: Sequence[Event]) -> Event | None:
    """The last run's ``start`` when that run left no end behind: no ``exited``, no SIGTERM from
    SLURM (limit, preemption, requeue, cancel), no ``gave_up`` -- a node that went away, a batch
    script killed. None when the last run ended visibly (or there is none)."""
    start = next((i for i in range(len(events) - 1, -1, -1) if events[i].name == "start"), None)
    if start is None:
        return None
    for ev in events[start + 1 :]:
        if ev.name in ("exited", "gave_up"):
            return None
        if ev.name == "signal" and ev.info.get("kind") in _BY_SLURM:
            return None
    return events[start]


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True, slots=True)
class Fault:
    """One line of the ddpkit fault file: ``rank`` on ``host`` was ``what`` (dead / frozen),
    seen by rank ``reporter`` after ``silent_s`` seconds without a heartbeat."""

    time: float
    rank: int | None
    host: str
    what: str
    reporter: int | None
    silent_s: float | None = None
    job_id: str | None = None

    def describe(self) -> str:
        who = "a rank" if self.rank is None else f"rank {self.rank}"
        by = "" if self.reporter is None else f" (reported by rank {self.reporter})"
        return f"{who} on node {self.host or '?'} was {self.what or 'lost'}{by}"


def read_faults(path: str | os.PathLike[str] | None, since: float) -> list[Fault]:
    """The fault file's readable lines written at or after ``since`` (one line per report).
    ``time`` is epoch seconds; ISO-8601 text (what ddpkit wrote before) is read too."""
    if path is None:
        return []
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    faults = [fault for line in text.splitlines() if (fault := _fault(line)) is not None]
    return [fault for fault in faults if fault.time >= since]


def _fault(line: str) -> Fault | None:
    try:
        rec = json.loads(line)
        at = parse_time(rec["time"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    silent, job = rec.get("silent_s"), rec.get("job_id")
    return Fault(
        at,
        _int(rec.get("rank")),
        str(rec.get("host") or ""),
        str(rec.get("what") or ""),
        _int(rec.get("reporter")),
        float(silent)
        if isinstance(silent, (int, float)) and not isinstance(silent, bool)
        else None,
        str(job) if isinstance(job, (str, int)) and not isinstance(job, bool) else None,
    )


# -- deciding -------------------------------------------------------------------------------------


def describe_status(rc: int | None) -> str:
    """``exit 1``, ``exit 137 (killed by SIGKILL)``, ``no exit status``."""
    if rc is None:
        return "no exit status"
    if rc > 128:
        try:
            return f"exit {rc} (killed by {signal.Signals(rc - 128).name})"
        except ValueError:
            pass
    return f"exit {rc}"


def end_kind(rc: int, term: str | None, no_retry: frozenset[int]) -> str:
    """``finished``, ``stopped`` (exit 75), ``slurm`` (SLURM ended it: limit, preemption,
    requeue, cancel), ``requested`` (slurmclock stop), ``usage`` (a no-retry status) or
    ``failed``."""
    if term in _BY_SLURM:
        return "slurm"
    if term == STOP:
        return "requested"
    if rc == 0:
        return "finished"
    if rc == EXIT_STOPPED:
        return "stopped"
    return "usage" if rc in no_retry else "failed"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do once the step has exited: ``action`` ``end`` (exit with ``code``), ``requeue``
    (exit 0 once SLURM accepted, else ``code``) or ``give_up`` (exit ``code``)."""

    action: str
    code: int
    message: str


def decide(
    kind: str,
    rc: int,
    *,
    term: str | None,
    streak: Streak,
    restarts: int,
    config: SuperviseConfig,
    requeued: bool = False,
) -> Verdict:
    """The verdict for a step that exited with ``rc`` (``kind`` from :func:`end_kind`);
    ``streak`` includes this failure; ``requeued``: already requeued when the SIGTERM came."""
    if kind == "slurm":
        if requeued:
            return Verdict("end", 0, f"already requeued at the {_term_words(term)}")
        if term == REQUEUED:
            return Verdict("end", 0, "SLURM requeued this job itself: it comes back by itself")
        if term == CANCELLED:
            return Verdict("end", 0, "the job was cancelled (scancel): not requeueing")
        return Verdict("end", EXIT_STOPPED, f"not requeued at the {_term_words(term)}")
    if kind == "requested":
        if rc in (0, EXIT_STOPPED):
            return Verdict(
                "end",
                0,
                "stopped on request (SIGTERM to the batch script: slurmclock stop or scancel "
                "--batch): not requeueing; resume by submitting again",
            )
        return Verdict("end", rc, f"the step ended with {describe_status(rc)} after a stop request")
    if kind == "finished":
        return Verdict("end", 0, "training finished")
    if kind == "usage":
        return Verdict(
            "end",
            rc,
            f"training failed ({describe_status(rc)}: a usage error, a retry cannot help)",
        )
    if kind == "stopped":
        return _requeue_or_end("stopped early with steps left", EXIT_STOPPED, restarts, config)
    at = "before any checkpoint" if streak.step is None else f"at checkpoint step {streak.step}"
    if streak.count >= config.max_failures:
        return Verdict("give_up", rc, gave_up_line(streak, config))
    why = (
        f"training failed ({describe_status(rc)}, failure {streak.count} of "
        f"{config.max_failures} in a row {at})"
    )
    return _requeue_or_end(why, rc, restarts, config)


def gave_up_line(streak: Streak, config: SuperviseConfig) -> str:
    """The one line that ends a chain: what failed, where, how many times, how to resume."""
    at = "before any checkpoint" if streak.step is None else f"at checkpoint step {streak.step}"
    info = streak.last.info if streak.last is not None else {}
    last = str(info.get("why") or describe_status(_int(info.get("rc"))))
    where = f" on {info['nodes']}" if info.get("nodes") else ""
    return (
        f"gave up: the training step failed {streak.count} times in a row {at} (last: {last}"
        f"{where}); not requeueing. Fix the cause, then resume: {config.resume_hint}"
    )


def _requeue_or_end(why: str, code: int, restarts: int, config: SuperviseConfig) -> Verdict:
    if not config.requeue:
        return Verdict(
            "end",
            0 if code == EXIT_STOPPED else code,
            f"{why}; not requeueing (the next array task / chained job resumes)",
        )
    if restarts >= config.max_restarts:
        return Verdict(
            "end",
            code,
            f"{why}, but already restarted {restarts} times (max restarts): not requeueing",
        )
    return Verdict("requeue", code, f"{why}: requeueing to resume from the newest checkpoint")


def _term_words(term: str | None) -> str:
    return {LIMIT: "time limit", PREEMPTED: "preemption"}.get(term or "", "SIGTERM")


# -- the supervisor -------------------------------------------------------------------------------


class Supervisor:
    """Runs one step (``argv``) for this allocation and decides what comes next; see the module
    docstring. ``env`` (default ``os.environ``), ``scheduler`` (default
    :class:`~slurmclock.slurm.Slurm` running scontrol, scancel, sinfo and squeue through
    ``runner``), ``clock`` (epoch seconds) and ``out`` (the job log) are injectable; ``timeline``
    defaults to this job's."""

    def __init__(
        self,
        config: SuperviseConfig | None = None,
        *,
        env: Mapping[str, str] | None = None,
        runner: Runner | None = None,
        clock: Callable[[], float] | None = None,
        out: TextIO | None = None,
        timeline: JobTimeline | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.config = SuperviseConfig() if config is None else config
        self.env = dict(os.environ if env is None else env)
        if scheduler is not None and runner is not None:
            raise TypeError("give a scheduler or a runner for SLURM's commands, not both")
        self.scheduler: Scheduler = Slurm(runner) if scheduler is None else scheduler
        self.clock = time.time if clock is None else clock
        self.out = sys.stdout if out is None else out
        self.facts = this_job(self.env)
        self.job = self.facts.job_id
        self.restart = self.facts.restart or 0
        self.timeline = JobTimeline(env=self.env) if timeline is None else timeline
        self.term: str | None = None  # what the first SIGTERM meant
        self.requeued = False  # requeued when the SIGTERM came
        self._term_verdict: Verdict | None = None  # not requeued then, and why
        self._pending: list[int] = []
        self._started_at = self.clock()

    @property
    def fault_file(self) -> Path | None:
        """Where ddpkit reports dead or frozen ranks: beside the job's timeline."""
        path = self.timeline.path
        return None if path is None else path.with_name(path.stem + ".faults.jsonl")

    def log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.clock()))
        print(f"[{stamp}] {self.config.name}: {message}", file=self.out, flush=True)

    # -- the run ---------------------------------------------------------------------------

    def run(self, argv: Sequence[str]) -> int:
        """Run ``argv`` to its end; returns the exit status the batch script should exit with."""
        if not argv:
            raise ValueError("no command to supervise: give it after --, e.g. -- srun train.py")
        if (problem := job_id_problem(self.env)) is not None:
            self.log(f"{problem}: not supervising (nothing was run)")
            return 2
        with self._signals():
            if self.job is None:
                self.log("not in a SLURM job (SLURM_JOB_ID is unset): running without requeue")
            elif (code := self._start()) is not None:
                return code
            if (code := self._before_step()) is not None:
                return code
            proc = self._spawn(argv)
            if proc is None:
                return 127
            rc = self._wait(proc)
            if self.job is None:
                return rc
            return self._finish(rc)

    def _start(self) -> int | None:
        events = self.timeline.events()
        self.timeline.mark("start")
        lost = vanished_run(events)
        if lost is None:
            return None
        why = (
            f"run {lost.restart} ended without a word (a node failure, or its batch script killed)"
        )
        failed = self._mark_failed(events, None, why)
        self.log(f"{why}: counted as a failure")
        streak = failure_streak([*events, failed])
        if streak.count < self.config.max_failures:
            return None
        return self._give_up(Verdict("give_up", 1, gave_up_line(streak, self.config)))

    def _before_step(self) -> int | None:
        """A SIGTERM before the step started ends the allocation at once."""
        self._handle_signals(None)
        if self.term is None:
            return None
        if self.term == STOP:
            self.log("stopped on request before training started: not requeueing")
            return 0
        if self._term_verdict is not None:
            return self._term_verdict.code
        return 0

    def _spawn(self, argv: Sequence[str]) -> subprocess.Popen[bytes] | None:
        env = dict(self.env)
        if self.fault_file is not None:
            env.setdefault("DDPKIT_FAULT_FILE", str(self.fault_file))
        try:
            return subprocess.Popen(list(argv), env=env)
        except OSError as e:
            self.log(f"cannot start the training step `{argv[0]}`: {e}")
            return None

    def _wait(self, proc: subprocess.Popen[bytes]) -> int:
        # A signal handler only queues the signal: the work (scontrol, requeue) happens here.
        while True:
            self._handle_signals(proc)
            try:
                rc = proc.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                continue
        self._handle_signals(proc)  # one that came with the exit
        return 128 - rc if rc < 0 else rc  # killed by a signal: as a shell reports it

    def _finish(self, rc: int) -> int:
        self.log(f"training step exited with status {rc}")
        events = self.timeline.events()
        self.timeline.mark("exited", rc=rc)
        faults = read_faults(self.fault_file, self._started_at)
        for fault in faults:
            self.log(fault.describe())
        kind = end_kind(rc, self.term, self.config.no_retry)
        streak = Streak()
        if kind == "failed":
            exited = Event("exited", self.clock(), self.restart, {"rc": rc})
            failed = self._mark_failed([*events, exited], rc, describe_status(rc), faults)
            streak = failure_streak([*events, exited, failed])
        verdict = decide(
            kind,
            rc,
            term=self.term,
            streak=streak,
            restarts=self.restart,
            config=self.config,
            requeued=self.requeued,
        )
        if verdict.action == "give_up":
            return self._give_up(verdict)
        if kind == "slurm" and self._term_verdict is not None:
            verdict = self._term_verdict  # said when the SIGTERM came
        else:
            self.log(verdict.message)
        if verdict.action == "end":
            return verdict.code
        with _sigterm_ignored():  # SLURM signals every process of the job once it accepts
            ok = self._requeue()
            if ok and kind == "failed" and faults:
                self._exclude({f.host for f in faults if f.host})
        return 0 if ok else verdict.code

    def _mark_failed(
        self, events: Sequence[Event], rc: int | None, why: str, faults: Sequence[Fault] = ()
    ) -> Event:
        info: dict[str, Any] = {"step": newest_checkpoint(events), "why": why}
        if rc is not None:
            info["rc"] = rc
        nodes = sorted({f.host for f in faults if f.host}) or [
            self.facts.nodes or socket.gethostname()
        ]
        info["nodes"] = ",".join(nodes)
        self.timeline.mark("failed", **info)
        return Event("failed", self.clock(), self.restart, info)

    def _give_up(self, verdict: Verdict) -> int:
        line = verdict.message.replace("{job}", self.job or "JOBID")
        self.timeline.mark("gave_up", why=line)
        self.log(line)
        return verdict.code if verdict.code else 1

    # -- signals ---------------------------------------------------------------------------

    @contextmanager
    def _signals(self) -> Iterator[None]:
        def queue(signum: int, frame: object) -> None:
            self._pending.append(signum)

        previous = {s: signal.signal(s, queue) for s in (signal.SIGTERM, signal.SIGUSR2)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _handle_signals(self, proc: subprocess.Popen[bytes] | None) -> None:
        while self._pending:
            signum = self._pending.pop(0)
            if signum == signal.SIGUSR2:
                self._on_usr2(proc)
            else:
                self._on_term(proc)

    def _on_term(self, proc: subprocess.Popen[bytes] | None) -> None:
        if self.term is not None:
            # Decided at the first one: SLURM is ending this allocation, or the user stops it
            # (then a stop stays a stop, whatever comes after, and is forwarded again).
            if self.term == STOP:
                self._forward_term(proc)
            return
        view = self._job_view()
        left = self._seconds_left() if view is None else None
        kind = classify_term(view, self.restart, left)
        self.term = kind
        self.timeline.mark("signal", name="TERM", kind=kind)
        if kind == STOP:
            self.log(
                "received SIGTERM (slurmclock stop or scancel --batch): forwarding to the "
                "training step; the job is not requeued"
            )
            self._forward_term(proc)
        elif kind in (LIMIT, PREEMPTED):
            what = "the time limit" if kind == LIMIT else "preemption (PreemptMode=CANCEL)"
            self.log(
                f"received SIGTERM at {what}: requeueing job {self.job} now, before the "
                "step has exited (SLURM kills it KillWait seconds after its SIGTERM; the "
                "newest durable checkpoint stands)"
            )
            self._requeue_at_term(kind)
        elif kind == REQUEUED:
            self.log(
                "received SIGTERM: SLURM requeued this job (preemption in REQUEUE mode, or "
                "scontrol requeue); it comes back by itself"
            )
        else:
            self.log("received SIGTERM: the job was cancelled (scancel): not requeueing")

    def _requeue_at_term(self, kind: str) -> None:
        verdict = _requeue_or_end(
            f"ended by {_term_words(kind)}", EXIT_STOPPED, self.restart, self.config
        )
        if verdict.action != "requeue":
            self._term_verdict = verdict
            self.log(verdict.message)
            return
        with _sigterm_ignored():
            self.requeued = self._requeue()

    def _on_usr2(self, proc: subprocess.Popen[bytes] | None) -> None:
        if proc is None:
            self.log(
                "received SIGUSR2 before training started: the trainer reads the end time itself"
            )
            return
        lead = signal_lead_from_env(self.env)
        if lead is not None:
            left = self._seconds_left()
            # SLURM sends the warning between lead and lead + 30 s before the end.
            if left is not None and left <= lead + 35:
                self.log(
                    f"received SIGUSR2: agrees with the end time SLURM gives ({left:.0f} s "
                    f"left, lead {lead:.0f} s): not forwarded"
                )
                self.timeline.mark("signal", name="USR2", forwarded=0)
                return
        self.log("received SIGUSR2: forwarding to the training step")
        _kill(proc.pid, signal.SIGUSR2)  # srun passes it on to every task
        self.timeline.mark("signal", name="USR2")

    def _forward_term(self, proc: subprocess.Popen[bytes] | None) -> None:
        # Not through srun: it answers its own SIGTERM by killing the step within a second.
        # `scancel --signal` without --batch signals the job's steps, not this script.
        job, timeout = self.job, self.config.command_timeout
        if job is not None and self._tell(lambda: self.scheduler.signal(job, timeout=timeout)):
            return
        if proc is not None:
            _kill(proc.pid, signal.SIGTERM)

    # -- SLURM -----------------------------------------------------------------------------

    def _ask(self, question: Callable[[], _T]) -> _T | None:
        """The scheduler's answer to ``question()``; None, and the reason in the log, without
        one."""
        try:
            return question()
        except CommandError as e:
            self.log(f"{' '.join(e.argv)}: {e}")
            return None

    def _tell(self, action: Callable[[], None]) -> bool:
        """Did the scheduler do ``action()``? If not, the reason is in the log."""

        def done() -> bool:
            action()
            return True

        return self._ask(done) is not None

    def _job_view(self) -> JobView | None:
        job, timeout = self.job, self.config.command_timeout
        if job is None:
            return None
        return self._ask(lambda: self.scheduler.show_job(job, timeout=timeout))

    def _seconds_left(self) -> float | None:
        watcher = DeadlineWatcher(env=self.env, scheduler=self.scheduler, clock=self.clock)
        return watcher.get().seconds_left(self.clock())

    def _requeue(self) -> bool:
        result = requeue(
            env=self.env,
            scheduler=self.scheduler,
            timeout=self.config.command_timeout,
            timeline=self.timeline,
        )
        if result.ok:
            self.log(result.message)
            return True
        # SLURM may end this run before scontrol answers: was the restart counted?
        view = self._job_view()
        if view is not None and view.restarts is not None and view.restarts > self.restart:
            self.log(f"requeued job {self.job} (restart {view.restarts})")
            return True
        self.log(
            f"{result.message}; requeue failed: {self.config.resume_hint}".replace(
                "{job}", self.job or "JOBID"
            )
        )
        return False

    def _exclude(self, hosts: set[str]) -> None:
        """Keep the reported nodes out of the next allocation where the job still fits."""
        if not self.config.exclude_failed_nodes or not hosts or self.job is None:
            return
        view = self._job_view()
        if view is None:
            return
        job, timeout, sched = self.job, self.config.command_timeout, self.scheduler
        listed = self._ask(lambda: sched.nodes(view.partition, timeout=timeout))
        if listed is None:
            return
        usable = {node.name for node in listed if node.usable}
        short = {n.split(".")[0] for n in hosts}
        bad = {n for n in usable if n in hosts or n in short}
        unknown = sorted(short - {n.split(".")[0] for n in bad})
        if unknown:
            self.log(
                f"node(s) {', '.join(unknown)} not in partition {view.partition}: not excluded"
            )
        before = self._ask(lambda: sched.hostnames(view.exc_nodes, timeout=timeout)) or []
        excluded = set(before) | bad
        if not bad:
            return
        left = usable - excluded
        if len(left) < view.num_nodes:
            self.log(
                f"not excluding node(s) {', '.join(sorted(bad))}: partition {view.partition} "
                f"would have {len(left)} usable node(s) left for a job of {view.num_nodes}"
            )
            return
        nodes = ",".join(sorted(excluded))
        if self._tell(lambda: sched.update_job(job, timeout=timeout, ExcNodeList=nodes)):
            self.log(f"the next allocation avoids node(s) {', '.join(sorted(bad))} (ExcNodeList)")


def _kill(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass  # the step has just exited


@contextmanager
def _sigterm_ignored() -> Iterator[None]:
    """SIGTERM ignored (and so in the commands started meanwhile): SLURM sends it to every
    process of the job as soon as it accepts a requeue of a running job."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
