"""The time budget: is there time for one more step, and for a save?

``should_stop()`` is true exactly when ``seconds_left < next step + final save + margin``:

* *next step* -- a high quantile (default p90) of the last ``step_window`` measured steps, after
  skipping the first ``warmup_steps`` (compilation, cache warm-up: they must not inflate the
  estimate for the rest of the run). While only warm-up steps exist, the latest of them is used
  (an over-estimate early in a job costs nothing).
* *final save* -- the longest of the last ``save_window`` measured saves (saves are few and vary
  with the file system; the first one may include one-off setup and ages out). Before any save
  is measured, ``initial_save_estimate`` (default 60 s) stands in: set it from experience with
  your model size and storage.
* *margin* -- slack for everything else before the kill (flushing logs, requeueing, process
  exit, estimate error); default 60 s.

Measure saves until the checkpoint is durable: for asynchronous saves include the wait for the
background write, because the final save must be complete before SLURM's SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from slurmclock.deadline import Deadline, DeadlineWatcher

__all__ = ["BudgetConfig", "Decision", "RobustEstimate", "StopFlag", "TimeBudget"]

log = logging.getLogger("slurmclock")


def _fmt(seconds: float, *, down: bool = False) -> str:
    """Readable at both ends (``0.05`` for a fast step, ``3541`` for an hour left); ``down``
    rounds towards less time, so "59.9 s left < 60.0 s needed" never reads "60 < 60"."""
    digits = 2 if abs(seconds) < 10 else 1 if abs(seconds) < 1000 else 0
    if down:
        seconds = math.floor(seconds * 10**digits) / 10**digits
    return f"{seconds:.{digits}f}"


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to a yes/no question, with the numbers behind it.

    Truthy when the answer is *yes*: ``if budget.should_stop():`` stops, ``if budget.can_save():``
    saves. ``stop`` and ``ok`` are the same value under the names that read well for each
    question. ``seconds_left`` is None without a deadline; ``needed`` is what the answer compared
    it with.
    """

    yes: bool
    reason: str
    seconds_left: float | None
    needed: float | None = None

    def __bool__(self) -> bool:
        return self.yes

    @property
    def stop(self) -> bool:
        return self.yes

    @property
    def ok(self) -> bool:
        return self.yes


class StopFlag(Protocol):
    """What the budget needs of :class:`slurmclock.StopSignals` (or any other stop flag)."""

    @property
    def requested(self) -> bool: ...

    @property
    def received(self) -> str | None: ...


class RobustEstimate:
    """A high quantile of recent samples, ignoring the first ``skip`` (warm-up) samples."""

    def __init__(self, *, skip: int = 0, window: int = 50, quantile: float = 0.9) -> None:
        self.skip, self.quantile = skip, quantile
        self.count = 0
        self._recent: deque[float] = deque(maxlen=window)
        self._last_warmup: float | None = None

    def add(self, seconds: float) -> None:
        self.count += 1
        if self.count <= self.skip:
            self._last_warmup = seconds
        else:
            self._recent.append(seconds)

    @property
    def value(self) -> float | None:
        if not self._recent:
            return self._last_warmup
        ordered = sorted(self._recent)
        # Nearest-rank quantile: with few samples this is the max, which is what we want.
        return ordered[max(0, math.ceil(self.quantile * len(ordered)) - 1)]

    def describe(self, what: str) -> str:
        if self.count == 0:
            return f"no {what} measured yet"
        if not self._recent:
            return f"warm-up {what} ({self.count} measured)"
        q = "max" if self.quantile >= 1 else f"p{self.quantile * 100:g}"
        return f"{q} of last {len(self._recent)} {what}s"


@dataclass(kw_only=True, slots=True)
class BudgetConfig:
    """Knobs of :class:`TimeBudget` (see the module docstring for what each one does)."""

    margin: float = 60.0
    initial_save_estimate: float = 60.0
    warmup_steps: int = 2
    step_window: int = 50
    step_quantile: float = 0.9
    save_window: int = 5

    def __post_init__(self) -> None:
        for name in ("margin", "initial_save_estimate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (
                isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
            ):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        for name in ("warmup_steps", "step_window", "save_window"):
            value, low = getattr(self, name), 0 if name == "warmup_steps" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not (isinstance(self.step_quantile, (int, float)) and 0 < self.step_quantile <= 1):
            raise ValueError(
                f"step_quantile must be in (0, 1], e.g. 0.9 for p90, got {self.step_quantile!r}"
            )


