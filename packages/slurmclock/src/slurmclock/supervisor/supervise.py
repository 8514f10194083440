"""Keep a training step coming back: the batch job's supervisor (``slurmclock supervise``).

A batch script ends with ``exec slurmclock supervise [options] -- srun ... train ...``; the
supervisor runs the step, forwards SLURM's signals, and when the step ends decides what comes
next: start it again **in this allocation** (no queue), requeue the job (``scontrol requeue``:
the same job id, ``SLURM_RESTART_COUNT`` + 1, then a wait in the queue), or end:

============================  ====================================================================
what ended the step           what the supervisor does
============================  ====================================================================
exit 0                        nothing: training is done
exit 75 (stopped early)       requeue (``--max-restarts`` bounds the chain)
time limit                    requeue **at once**, from the SIGTERM, before the step has exited
preempted, ``CANCEL`` mode    requeue at once, from the SIGTERM
preempted, ``REQUEUE`` mode   nothing: SLURM requeues the job itself
preempted with ``GraceTime``  the step gets SIGTERM (the batch script does not), saves, exits 75
``scancel``                   nothing: a cancelled job stays cancelled
``slurmclock stop``           forwards SIGTERM to the step (it saves and exits); no requeue
any other exit or a signal    a failure: the step starts again in this allocation, from the
(a crash, exit 69: a rank     newest durable checkpoint, when the time left is worth it (the
dead or frozen)               measured start-up, a few steps and a final save); else a requeue.
                              The ``--max-failures``-th failure in a row at the same checkpoint
                              step (the timeline's ``checkpoint`` events; in-allocation restarts,
                              requeues and successor jobs alike: the links before this job are
                              read first) ends the chain: one ``gave up`` line, here and in the
                              job's timeline
exit 74 (store unreachable)   nothing lost, not a failure: tried again in this allocation after
                              a pause (5 s, doubling, at most 5 minutes), one line each time;
                              requeued when the allocation has no time for it
exit 2 (``--no-retry``)       a usage error: not retried
============================  ====================================================================

**A lost node.** ``DDPKIT_FAULT_FILE`` is set for each launch of the step
(``CLUSTER-JOB.R-L.faults.jsonl`` beside the timeline: :attr:`Supervisor.fault_file`): ranks
that see a dead or frozen peer append ddpkit's fault record (DESIGN.md "Contracts"). The
supervisor reads it while the step runs: each report is named in
the log and the timeline (``fault``) within a poll, and the step -- which ``srun`` cannot end
while a node does not answer, until SLURM marks the node DOWN after ``SlurmdTimeout`` -- is ended
through SLURM (:mod:`slurmclock.supervisor.launch`). A reported node that does not answer a
no-op step is lost (:mod:`slurmclock.supervisor.lostnodes`); the step starts again on the nodes
left: a hot spare takes its place (``--spare-nodes``: the allocation has more nodes than the
step trains on), else the step goes on with fewer nodes down to ``--min-nodes``
(:mod:`slurmclock.supervisor.placement`). The job must be submitted with ``--no-kill``, or
SLURM ends the whole allocation when the node goes DOWN. A
requeue keeps lost nodes out (``ExcNodeList``) and asks for no more nodes than the partition
can give (``NumNodes``, down to ``--min-nodes``; below that: ``gave up``, one line).

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

Everything is written to the job's timeline (:mod:`slurmclock.timeline`): ``start``,
``signal`` (with the ``kind`` above), ``fault``, ``exited``, ``failed``, ``relaunched``,
``requeued``, ``gave_up``; the trainer adds ``first_step`` (the start-up a restart costs) and
``checkpoint step=N`` whenever a checkpoint is durable, which is how "the same step" is known.
Every SLURM command goes through the :class:`~slurmclock.job.Scheduler` it is given
(:class:`~slurmclock.slurm.Slurm` by default).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO, TypeVar

from slurmclock.chain import Earlier, earlier
from slurmclock.chain import join as join_chain
from slurmclock.commands import CommandError, Runner, SubprocessRunner, command_bound, last_line
from slurmclock.deadline import DeadlineWatcher
from slurmclock.job import (
    EXIT_STOPPED,
    EXIT_USAGE,
    LIMIT,
    PREEMPTED,
    REQUEUED,
    STOP,
    JobView,
    Scheduler,
    job_id_problem,
    tasks_per_node,
    this_job,
)
from slurmclock.requeue import requeue
from slurmclock.schedulers import default_scheduler
from slurmclock.signals import signal_lead_from_env
from slurmclock.supervisor.config import SuperviseConfig
from slurmclock.supervisor.faults import FAULT_FILE_ENV, Fault
from slurmclock.supervisor.handover import (
    HOLDING,
    PREDECESSOR,
    WAITS,
    Early,
    Waiter,
    await_predecessor,
    chain_waits,
    early_exports,
    handover_bound,
    job_state,
    own_times,
    plan_submit,
)
from slurmclock.supervisor.history import (
    RestartCost,
    Streak,
    failure_streak,
    newest_checkpoint,
    restart_cost,
    settled,
    vanished_run,
)
from slurmclock.supervisor.launch import Launch, kill
from slurmclock.supervisor.lostnodes import NodeKeeper, RequeuePlan
from slurmclock.supervisor.nodestates import NodeChange, NodeStates, no_resize_scripts
from slurmclock.supervisor.placement import Placement, place, training_nodes
from slurmclock.supervisor.sentinel import SentinelStep, batch_node_lost
from slurmclock.supervisor.successor import submit_successor, time_min_floor
from slurmclock.supervisor.verdict import (
    NO_ROOM,
    Room,
    Verdict,
    classify_term,
    decide,
    describe_status,
    end_kind,
    gave_up_line,
    requeue_or_end,
    term_words,
)
from slurmclock.timeline import Event, JobTimeline
from slurmclock.untrusted import quote

__all__ = ["Supervisor"]

_POLL_S = 0.1  # how often the wait for the step looks at signals and the fault file
RESTART_STEPS = 5  # a restart is worth it when the time left holds its start-up and this many
_MARGIN_S = 10.0  # steps, a final save and this margin
# What a SLURM command may take: at least _FLOOR_S however little time is left; once a signal
# came (SLURM's KillWait, 30 s by default, runs: a busy slurmctld still answers a requeue in a few
# seconds), and once one of those went unanswered (slurmctld hangs: the step's SIGTERM first).
_FLOOR_S = 3.0
_AFTER_SIGNAL_S = 5.0
_HUNG_S = 1.0
_T = TypeVar("_T")


class Supervisor:
    """Runs the step (``argv``) for this allocation, again while that is worth it, and decides
    what comes next; see the module docstring. ``env`` (default ``os.environ``), ``scheduler``
    (default :class:`~slurmclock.slurm.Slurm` running SLURM's commands through ``runner``),
    ``clock`` (epoch seconds), ``sleep`` (a store outage's pause) and ``out`` (the job log) are
    injectable;
    ``timeline`` defaults to this job's; ``here`` is this node's name (default: the host's)."""

    _signal_at: float | None  # the last signal (monotonic): SLURM commands get less time
    _end_at: float | None  # the deadline (epoch seconds), once read: bounds SLURM commands
    _earlier: Earlier | None = None  # the chain's links before this job, once read

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
        here: str | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.config = SuperviseConfig() if config is None else config
        self.env = dict(os.environ if env is None else env)
        if scheduler is not None and runner is not None:
            raise TypeError("give a scheduler or a runner for SLURM's commands, not both")
        self._pending: list[int] = []
        self._signal_at = self._end_at = None
        if scheduler is None:  # SLURM's commands write no resize scripts into the user's tree
            scheduler = default_scheduler(self._bounded(runner), env=self.env)
        self.scheduler: Scheduler = scheduler
        self.clock = time.time if clock is None else clock
        self.sleep = time.sleep if sleep is None else sleep
        self.out = sys.stdout if out is None else out
        self.facts = this_job(self.env)
        self.job = self.facts.job_id
        self.restart = self.facts.restart or 0
        self.timeline = JobTimeline(env=self.env) if timeline is None else timeline
        self.term: str | None = None  # what the first SIGTERM meant
        self.requeued = False  # requeued when the SIGTERM came
        self._term_verdict: Verdict | None = None  # not requeued then, and why
        self.nodes = NodeKeeper(
            self.scheduler,
            self.job or "",
            log=self.log,
            timeout=self.config.command_timeout,
            probe_timeout=self.config.probe_timeout,
            here=here,
        )
        self._hosts: list[str] | None = None  # the allocation's nodes, once asked
        self.sentinel: SentinelStep | None = None  # watches this node from another one
        said = (self.log, self.timeline.mark)  # what SLURM shows of the job's nodes, named
        self.states = NodeStates(self.scheduler, self.job or "", self._command_bound, *said)
        self.placement: Placement | None = None  # where the next launch goes (None: as is)
        self.launches = self._store_tries = 0  # launches made; store outages in a row
        self._wait_s = 0.0  # before the next launch (a store outage's pause)
        self._ended_at = 0.0  # when the last launch ended
        self._argv: list[str] = []
        self.early = Early()  # the successor submitted while this job trains (--successor-early)

    def _bounded(self, runner: Runner | None) -> Runner:
        """The real runner (``runner`` or the default), each command bounded by
        :meth:`_command_bound` and ended by a signal; an injected one as it is."""
        base = no_resize_scripts() if runner is None else runner
        if not isinstance(base, SubprocessRunner):
            return base
        return base.bounded(bound=self._command_bound, cancel=lambda: bool(self._pending))

    @property
    def fault_file(self) -> Path | None:
        """Where the ranks of the next launch report dead or frozen peers (ddpkit): beside the
        job's timeline, one file per launch (``CLUSTER-JOB.R-L.faults.jsonl``, R the restart,
        L the launch in this allocation): a rank cut off from the others may go on and report
        them dead long after its step was ended, and must not end the next one."""
        path = self.timeline.path
        if path is None:
            return None
        return path.with_name(f"{path.stem}.{self.restart}-{self.launches + 1}.faults.jsonl")

    def log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.clock()))
        line = message.replace("{job}", self.job or "JOBID")
        print(f"[{stamp}] {self.config.name}: {line}", file=self.out, flush=True)

    # -- the run ---------------------------------------------------------------------------

    def run(self, argv: Sequence[str]) -> int:
        """Run ``argv`` to its end (again while worth it); returns the exit status the batch
        script should exit with."""
        if not argv:
            raise ValueError("no command to supervise: give it after --, e.g. -- srun train.py")
        if (problem := job_id_problem(self.env)) is not None:
            self.log(f"{problem}: not supervising (nothing was run)")
            return 2
        with self._signals():
            if self.job is None:
                self.log("not in a SLURM job (SLURM_JOB_ID is unset): running without requeue")
                launch = self._launch(argv)
                return 127 if launch is None else self._wait(launch)
            if (code := self._start()) is not None:
                return code
            if (code := self._await_predecessor()) is not None:
                return code
            if (code := self._before_step()) is not None:
                return code
            with self._sentinel_step():
                return self._settle_early(self._supervise(argv))

    def _supervise(self, argv: Sequence[str]) -> int:
        """Launch, wait, decide -- until the verdict is not a restart in this allocation."""
        self._argv = list(argv)
        while True:
            launch = self._launch(argv)
            if launch is None:
                return 127
            code = self._finish(self._wait(launch), launch)
            if code is not None:
                self.nodes.last_round()  # held requeue updates: in flight as this script ends
                return code
            if (code := self._pause(self._wait_s)) is not None:
                return code

    def _join_chain(self) -> dict[str, Any]:
        """This job as a link of the run's chain of jobs (:mod:`slurmclock.chain`)."""
        c = self.config
        return join_chain(
            self.env,
            self.job,
            self.timeline,
            run=c.run,
            resume=c.continue_run,
            scheduler=self.scheduler,
            timeout=c.command_timeout,
            log=self.log,
        )

    def _start(self) -> int | None:
        events = self.timeline.events()
        self.timeline.mark("start", **self._join_chain())
        if (code := self._check_nodes()) is not None:
            return code
        lost = vanished_run(events)
        if lost is None:
            return None
        if (line := batch_node_lost(events)) is not None:
            self.log(line)  # its job log ended with the node; the sentinel requeued it
            return None
        why = (
            f"run {lost.restart} ended without a word (a node failure, or its batch script killed)"
        )
        events = self._history(events)
        failed = self._mark_failed(events, None, why)
        self.log(f"{why}: counted as a failure")
        streak = failure_streak([*events, failed])
        if streak.count < self.config.max_failures:
            return None
        return self._give_up(Verdict("give_up", 1, gave_up_line(streak, self.config)))

    def _check_nodes(self) -> int | None:
        """Bad node settings for the first allocation are one line and exit 2 before any step;
        a later allocation has what the partition could give (said, not refused)."""
        c, have = self.config, self.facts.num_nodes
        need = c.min_nodes + c.spare_nodes
        if have >= need:
            self.placement = self._initial_placement()
            return None
        if self.restart > 0 and have >= c.min_nodes:
            self.log(f"{have} node(s) in this allocation: no spare left (of {c.spare_nodes})")
            self.placement = self._initial_placement()
            return None
        what = f"at least {c.min_nodes} node(s) to train on" + (
            f" and {c.spare_nodes} spare(s)" if c.spare_nodes else ""
        )
        self.log(
            f"this allocation has {have} node(s), the settings ask for {what} (MIN_NODES, "
            f"SPARE_NODES): submit with --nodes={need} or lower them (nothing was run)"
        )
        return 2

    def _initial_placement(self) -> Placement | None:
        hosts = self._allocation_hosts()
        if not hosts:
            return None
        c = self.config
        want = training_nodes(len(hosts), spare=c.spare_nodes, min_nodes=c.min_nodes)
        want = min(want, c.step_nodes or want)
        spares = hosts[want:]
        if spares:
            self.log(f"training on {', '.join(hosts[:want])}; hot spare(s): {', '.join(spares)}")
        return Placement(tuple(hosts[:want]), len(hosts))

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

    # -- a launch --------------------------------------------------------------------------

    def _launch(self, argv: Sequence[str]) -> Launch | None:
        """Start the step: placed on :attr:`placement`'s nodes when it is an srun (a relaunch
        with ``--overlap`` and the relaunch arguments); None when it cannot start."""
        again = self.launches > 0
        if self.sentinel is not None:
            self.sentinel.ensure(self._allocation_hosts(), self.nodes.gone)
        if again:
            argv = [*argv, *self.config.relaunch_args]
        nodes = self.placement.nodes if self.placement is not None else None
        place = self.scheduler.step_command
        command = place(argv, nodes, tasks_per_node=self._tasks_per_node(), overlap=again)
        placed = nodes if command != place(argv, None, overlap=again) else None
        env = dict(self.env)
        if self.fault_file is not None:
            env.setdefault(FAULT_FILE_ENV, str(self.fault_file))
        self.launches += 1
        if again:
            where = "" if placed is None else f" on {','.join(placed)}"
            self.log(f"starting the training step again{where} (launch {self.launches})")
            self.timeline.mark("relaunched", attempt=self.launches, nodes=",".join(placed or ()))
        try:
            launch = Launch.start(
                command,
                env,
                started=self.clock(),
                fault_file=env.get(FAULT_FILE_ENV),
                nodes=self._allocation_hosts if self.job is not None else None,
            )
        except OSError as e:
            self.log(f"cannot start the training step `{command[0]}`: {e}")
            return None
        launch.after = self._ended_at if again else None
        return launch

    def _tasks_per_node(self) -> int | None:
        return self.config.tasks_per_node or tasks_per_node(self.env)

    def _wait(self, launch: Launch) -> int:
        # A signal handler only queues the signal: the work (scontrol, requeue) happens here.
        def tick() -> None:
            self._handle_signals(launch.proc)
            self._watch(launch)

        return launch.wait(_POLL_S, tick)

    def _watch(self, launch: Launch) -> None:
        """Faults named the moment they are read; a step stuck on a lost node ended."""
        now = self.clock()
        faults = launch.new_faults(now)
        if faults and self.job is not None:
            self.nodes.probe_soon(f.host for f in faults)
        for fault in faults:
            self.log(f"{fault.describe()}: the step cannot go on")
            self.timeline.mark(
                "fault",
                node=fault.host,
                rank=fault.rank,
                what=fault.what,
                reporter=fault.reporter,
                reported=round(fault.time, 3),
            )
        if self.job is not None:
            launch.end_if_stuck(now, self.scheduler, self.job, self.config.command_timeout)
            if any(c.kind == "restarted" and not c.spare for c in self._look_at_nodes(soon=True)):
                launch.lost_tasks(now)  # srun would wait for them until the time limit
            self._early_tick()
        launch.first_step(now, self.timeline.events)
        while launch.said:
            self.log(launch.said.pop(0))

    def _pause(self, seconds: float) -> int | None:
        """Wait ``seconds`` before the next launch, handling signals; the exit status when a
        SIGTERM ended the allocation meanwhile."""
        end = self.clock() + seconds
        while True:
            self._handle_signals(None)
            if self.early.handed_over:
                return 0
            if self.term is not None:
                return self._before_step()
            if self.clock() >= end:
                return None
            self.sleep(min(_POLL_S, max(0.0, end - self.clock())))

    # -- after a launch --------------------------------------------------------------------

    def _finish(self, rc: int, launch: Launch) -> int | None:
        """The verdict on a launch that exited with ``rc``: the batch script's exit status, or
        None to launch again in this allocation (after :attr:`_wait_s`)."""
        self._ended_at = self.clock()
        launch.first_step(self._ended_at, self.timeline.events, force=True)  # a short run's
        while launch.said:
            self.log(launch.said.pop(0))
        self.log(f"training step exited with status {rc}")
        events = self.timeline.events()
        self.timeline.mark("exited", rc=rc)
        if self.job is None:
            return rc
        if self.early.handed_over:  # whatever the step's end: the successor resumes
            self.log(
                f"handed over to job {self.early.job_id}: it resumes from the newest checkpoint"
            )
            return 0
        kind = end_kind(rc, self.term, self.config.no_retry)
        refused = launch.refused() if kind == "failed" else None
        if refused is not None:  # a setting error: never a failure, never retried
            return self._refused(refused)
        streak, here = Streak(), NO_ROOM
        if kind in ("failed", "store"):
            events = self._history(events)
        if kind == "failed":
            if self.nodes.lost(f.host for f in launch.faults):
                self._look_at_nodes()  # one SLURM took out meanwhile is not in NodeList=
                self._release_lost()
            exited = Event("exited", self.clock(), self.restart, {"rc": rc})
            failed = self._mark_failed([*events, exited], rc, describe_status(rc), launch.faults)
            streak = failure_streak([*events, exited, failed])
        self._store_tries = self._store_tries + 1 if kind == "store" else 0
        if kind in ("failed", "store") and streak.count < self.config.max_failures:
            here = self._room(kind, events)
        verdict = decide(
            kind,
            rc,
            term=self.term,
            streak=streak,
            restarts=self.restart,
            config=self.config,
            requeued=self.requeued,
            here=here,
            store_tries=self._store_tries,
        )
        return self._act(verdict, kind, here)

    def _act(self, verdict: Verdict, kind: str, here: Room) -> int | None:
        if verdict.action == "give_up":
            return self._give_up(verdict)
        if kind == "slurm" and self._term_verdict is not None:
            verdict = self._term_verdict  # said when the SIGTERM came
        else:
            self.log(verdict.message)
        if verdict.action == "restart":
            self._wait_s = here.wait
            return None
        if verdict.action == "end":
            return verdict.code
        return self._requeue_job(verdict)

    def _history(self, events: Sequence[Event]) -> list[Event]:
        """``events`` (this job's timeline) after those of the chain's links before this job
        that can still count (:func:`slurmclock.chain.earlier`): a successor job's timeline
        starts empty, and its failures in a row, newest checkpoint and start-up are the run's.
        Read once (those jobs have ended); a link whose timeline cannot be read is skipped and
        named."""
        if self._earlier is None:
            self._earlier = found = earlier(self.timeline, env=self.env, enough=settled)
            if found.unread:
                s = "s" if len(found.unread) > 1 else ""
                self.log(
                    f"no readable timeline of job{s} {', '.join(found.unread)}, earlier in this "
                    "job's chain: skipped (the failures in a row are counted over the links "
                    "that can be read)"
                )
        return [*self._earlier.events, *events]

    def _restart_cost(self) -> RestartCost:
        return restart_cost(self._history(self.timeline.events()))

    def _room(self, kind: str, events: Sequence[Event]) -> Room:
        """Can the step start again in this allocation, and is it worth the time left?"""
        if not self.config.restart_here:
            return NO_ROOM
        placed = self._next_placement()
        if isinstance(placed, str):
            return Room(False, placed)
        wait = self._store_pause() if kind == "store" else 0.0
        cost = restart_cost(events).seconds(guess=self.config.startup_guess, steps=RESTART_STEPS)
        need = wait + cost + _MARGIN_S
        left = self._seconds_left()
        where = f"; {placed.why}" if placed is not None and placed.why else ""
        if left is None:
            return Room(True, f"no time limit known{where}", wait)
        said = f"{left:.0f} s left, a restart needs ~{need:.0f} s"
        if left < need:
            return Room(False, f"{said} in this allocation")
        self.placement = placed
        return Room(True, said + where, wait)

    def _next_placement(self) -> Placement | str | None:
        """Where the next launch goes: None as the first did; a reason when it cannot."""
        self._look_at_nodes()
        if not self.nodes.gone:
            return self.placement
        hosts = self._allocation_hosts()
        if not hosts:
            return "the allocation's nodes are not known (SLURM_JOB_NODELIST)"
        c = self.config
        placed = place(hosts, lost=self.nodes.gone, spare=c.spare_nodes, min_nodes=c.min_nodes)
        if isinstance(placed, str):
            return placed
        cap = c.step_nodes or len(placed.nodes)
        placed = Placement(placed.nodes[:cap], placed.healthy, placed.why)
        if self.scheduler.step_command(self._argv, placed.nodes) == list(self._argv):
            return f"`{self._argv[0]}` is not srun: the step cannot be placed on the nodes left"
        return placed

    def _look_at_nodes(self, *, soon: bool = False) -> list[NodeChange]:
        """The job's nodes as SLURM shows them now, never the list it started with (a node set
        DOWN left the job; one FAIL or DRAIN is named): those gone join the lost nodes.
        ``soon``: while the step runs, read in a thread and named at a later tick only.
        The changes named now."""
        hosts = (self._hosts or []) if soon else self._allocation_hosts()
        if self.job is None or len(hosts) <= 1:
            return []
        placed = self.placement.nodes if self.placement is not None else hosts
        spares = [h for h in hosts if h not in placed]
        hosts = [h for h in hosts if h.split(".")[0] not in self.nodes.gone]  # named already
        if soon:  # named now; left out at the next launch (the probes of a fault go first)
            self.states.look_soon(hosts, spares)
            return self.states.collect()
        found = self.states.look(hosts, spares)
        self.nodes.gone |= self.states.gone
        return found

    @contextmanager
    def _sentinel_step(self) -> Iterator[None]:
        """A job of several nodes: a sentinel on another node requeues it should this one,
        the batch node, be lost (:mod:`slurmclock.supervisor.sentinel`)."""
        path = self.timeline.path
        if self.job is not None and path is not None and len(self._allocation_hosts()) > 1:
            base = path.with_name(f"{path.stem}.{self.restart}")
            files = (Path(f"{base}.beat"), Path(f"{base}.sentinel-stop"))
            here = self.nodes.here
            self.sentinel = SentinelStep(self.scheduler, self.job, here, files, self.env, self.log)
        try:
            yield
        finally:
            if self.sentinel is not None:
                self.sentinel.stop()

    def _release_lost(self) -> None:
        """Give the lost nodes back to SLURM (``scontrol update JobId= NodeList=`` with the
        others: a job may shrink itself). Until SLURM marks a node DOWN -- SlurmdTimeout, 300 s
        by default -- a job that holds it cannot end: a requeue, or the job's own end, would
        wait that long."""
        hosts = self._allocation_hosts()
        keep = [h for h in hosts if h.split(".")[0] not in self.nodes.gone]
        if not keep or len(keep) == len(hosts) or self.job is None:
            return
        gone = [h for h in hosts if h not in keep]
        job, timeout, nodes = self.job, self.config.command_timeout, ",".join(keep)
        if self._tell(lambda: self.scheduler.release_nodes(job, keep, timeout=timeout)):
            self.log(
                f"gave node(s) {', '.join(gone)} back to SLURM (NodeList={nodes}): the job "
                "does not wait for them to end"
            )

    def _allocation_hosts(self) -> list[str]:
        if self._hosts is None:
            nodes, timeout = self.facts.nodes, self.config.command_timeout
            asked = self._ask(lambda: self.scheduler.hostnames(nodes, timeout=timeout))
            self._hosts = asked or []
        return self._hosts

    def _store_pause(self) -> float:
        first, most = self.config.store_pause
        return float(min(most, first * 2 ** max(0, self._store_tries - 1)))

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

    def _refused(self, line: str) -> int:
        message = (
            f"srun refused the step's settings ({quote(line)}): a setting error, not retried; "
            "fix the job's or the step's options and submit again"
        )
        self.log(message)
        self.timeline.mark("gave_up", why=message)
        return EXIT_USAGE

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
            self._signal_at = time.monotonic()

        handled = [signal.SIGTERM, signal.SIGUSR2]
        if self.config.successor_early:  # the early successor started: hand over to it
            handled.append(signal.SIGUSR1)
        previous = {s: signal.signal(s, queue) for s in handled}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _handle_signals(self, proc: Any) -> None:
        while self._pending:
            signum = self._pending.pop(0)
            if signum == signal.SIGUSR2:
                self._on_usr2(proc)
            elif signum == signal.SIGUSR1:
                self._on_handover(proc)
            else:
                self._on_term(proc)

    def _on_term(self, proc: Any) -> None:
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
            act = "handing the run to a successor job" if self.config.successor else ""
            act = act or f"requeueing job {self.job}"
            self.log(
                f"received SIGTERM at {what}: {act} now, before the "
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
        why = f"ended by {term_words(kind)}"
        verdict = requeue_or_end(why, EXIT_STOPPED, self.restart, self.config)
        if verdict.action != "requeue":
            self._term_verdict = verdict
            self.log(verdict.message)
            return
        self.requeued, impossible = self._requeue_planned()
        if impossible is not None:
            line = f"gave up: {impossible}; not requeueing. Resume: {self.config.resume_hint}"
            self._term_verdict = Verdict("end", EXIT_STOPPED, line)
            self._give_up(self._term_verdict)

    def _on_usr2(self, proc: Any) -> None:
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
        kill(proc.pid, signal.SIGUSR2)  # srun passes it on to every task
        self.timeline.mark("signal", name="USR2")

    def _forward_term(self, proc: Any) -> None:
        # Not through srun: it answers its own SIGTERM by killing the step within a second.
        # `scancel --signal` without --batch signals the job's steps, not this script.
        job, timeout = self.job, self.config.command_timeout
        if job is not None and self._tell(lambda: self.scheduler.signal(job, timeout=timeout)):
            return
        if proc is not None:
            kill(proc.pid, signal.SIGTERM)

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
        deadline = watcher.get()
        self._end_at = deadline.end if deadline.end is not None else self._end_at
        return deadline.seconds_left(self.clock())

    def _command_bound(self) -> float:
        """Seconds a SLURM command may take now: a tenth of the time left once the deadline is
        known (at most ``command_timeout``, at least 3 s); 5 s once a signal came, 1 s once a
        command went unanswered since."""
        ceiling = self.config.command_timeout
        if self._signal_at is not None:
            hung = getattr(getattr(self.scheduler, "runner", None), "last_unanswered", None)
            late = isinstance(hung, float) and hung >= self._signal_at
            ceiling = min(ceiling, _HUNG_S if late else _AFTER_SIGNAL_S)
        left = None if self._end_at is None else self._end_at - self.clock()
        return command_bound(left, ceiling=ceiling, floor=min(ceiling, _FLOOR_S))

    def _requeue_job(self, verdict: Verdict) -> int:
        """Requeue (the verdict said so), unless the partition cannot give the job its
        minimum any more: then the chain stops with one line."""
        ok, impossible = self._requeue_planned()
        if impossible is not None:
            line = f"gave up: {impossible}; not requeueing. Resume: {self.config.resume_hint}"
            return self._give_up(Verdict("give_up", verdict.code or 1, line))
        return 0 if ok else verdict.code

    def _requeue_planned(self) -> tuple[bool, str | None]:
        """``scontrol requeue``, and what the next allocation asks for (planned while the job
        runs: once SLURM has accepted, this process has KillWait seconds to live); (requeued,
        why the partition cannot give the job its minimum: then no requeue)."""
        plan = self._requeue_plan()
        if plan is not None and plan.give_up is not None:
            return False, plan.give_up
        with _sigterm_ignored():  # SLURM signals every process of the job once it accepts
            ok = self._requeue()
            if ok and plan is not None and not self.config.successor:
                self.nodes.apply(plan, self._tasks_per_node())
        return ok, None

    def _requeue_plan(self) -> RequeuePlan | None:
        """What the next allocation asks for, for a job of several nodes or with lost ones."""
        if self.facts.num_nodes <= 1 and not self.nodes.gone:
            return None
        view = self._job_view()
        if view is None:
            return None
        c, asked = self.config, self.facts.num_nodes
        return self._ask(
            lambda: self.nodes.before_requeue(
                view, c.min_nodes, asked=asked, keep_out=c.exclude_failed_nodes
            )
        )

    def _requeue(self) -> bool:
        if self.config.successor:
            return self._hand_over()
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
        self.log(f"{result.message}; requeue failed: {self.config.resume_hint}")
        return False

    def _hand_over(self) -> bool:
        """A successor job instead of a requeue (``--successor``; :mod:`.successor`); the one
        submitted early when it still waits (or runs)."""
        if self._early_waits():
            return True
        self.early.done = True  # submitted now: none early after this
        c, job = self.config, self.job or ""
        floor = time_min_floor(self._restart_cost(), guess=c.startup_guess)
        result = submit_successor(
            job,
            c.successor,
            env=self.env,
            max_chain=c.max_restarts,
            time_min=c.successor_time_min,
            floor=floor,
            runner=getattr(self.scheduler, "runner", None),
            timeout=c.command_timeout,
            exports=self._early_exports() if c.successor_early else None,
        )
        self.log(result.message if result.ok else f"{result.message}: {c.resume_hint}")
        if result.ok:
            self.timeline.mark("requeued", successor=result.job_id)
        return result.ok

    # -- a successor already waiting (--successor-early; :mod:`.handover`) -----------------

    def _runner(self) -> Runner:
        run = getattr(self.scheduler, "runner", None)
        return SubprocessRunner() if run is None else run

    def _early_tick(self) -> None:
        """Plan the early successor at the first tick of the step, submit it when due."""
        e = self.early
        if not self.config.successor_early or e.done or self.term is not None:
            return  # (a SIGTERM: the allocation ends, its successor is decided there)
        if not e.planned:
            e.planned = True
            self._plan_early()
        elif e.at is not None and self.clock() >= e.at:
            self._submit_early()

    def _plan_early(self) -> None:
        now, e = self.clock(), self.early
        times = own_times(self.job or "", self._runner(), self.config.command_timeout)
        e.waits, bad = chain_waits(self.env)
        if bad:
            self.log(f"{WAITS}: {bad} item(s) that are not seconds skipped")
        if times is not None:
            e.waits.append(times[1] - times[0])
        left = self._seconds_left()
        end = None if left is None else now + left
        e.at, why = plan_submit(started=now if times is None else times[1], end=end, waits=e.waits)
        if e.at is None:
            e.done = True
            self.log(why)
            return
        when = time.strftime("%H:%M:%S", time.localtime(e.at))
        self.log(
            f"the successor is submitted early at {when}, in {max(0.0, e.at - now):.0f} s ({why})"
        )

    def _submit_early(self) -> None:
        c, e = self.config, self.early
        e.done = True
        floor = time_min_floor(self._restart_cost(), guess=c.startup_guess)
        result = submit_successor(
            self.job or "",
            c.successor,
            env=self.env,
            max_chain=c.max_restarts,
            time_min=c.successor_time_min,
            floor=floor,
            runner=self._runner(),
            timeout=c.command_timeout,
            exports=self._early_exports(),
            early=True,
        )
        if result.ok:
            e.job_id = result.job_id
            self.log(result.message)
            return
        self.log(
            f"could not submit the successor early ({result.message}): it is submitted at "
            "the stop instead, as with --successor"
        )

    def _early_exports(self) -> dict[str, str]:
        e = self.early
        return early_exports(self.job or "", e.waits if e.planned else chain_waits(self.env)[0])

    def _early_waits(self) -> bool:
        """The early successor still waits (or runs): the run goes on in it, no second one."""
        job = self.early.job_id
        if job is None:
            return False
        try:
            state = job_state(job, self._runner(), self.config.command_timeout)
        except CommandError:
            state = "PENDING"  # SLURM took it; a second successor would race it for the run
        if state != "PENDING" and state not in HOLDING:
            self.log(
                f"job {job}, the successor submitted early, is {state or 'gone'}: "
                "submitting one now"
            )
            self.early.job_id = None
            return False
        self.early.kept = True
        self.log(f"job {job}, submitted early, already waits to resume from the newest checkpoint")
        self.timeline.mark("requeued", successor=job)
        return True

    def _on_handover(self, proc: Any) -> None:
        """SIGUSR1: the early successor started; save (SIGTERM to the step) and hand over."""
        e, job = self.early, self.early.job_id
        if job is None or e.handed_over:
            if job is None:
                self.log("received SIGUSR1: no successor of this job was submitted early: ignored")
            return
        try:
            state = job_state(job, self._runner(), self.config.command_timeout)
        except CommandError:
            state = "RUNNING"  # squeue did not answer: its successor's word is taken
        if state not in HOLDING:
            self.log(
                f"received SIGUSR1, but job {job} (the successor) is {state or 'gone'}: ignored"
            )
            return
        e.handed_over = True
        self.log(f"received SIGUSR1: job {job}, the successor, started: saving and handing over")
        self.timeline.mark("signal", name="USR1", kind="handover", successor=job)
        self._forward_term(proc)

    def _settle_early(self, code: int) -> int:
        """The run does not go on in the early successor (finished, stopped, gave up,
        cancelled): cancel it, no orphan left pending."""
        e = self.early
        if e.job_id is None or e.handed_over or e.kept:
            return code
        try:
            self._runner()(["scancel", e.job_id], self.config.command_timeout)
        except CommandError as err:
            why = last_line(err.stderr) or str(err)
            self.log(
                f"could not cancel job {e.job_id}, the successor submitted early ({why}): "
                "scancel it"
            )
            return code
        self.log(f"cancelled job {e.job_id}, the successor submitted early: the run does not go on")
        return code

    def _await_predecessor(self) -> int | None:
        """An early successor: the job before it saves, hands over and ends first."""
        pred = self.env.get(PREDECESSOR, "").strip()
        if not pred or pred == self.job or not pred.replace("_", "").isdigit():
            return None
        bound = handover_bound(self._seconds_left())
        c = self.config
        w = Waiter(
            self._runner(), self.clock, self.sleep, self.log, self._stop_came, c.command_timeout
        )
        return await_predecessor(pred, bound, w)

    def _stop_came(self) -> bool:
        self._handle_signals(None)
        return self.term is not None


@contextmanager
def _sigterm_ignored() -> Iterator[None]:
    """SIGTERM ignored (and so in the commands started meanwhile): SLURM sends it to every
    process of the job as soon as it accepts a requeue of a running job."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
