"""One launch of the training step: its process, the faults its ranks report, and its end.

``srun`` cannot finish a step while one of its nodes does not answer: it waits for that node's
tasks until SLURM marks the node DOWN (``SlurmdTimeout``, 300 s by default), also after the
healthy ranks have left (ddpkit's watchdog: exit 69 within seconds of a dead or frozen peer).
So once a rank reports a fault the supervisor gives ``srun`` :data:`GRACE_S` to end by itself
(it does when the node is alive: a rank died, not its node), then ends the step through SLURM
(``scancel JOB.STEP``: the tasks on the nodes that answer are killed, and ``srun`` gives up on
the others within seconds), and after :data:`KILL_S` more kills ``srun`` itself. Measured on
SLURM 22.05 with a node's slurmd and tasks SIGKILLed: ``srun`` never notices by itself; after
the ``scancel`` it says "Timed out waiting for job step to complete" and exits 7 s later.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from slurmclock.commands import CommandError
from slurmclock.job import PROBE_NAME, Scheduler
from slurmclock.supervisor.faults import Fault, FaultWatch
from slurmclock.supervisor.verdict import srun_refusal
from slurmclock.timeline import Event
from slurmclock.untrusted import read_bytes

__all__ = ["GRACE_S", "KILL_S", "LOOK_S", "Launch", "kill"]

_NOT_TRAINING = (PROBE_NAME, "slurmclock-sentinel")  # the supervisor's own steps
GRACE_S = 3.0  # after a fault report: srun's time to end the step by itself
LOOK_S = 1.0  # how often a relaunch's first step is looked for in the job's timeline
KILL_S = 3.0  # after `scancel JOB.STEP`: srun's time to leave before it is killed
JOB_LOG = "/proc/self/fd/2"  # the job log, where srun's own errors go: read for a refusal
REFUSAL_BYTES = 64 * 1024  # of it, the newest since the launch (srun refuses in a few lines)


@dataclass(eq=False)
class Launch:
    """A running step (``proc``) started at ``started`` (epoch seconds), with ``watch`` on
    the fault file from then on. ``reported``: when the first fault was read; ``cancelled``:
    the step SLURM was asked to end, and when; ``killed``: srun was SIGKILLed."""

    proc: subprocess.Popen[bytes]
    started: float
    watch: FaultWatch
    reported: float | None = None
    cancelled: tuple[str, float] | None = None
    killed: bool = False
    said: list[str] = field(default_factory=list)
    after: float | None = None  # a relaunch: when the step before it failed
    looked: float = 0.0  # when the timeline was last read for this launch's first step
    log_at: int | None = None  # the job log's size at the start (None: stderr is no file)

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        started: float,
        fault_file: str | None,
        nodes: Callable[[], Collection[str]] | None = None,
    ) -> Launch:
        """Start ``argv`` (OSError when it cannot); ranks report faults to ``fault_file``, of
        which only those naming one of ``nodes`` (the job's) count."""
        watch = FaultWatch(fault_file, started, nodes=nodes)
        log_at = _log_size()
        proc = subprocess.Popen(list(argv), env=dict(env))
        return cls(proc, started, watch, log_at=log_at)

    def refused(self) -> str | None:
        """The line in which srun refused the step's settings, read from the job log (this
        process's stderr, when it is a file: SLURM's ``--error``/``--output``) since the
        launch; None when it did not, or the log cannot be read."""
        if self.log_at is None:
            return None
        try:
            data, _, _ = read_bytes(JOB_LOG, offset=self.log_at, limit=REFUSAL_BYTES)
        except OSError:
            return None
        return srun_refusal(data.decode(errors="replace"))

    @property
    def faults(self) -> list[Fault]:
        return self.watch.seen

    def first_step(
        self, now: float, events: Callable[[], Sequence[Event]], *, force: bool = False
    ) -> None:
        """A relaunch: once its trainer marked ``first_step`` in the job's timeline (read at
        most every :data:`LOOK_S`, unless ``force``), one line says how long training stood
        still."""
        if self.after is None or (now - self.looked < LOOK_S and not force):
            return
        self.looked = now
        seen = list(events())
        starts = [i for i, ev in enumerate(seen) if ev.name == "relaunched"]
        for ev in seen[starts[-1] if starts else len(seen) :]:  # after this launch's mark
            if ev.name == "first_step":
                self.said.append(
                    f"training again: the first step of this launch was done "
                    f"{ev.time - self.after:.0f} s after the step before it ended (start-up "
                    f"{ev.time - self.started:.0f} s)"
                )
                self.after = None
                return

    def new_faults(self, now: float) -> list[Fault]:
        """Reports that came since the last call; the first one starts the grace period."""
        fresh = self.watch.new()
        self.said += self.watch.said  # what the watch ignored or skipped, quoted
        self.watch.said.clear()
        if fresh and self.reported is None:
            self.reported = now
        return fresh

    def lost_tasks(self, now: float) -> None:
        """Some of the step's tasks are gone without a word (their node restarted): ended as
        after a fault report, by :meth:`end_if_stuck`."""
        if self.reported is None:
            self.reported = now

    def end_if_stuck(self, now: float, scheduler: Scheduler, job: str, timeout: float) -> None:
        """After a fault report: the step ended through SLURM once :data:`GRACE_S` has passed,
        srun killed :data:`KILL_S` after that. What was done is appended to :attr:`said`."""
        if self.reported is None or self.proc.poll() is not None:
            return
        if self.cancelled is None and now - self.reported >= GRACE_S:
            step = self._newest_step(scheduler, job, timeout)
            self.cancelled = (step or "", now)
            if step is not None:
                try:
                    scheduler.cancel_step(step, timeout=timeout)
                    self.said.append(f"srun still waits on the step's nodes: ended {step}")
                except CommandError as e:
                    self.said.append(f"could not end step {step}: {e}")
        elif self.cancelled is not None and not self.killed and now - self.cancelled[1] >= KILL_S:
            self.killed = True
            kill(self.proc.pid, signal.SIGKILL)
            self.said.append("srun did not leave: killed it (SIGKILL)")

    def _newest_step(self, scheduler: Scheduler, job: str, timeout: float) -> str | None:
        """The job's newest training step (a stuck older one has a lower number; the
        supervisor's node probes are named apart)."""
        try:
            steps = scheduler.steps(job, timeout=timeout)
        except CommandError as e:
            self.said.append(f"could not list the job's steps: {e}")
            return None
        mine = [s for s in steps if s.number is not None and s.name not in _NOT_TRAINING]
        newest = max(mine, key=lambda s: s.number or 0, default=None)
        return None if newest is None else newest.id

    def wait(self, poll: float, on_tick: Callable[[], None]) -> int:
        """``on_tick()`` every ``poll`` seconds until the step exits; its status as a shell
        reports it (128+N when killed by signal N)."""
        while True:
            on_tick()
            try:
                rc = self.proc.wait(timeout=poll)
                break
            except subprocess.TimeoutExpired:
                continue
        on_tick()  # what came with the exit
        return 128 - rc if rc < 0 else rc


def _log_size() -> int | None:
    try:
        st = os.fstat(2)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def kill(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass  # the step has just exited