class TimeBudget:
    """Decides when to stop so that the final checkpoint is written before the job is killed.

    ``deadline``: a :class:`DeadlineWatcher` (re-polled at its own bounded rate), a fixed
    :class:`Deadline`, or None (no deadline: never stops for time). ``signals``: an optional stop
    flag (e.g. :class:`slurmclock.StopSignals`); once it is raised ``should_stop()`` says yes.
    ``clock`` gives epoch seconds for "now" (default: the watcher's clock, else ``time.time``);
    ``timer`` measures durations (default: ``clock`` when given, else ``time.monotonic``).
    Other keywords are :class:`BudgetConfig` fields.
    """

    def __init__(
        self,
        deadline: DeadlineWatcher | Deadline | None = None,
        *,
        margin: float = 60.0,
        initial_save_estimate: float = 60.0,
        warmup_steps: int = 2,
        step_window: int = 50,
        step_quantile: float = 0.9,
        save_window: int = 5,
        signals: StopFlag | None = None,
        clock: Callable[[], float] | None = None,
        timer: Callable[[], float] | None = None,
    ) -> None:
        if deadline is not None and not isinstance(deadline, (Deadline, DeadlineWatcher)):
            raise TypeError(
                f"deadline must be a DeadlineWatcher, a Deadline or None, got {type(deadline)!r}"
            )
        self.config = BudgetConfig(
            margin=margin,
            initial_save_estimate=initial_save_estimate,
            warmup_steps=warmup_steps,
            step_window=step_window,
            step_quantile=step_quantile,
            save_window=save_window,
        )
        self._deadline = deadline
        self.signals = signals
        if clock is None:
            clock = deadline.clock if isinstance(deadline, DeadlineWatcher) else time.time
        self._clock = clock
        self._timer = timer or (clock if clock is not time.time else time.monotonic)
        self._steps = RobustEstimate(skip=warmup_steps, window=step_window, quantile=step_quantile)
        self._saves = RobustEstimate(skip=0, window=save_window, quantile=1.0)

    # -- measuring --------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time the body as one training step (not recorded if it raises)."""
        start = self._timer()
        yield
        self.record_step(self._timer() - start)

    @contextlib.contextmanager
    def save(self) -> Iterator[None]:
        """Time the body as one checkpoint save, until durable (not recorded if it raises)."""
        start = self._timer()
        yield
        self.record_save(self._timer() - start)

    def record_step(self, seconds: float) -> None:
        """Add a measured step duration."""
        if self._valid("step", seconds):
            self._steps.add(float(seconds))

    def record_save(self, seconds: float) -> None:
        """Add a measured save duration (until the checkpoint is durable)."""
        if self._valid("save", seconds):
            self._saves.add(float(seconds))

    @staticmethod
    def _valid(what: str, seconds: float) -> bool:
        # A bad measurement (clock jumped back) is dropped, not raised: training goes on.
        if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0:
            return True
        log.warning("ignoring %s duration %r: not a finite number of seconds >= 0", what, seconds)
        return False

    @property
    def steps_measured(self) -> int:
        return self._steps.count

    @property
    def saves_measured(self) -> int:
        return self._saves.count

    @property
    def step_estimate(self) -> float | None:
        """Robust estimate of the next step's duration; None before the first step."""
        return self._steps.value

    @property
    def save_estimate(self) -> float | None:
        """Estimate of a save's duration from measured saves; None before the first one."""
        return self._saves.value

    # -- deciding ---------------------------------------------------------------------------

    def deadline(self) -> Deadline | None:
        """The current deadline (the watcher re-polls SLURM at its own bounded rate)."""
        if isinstance(self._deadline, DeadlineWatcher):
            return self._deadline.get()
        return self._deadline

    def seconds_left(self) -> float | None:
        """Seconds until the deadline; None without one."""
        d = self.deadline()
        return None if d is None else d.seconds_left(self._clock())

    def _save_needed(self) -> tuple[float, str]:
        measured = self._saves.value
        if measured is None:
            return self.config.initial_save_estimate, "initial guess, no save measured yet"
        return measured, self._saves.describe("save")

    def needed_to_stop(self) -> float:
        """Seconds the next step, a final save and the margin need together."""
        return (self._steps.value or 0.0) + self._save_needed()[0] + self.config.margin

    def should_stop(self) -> Decision:
        """Stop now? Yes when a stop signal arrived or time left < next step + save + margin."""
        left = self.seconds_left()
        step = self._steps.value or 0.0
        save, save_how = self._save_needed()
        needed = step + save + self.config.margin
        parts = (
            f"next step {_fmt(step)} s ({self._steps.describe('step')}) + final save "
            f"{_fmt(save)} s ({save_how}) + margin {_fmt(self.config.margin)} s"
        )
        if self.signals is not None and self.signals.requested:
            when = "" if left is None else f"; {_fmt(left, down=True)} s left"
            return Decision(True, f"stop: received {self.signals.received}{when}", left, needed)
        if left is None:
            return Decision(False, f"continue: {self._no_deadline()}", None, needed)
        if left < needed:
            return Decision(
                True,
                f"stop: {_fmt(left, down=True)} s left < {_fmt(needed)} s needed = {parts}",
                left,
                needed,
            )
        return Decision(
            False,
            f"continue: {_fmt(left, down=True)} s left >= {_fmt(needed)} s needed = {parts}",
            left,
            needed,
        )

    def can_save(self) -> Decision:
        """Can a save started now finish (plus the margin) before the deadline?"""
        left = self.seconds_left()
        save, save_how = self._save_needed()
        needed = save + self.config.margin
        parts = f"save {_fmt(save)} s ({save_how}) + margin {_fmt(self.config.margin)} s"
        if left is None:
            return Decision(True, f"save fits: {self._no_deadline()}", None, needed)
        if left < needed:
            return Decision(
                False,
                f"no time to save: {_fmt(left, down=True)} s left < {_fmt(needed)} s = {parts}",
                left,
                needed,
            )
        return Decision(
            True,
            f"save fits: {_fmt(left, down=True)} s left >= {_fmt(needed)} s = {parts}",
            left,
            needed,
        )

    def _no_deadline(self) -> str:
        d = self.deadline()
        return f"no deadline ({'not given' if d is None else d}), never stops for time"

    def snapshot(self) -> dict[str, Any]:
        """Everything the budget knows, JSON-ready, for logs."""
        d = self.deadline()
        return {
            "deadline": None if d is None else d.iso(),
            "deadline_source": None if d is None else d.source,
            "seconds_left": self.seconds_left(),
            "step_estimate": self.step_estimate,
            "save_estimate": self.save_estimate,
            "steps_measured": self.steps_measured,
            "saves_measured": self.saves_measured,
            "margin": self.config.margin,
            "needed_to_stop": self.needed_to_stop(),
            "stop_signal": None if self.signals is None else self.signals.received,
        }
