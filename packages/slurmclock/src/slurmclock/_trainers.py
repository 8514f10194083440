"""What the Lightning and Hugging Face callbacks share: budget, signals, step timing, exit code.

Not public: use :mod:`slurmclock.lightning` or :mod:`slurmclock.hf`. Stdlib only, like the rest of
slurmclock; the trainer-specific modules import their library.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from slurmclock.budget import Decision, TimeBudget
from slurmclock.deadline import Deadline, DeadlineWatcher
from slurmclock.signals import StopSignals, signal_number
from slurmclock.timeline import JobTimeline

log = logging.getLogger("slurmclock")

EXIT_STOPPED = 75  # EX_TEMPFAIL, as pyrecover-train: stopped early with a checkpoint; requeue
EXIT_FINISHED = 0


class StopPolicy:
    """A :class:`TimeBudget` fed by step boundaries, with stop signals that only raise a flag.

    ``begin()`` at the start of training (installs the signal handlers), ``after_step()`` at each
    optimizer-step boundary (records the step, returns the decision), ``paused()`` after work that
    is not a step (a save) so it is not counted as one, ``end()`` puts the handlers back.

    The budget it builds keeps the job's :class:`JobTimeline` (a no-op outside SLURM), as
    pyrecover-train's does: ``final_save_done()`` marks ``saved`` when the stop's save is durable,
    ``slurmclock requeue`` marks ``requeued``, and the next allocation's budget starts from that
    measured exit instead of the initial guess.
    """

    def __init__(
        self,
        *,
        budget: TimeBudget | None,
        deadline: DeadlineWatcher | Deadline | None,
        margin: float | None,
        initial_save_estimate: float,
        warmup_steps: int,
        signals: Iterable[str | int],
        timer: Callable[[], float] = time.monotonic,
        timeline: JobTimeline | None = None,
    ) -> None:
        self.signals = StopSignals(tuple(signals) or ("USR2", "TERM"), chain=False)
        if budget is None:
            budget = TimeBudget(
                DeadlineWatcher() if deadline is None else deadline,
                margin=margin,
                initial_save_estimate=initial_save_estimate,
                warmup_steps=warmup_steps,
                signals=self.signals,
                timeline=JobTimeline() if timeline is None else timeline,
            )
        elif budget.signals is None:
            budget.signals = self.signals
        self.budget = budget
        self._timer = timer
        self._last: float | None = None
        self.decision: Decision | None = None

    def add_signal(self, sig: str | int) -> None:
        """Also stop on ``sig`` (e.g. Lightning's requeue signal, taken over); before ``begin``."""
        number = signal_number(sig)
        if number not in self.signals.signals:
            self.signals.signals = (*self.signals.signals, number)

    def begin(self) -> None:
        self.signals.install()
        self._last = self._timer()

    def now(self) -> float:
        return self._timer()

    def after_step(self, *, watch_clock: bool = True) -> Decision:
        """Record the step; decide. ``watch_clock=False`` (ranks other than 0) answers from the
        stop signals alone: rank 0 owns the deadline and the measured save times, so SLURM is
        polled once per job, not once per rank, and the ranks' agreement spreads its decision."""
        now = self._timer()
        if self._last is not None:
            self.budget.record_step(now - self._last)
        self._last = now
        if watch_clock:
            self.decision = self.budget.should_stop()
        elif self.signals.requested:
            self.decision = Decision(True, f"stop: received {self.signals.received}", None)
        else:
            self.decision = Decision(False, "continue: rank 0 watches the clock", None)
        return self.decision

    def paused(self) -> None:
        """The time since the last step boundary was not training (a save, an evaluation)."""
        self._last = self._timer()

    def time_save(self, seconds: float, *, background: bool = False) -> None:
        """A save's time until durable; ``background``: training went on meanwhile."""
        self.budget.record_save(seconds, background=background)

    def final_save_done(self) -> None:
        """The stop's checkpoint is durable: what follows until the requeue is the exit that the
        next allocation's budget keeps free (rank 0's timeline only writes)."""
        if self.budget.timeline is not None:
            self.budget.timeline.mark("saved")

    def end(self) -> None:
        self.signals.restore()


class TimeAware:
    """The part of both callbacks a user reads: ``budget``, ``stopped_early``, ``exit_code``."""

    policy: StopPolicy
    stopped_early: bool = False

    @property
    def budget(self) -> TimeBudget:
        return self.policy.budget

    @property
    def exit_code(self) -> int:
        """75 (EX_TEMPFAIL) after an early stop with steps left, 0 otherwise."""
        return EXIT_STOPPED if self.stopped_early else EXIT_FINISHED


def stop_message(step: int, total: int | None, decision: Decision | None, why: str) -> str:
    of = f"/{total}" if total else ""
    reason = decision.reason if decision is not None else why
    return f"slurmclock: stopping at step {step}{of} ({reason}); exit {EXIT_STOPPED} = resume later"
