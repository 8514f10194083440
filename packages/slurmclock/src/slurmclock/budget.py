"""The time budget: is there time for one more step, and for the final save?

``should_stop()`` is true exactly when ``seconds_left < next step + final save + exit + slack``:

* *next step* -- a high quantile (default p90) of the last ``step_window`` measured steps, after
  skipping the first ``warmup_steps`` (compilation, cache warm-up). Until this run measured a
  step after its warm-up, the steps of earlier allocations (:meth:`TimeBudget.load_state_dict`)
  stand in, then the latest warm-up step, then ``initial_step_estimate``.
* *final save* -- a tail bound of the measured saves (until durable): the ``save_quantile``
  (default 99.5 %) prediction bound of a log-normal fitted to the last ``save_window`` saves,
  whose spread is pooled with a prior of ``SAVE_PRIOR_SPREAD`` worth ``SAVE_PRIOR_WEIGHT``
  saves. Steady saves get a bound close to their median; a file system whose save times scatter
  gets a wide one. Saves written in the background while training went on (async, timed until
  durable) are slower than the final save, which has the machine to itself: they are kept
  apart (``record_save(background=True)``), with their own median and a pooled spread, so they
  do not inflate the final save's bound. A stall -- a save slower than ``STALL_FACTOR`` (4) times
  the median of the others -- counts as 4 x that median: one hung store cannot move the bound
  of this run or, through the checkpoint, of the next ones by orders of magnitude. Before any
  save is measured: ``initial_save_estimate``; by default (None) :data:`SAVE_GUESS` (60 s), at
  most :data:`SAVE_GUESS_SHARE` (a quarter) of the time left when the budget first looked at
  its deadline: a 60 s test job trains for 40 s instead of stopping at its first step.
* *exit* -- what the job needs after its final save is durable: process exit, ``srun``
  teardown and the batch script's ``scontrol requeue``. Measured per allocation from the
  timestamps in the job's :class:`~slurmclock.JobTimeline` (1.25 x the longest of the last
  ``exit_window``), remembered across allocations in :meth:`TimeBudget.state_dict`. Before
  anything was measured (a job's first allocation): ``initial_exit_estimate`` when given, else
  from this allocation's measured *launch* (allocation start -> this process's start: batch
  script, ``srun``, Python; :meth:`TimeBudget.record_launch`), which the exit retraces
  backwards: ``EXIT_GUESS_BASE + EXIT_PER_LAUNCH x launch`` (1 s + 2 x launch; on a local
  SLURM 22.05, one node, launches of 0.4-0.85 s, as squeue's whole seconds give them, and exits
  of 0.3-0.6 s, 2.2 s once at a load average of 30; a
  :class:`~slurmclock.TimeLoop` records the launch in a job on one node only), else
  ``EXIT_GUESS`` (5 s).
* *slack* -- 2 s for the rest: the end time's whole seconds, clock skew between nodes.

``margin=`` (pyrecover-train's ``--stop-margin``) overrides *exit + slack* with a fixed number.

The bound keeps the final save safe, so it usually ends well before it must: a save of median
90 s and a wide spread gets ~330 s. ``extra_save()`` spends that time after the final save is
durable: train on and save once more, abandoning that save (the final one stands) if it is not
durable by the time the exit must begin. It picks how long to train to maximize the training
time expected to be persisted (training time x chance that the save is in time).

Warning signals are information: SLURM's ``--signal=B:USR2@LEAD`` arrives LEAD to LEAD+30 s
before the end. With the lead known (``signal_lead=`` or ``PYRECOVER_SIGNAL_LEAD``), a warning
that agrees with the known deadline changes nothing; without a known deadline it sets one
(receipt + lead); one that says the end comes earlier than the known deadline wins. Any other
signal (TERM, INT, ``request()``), or a warning whose lead is unknown, stops at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slurmclock.deadline import Deadline, DeadlineWatcher
from slurmclock.durations import check_seconds
from slurmclock.signals import (
    LEAD_ENV,
    SignalMeaning,
    StopFlag,
    signal_lead_from_env,
    signal_name,
)
from slurmclock.untrusted import MAX_LINE, parse_record, quote, read_bytes

if TYPE_CHECKING:
    from slurmclock.timeline import Event, ExitSample, JobTimeline

__all__ = [
    "SAVE_PRIOR_SPREAD",
    "SAVE_PRIOR_WEIGHT",
    "BudgetConfig",
    "Decision",
    "ExtraSave",
    "RobustEstimate",
    "SaveTail",
    "TimeBudget",
]

log = logging.getLogger("slurmclock")

# Spread (standard deviation of log-seconds) assumed for save times before many are measured:
# a save may take ~1.35x its median now and then. Weighted as four saves, so a few steady
# measurements do not yet claim a steady file system. (x1.2 let a job's second allocation on a
# file system whose saves scatter by x1.65 overrun the bound in 2-4% of allocations; the time
# x1.35 keeps free on a steady one is mostly won back by extra saves.)
SAVE_PRIOR_SPREAD = 0.3
SAVE_PRIOR_WEIGHT = 4.0
# A save slower than this times the median of the others is a stall (a store that hung), and
# counts as this much: one stall cannot move the bound by orders of magnitude (_tame).
STALL_FACTOR = 4.0
# A save before one is measured: 60 s, at most a quarter of the time the run has (_save_guess).
SAVE_GUESS, SAVE_GUESS_SHARE = 60.0, 0.25
EXIT_FACTOR = 1.25  # the exit bound: this times the longest measured exit
# The exit before one is measured: from this allocation's launch when known, else a guess.
EXIT_GUESS_BASE, EXIT_PER_LAUNCH, EXIT_GUESS = 1.0, 2.0, 5.0
EXTRA_EXIT_FACTOR = 1.5  # after an extra save: this times the exit bound
STATE_VERSION = 1


def _fmt(seconds: float, *, down: bool = False) -> str:
    """Readable at both ends (``0.05`` for a fast step, ``3541`` for an hour left); ``down``
    rounds towards less time, so "59.9 s left < 60.0 s needed" never reads "60 < 60"."""
    digits = 2 if abs(seconds) < 10 else 1 if abs(seconds) < 1000 else 0
    if down:
        seconds = math.floor(seconds * 10**digits) / 10**digits
    return f"{seconds:.{digits}f}"


@dataclass(frozen=True, slots=True)
class ExtraSave:
    """A save after the final one that may be abandoned (:meth:`TimeBudget.extra_save`).

    Train while a step still ends by ``train_until`` (epoch seconds), then save; a save not
    durable at ``abandon_at`` is abandoned (stop writing it, or exit the process: the final save
    stands) so the exit still ends before the deadline. ``chance``: that the save is durable in
    time; ``expected_gain``: the training seconds expected to be persisted by it.
    """

    train_until: float
    abandon_at: float
    chance: float
    expected_gain: float
    reason: str

    def step_fits(self, now: float, step: float) -> bool:
        """Does a step of ``step`` seconds started at ``now`` end by :attr:`train_until`?"""
        return now + step <= self.train_until


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to a yes/no question, with the numbers behind it.

    Truthy when the answer is *yes*: ``if budget.should_stop():`` stops, ``if budget.can_save():``
    saves. ``stop`` and ``ok`` are the same value under the names that read well for each
    question. ``seconds_left`` is None without a deadline; ``needed`` is what the answer compared
    it with; ``cause`` says why a stop is wanted: ``"time"`` or ``"signal"`` (None otherwise).
    """

    yes: bool
    reason: str
    seconds_left: float | None
    needed: float | None = None
    cause: str | None = None

    def __bool__(self) -> bool:
        return self.yes

    @property
    def stop(self) -> bool:
        return self.yes

    @property
    def ok(self) -> bool:
        return self.yes


def _check_samples(what: str, values: Iterable[Any]) -> list[float]:
    out = []
    for i, v in enumerate(values):
        out.append(check_seconds(f"time budget state: {what}[{i}]", v))
    return out


class _Estimate:
    """An estimate recomputed only after its samples changed (it is asked every step)."""

    _value: float | None = None
    _stale = False

    @property
    def value(self) -> float | None:
        if self._stale:
            self._stale, self._value = False, self._compute()
        return self._value

    def _compute(self) -> float | None:
        raise NotImplementedError


class RobustEstimate(_Estimate):
    """A high quantile of recent samples, ignoring the first ``skip`` (warm-up) samples.

    ``load()`` gives samples from an earlier run: they answer until this run has its own.
    """

    def __init__(self, *, skip: int = 0, window: int = 50, quantile: float = 0.9) -> None:
        self.skip, self.quantile = skip, quantile
        self.count = 0
        self._recent: deque[float] = deque(maxlen=window)
        self._loaded: deque[float] = deque(maxlen=window)
        self._last_warmup: float | None = None

    def add(self, seconds: float) -> None:
        self.count += 1
        if self.count <= self.skip:
            self._last_warmup = seconds
        else:
            self._recent.append(seconds)
        self._stale = True

    def load(self, samples: Iterable[float]) -> None:
        self._loaded.extend(samples)
        self._stale = True

    @property
    def samples(self) -> list[float]:
        """The samples the estimate uses now (this run's, else the loaded ones)."""
        return list(self._recent or self._loaded)

    def _compute(self) -> float | None:
        samples = self.samples
        if not samples:
            return self._last_warmup
        ordered = sorted(samples)
        # Nearest-rank quantile: with few samples this is the max, which is what we want.
        return ordered[max(0, math.ceil(self.quantile * len(ordered)) - 1)]

    def describe(self, what: str) -> str:
        q = "max" if self.quantile >= 1 else f"p{self.quantile * 100:g}"
        if self._recent:
            return f"{q} of last {len(self._recent)} {what}s"
        if self._loaded:
            return f"{q} of {len(self._loaded)} {what}s of earlier runs"
        if self.count:
            return f"warm-up {what} ({self.count} measured)"
        return f"no {what} measured yet"


def _tame(logs: list[float]) -> list[float]:
    """Log-seconds with each stall counted as :data:`STALL_FACTOR` times the median of the
    other samples: one save that hung for hours (a stalled store) must not widen every later
    bound by orders of magnitude -- it would be carried in the checkpoint to the next runs, and
    they would stop at their first step. A file system that became slower for good moves the
    median within half a window and is then followed."""
    if len(logs) < 2:
        return logs
    cap = math.log(STALL_FACTOR)
    return [min(x, statistics.median(logs[:i] + logs[i + 1 :]) + cap) for i, x in enumerate(logs)]


def t_quantile(q: float, df: float) -> float:
    """Student's t quantile (Cornish-Fisher, 3 terms: within 1.5 % for df >= 4 at q <= 0.995)."""
    z = statistics.NormalDist().inv_cdf(q)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


class SaveTail:
    """A tail bound of save times: the ``quantile`` prediction bound of a log-normal.

    Fitted to the last ``window`` samples of each kind: saves that had the machine to
    themselves (*blocking*, like the final save) and saves written while training went on
    (*background*: an async save, timed until durable, which shares the host with the
    training and takes longer). Each kind has its own median; the spread of log-seconds is
    pooled over both kinds (each around its own mean) and with ``prior_spread`` weighted as
    ``prior_weight`` samples, and the bound is Student's prediction interval (``t * spread *
    sqrt(1 + 1/n)``, n the samples of the kind asked about), so few samples give a wide bound
    and many steady ones a tight one. A kind with no sample yet borrows the other kind's
    median. Save times are right-skewed (a busy file system makes a save 3x slower, never 3x
    faster), which the log scale captures.
    """

    def __init__(
        self,
        *,
        window: int = 20,
        quantile: float = 0.995,
        prior_spread: float = SAVE_PRIOR_SPREAD,
        prior_weight: float = SAVE_PRIOR_WEIGHT,
    ) -> None:
        if not (_number(quantile) and 0.5 <= quantile < 1):
            raise ValueError(f"quantile must be in [0.5, 1), e.g. 0.995, got {quantile!r}")
        if not (_number(prior_spread) and prior_spread >= 0):
            raise ValueError(f"prior_spread must be a finite number >= 0, got {prior_spread!r}")
        if not (_number(prior_weight) and prior_weight > 0):
            raise ValueError(f"prior_weight must be a finite number > 0, got {prior_weight!r}")
        self.quantile, self.prior_spread, self.prior_weight = quantile, prior_spread, prior_weight
        # background? -> the last ``window`` samples of that kind
        self._recent: dict[bool, deque[float]] = {
            False: deque(maxlen=window),
            True: deque(maxlen=window),
        }
        self._bounds: dict[bool, float | None] = {}
        self.count = 0
        self._own = {False: 0, True: 0}  # this run's samples of each kind (add, not load)

    def add(self, seconds: float, *, background: bool = False) -> None:
        self.count += 1
        self._own[background] += 1
        self._recent[background].append(seconds)
        self._bounds.clear()

    def load(self, samples: Iterable[float], *, background: bool = False) -> None:
        """Older samples (earlier allocations): they come before this run's in the window and
        replace those loaded before (a checkpoint's record supersedes the timeline's)."""
        recent = self._recent[background]
        own = self._own[background]
        mine = list(recent)[-own:] if own else []
        recent.clear()
        recent.extend([*samples, *mine])
        self._bounds.clear()

    @property
    def samples(self) -> list[float]:
        """The blocking saves the bound uses (see :attr:`background_samples`)."""
        return list(self._recent[False])

    @property
    def background_samples(self) -> list[float]:
        return list(self._recent[True])

    def _logs(self) -> dict[bool, list[float]]:
        return {k: _tame([math.log(max(x, 1e-3)) for x in v]) for k, v in self._recent.items() if v}

    def fit(self, *, background: bool = False) -> tuple[float, float] | None:
        """(median seconds of the kind, pooled spread of log-seconds); None without samples."""
        got = self._fit(background)
        return None if got is None else got[:2]

    def _fit(self, background: bool) -> tuple[float, float, int, float] | None:
        """(median, pooled spread, samples behind the median, degrees of freedom)."""
        logs = self._logs()
        if not logs:
            return None
        ss = sum(statistics.variance(v) * (len(v) - 1) for v in logs.values() if len(v) > 1)
        df = sum(len(v) - 1 for v in logs.values()) + self.prior_weight
        spread = math.sqrt((ss + self.prior_weight * self.prior_spread**2) / df)
        mine = logs.get(background) or logs[not background]  # none of this kind: the other's
        return math.exp(statistics.fmean(mine)), spread, len(mine), df

    def _predictive(self, background: bool) -> tuple[float, float, float] | None:
        """(median, spread of the next save's log-seconds, degrees of freedom): the fit's spread
        widened by the uncertainty of its median (``sqrt(1 + 1/n)``)."""
        got = self._fit(background)
        if got is None:
            return None
        median, spread, n, df = got
        return median, spread * math.sqrt(1 + 1 / n), df

    def bound(self, *, background: bool = False) -> float | None:
        """The tail bound of the next save of the kind; None before any save was measured."""
        if background not in self._bounds:
            got = self._predictive(background)
            if got is None:
                self._bounds[background] = None
            else:
                median, sigma, df = got
                self._bounds[background] = median * math.exp(t_quantile(self.quantile, df) * sigma)
        return self._bounds[background]

    def chance_within(self, seconds: float, *, background: bool = False) -> float | None:
        """The chance that the next save of the kind is durable within ``seconds`` (the
        log-normal prediction distribution); None before any save was measured."""
        got = self._predictive(background)
        if got is None:
            return None
        median, sigma, _ = got
        if seconds <= 0:
            return 0.0
        z = (math.log(seconds) - math.log(median)) / max(sigma, 1e-6)
        return statistics.NormalDist().cdf(z)

    @property
    def value(self) -> float | None:
        """The bound of a blocking save (the final one)."""
        return self.bound()

    def describe(self, *, background: bool = False) -> str:
        got = self._fit(background)
        if got is None:
            return "no save measured yet"
        median, spread, _, _ = got
        kind, other_kind = ("background", "blocking") if background else ("blocking", "background")
        own, other = len(self._recent[background]), len(self._recent[not background])
        if not own:
            what = f"{other} {other_kind} saves (no {kind} one yet)"
        elif other:
            what = f"{own} {kind} saves (spread pooled with {other} {other_kind})"
        else:
            what = f"{own} saves"
        return (
            f"p{self.quantile * 100:g} bound of {what}, median {_fmt(median)} s, "
            f"spread x{math.exp(spread):.2f}"
        )


# Only what nothing else measures: squeue's whole-second end time and clock skew. Step jitter is
# in the step's p90, the save's in its tail bound, and an exit that overruns anyway is requeued on
# SLURM's TERM (0-30 s after the end time). 5 s, before, cost ~3% of every 3-minute allocation.
SLACK = 2.0


@dataclass(kw_only=True, slots=True)
class BudgetConfig:
    """Knobs of :class:`TimeBudget` (see the module docstring for what each one does)."""

    margin: float | None = None
    initial_step_estimate: float = 0.0
    initial_save_estimate: float | None = None
    initial_exit_estimate: float | None = None
    slack: float = SLACK
    warmup_steps: int = 2
    step_window: int = 50
    step_quantile: float = 0.9
    save_window: int = 20
    save_quantile: float = 0.995
    exit_window: int = 5
    signal_lead: float | None = None
    signal_jitter: float = 35.0
    warning_signals: tuple[str, ...] = ("SIGUSR2",)

    def __post_init__(self) -> None:
        for name in (
            "initial_step_estimate",
            "slack",
            "signal_jitter",
        ):
            check_seconds(name, getattr(self, name))
        for name in ("margin", "signal_lead", "initial_exit_estimate", "initial_save_estimate"):
            if getattr(self, name) is not None:
                check_seconds(name, getattr(self, name))
        for name in ("warmup_steps", "step_window", "save_window", "exit_window"):
            value, low = getattr(self, name), 0 if name == "warmup_steps" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not _number(self.step_quantile) or not 0 < self.step_quantile <= 1:
            raise ValueError(
                f"step_quantile must be in (0, 1], e.g. 0.9 for p90, got {self.step_quantile!r}"
            )
        if not _number(self.save_quantile) or not 0.5 <= self.save_quantile < 1:
            raise ValueError(
                f"save_quantile must be in [0.5, 1), e.g. 0.995 (a save overruns its bound once "
                f"in 200), got {self.save_quantile!r}"
            )
        if isinstance(self.warning_signals, str):
            raise ValueError("warning_signals is a tuple of names, e.g. ('SIGUSR2',)")
        self.warning_signals = tuple(signal_name(s) for s in self.warning_signals)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class _Part:
    name: str
    seconds: float
    how: str

    def __str__(self) -> str:
        return f"{self.name} {_fmt(self.seconds)} s" + (f" ({self.how})" if self.how else "")


def _clocks(
    deadline: DeadlineWatcher | Deadline | None,
    clock: Callable[[], float] | None,
    timer: Callable[[], float] | None,
) -> tuple[Callable[[], float], Callable[[], float]]:
    """The clock of "now" (the watcher's by default) and the timer of durations (the clock when one
    was given, else a monotonic one)."""
    if clock is None:
        clock = deadline.clock if isinstance(deadline, DeadlineWatcher) else time.time
    return clock, timer or (clock if clock is not time.time else time.monotonic)


def _check_deadline(deadline: object) -> None:
    if deadline is not None and not isinstance(deadline, (Deadline, DeadlineWatcher)):
        raise TypeError(
            f"deadline must be a DeadlineWatcher, a Deadline or None, got {type(deadline)!r}"
        )


class TimeBudget:
    """Decides when to stop so that the final checkpoint is durable and the job requeued in time.

    ``deadline``: a :class:`DeadlineWatcher` (re-polled at its own bounded rate), a fixed
    :class:`Deadline`, or None (no deadline: never stops for time, unless a warning signal with
    a known lead sets one). ``signals``: an optional stop flag (:class:`slurmclock.StopSignals`,
    :class:`slurmclock.AnyFlag`). ``timeline``: the job's :class:`slurmclock.JobTimeline`; its
    measured exit times are read at once, and a final save marks it (``save(final=True)``).
    ``signal_lead``: seconds between SLURM's warning signal and the end; None reads
    ``PYRECOVER_SIGNAL_LEAD`` from ``env`` (default ``os.environ``). ``clock`` gives epoch seconds
    for "now" (default: the watcher's clock, else ``time.time``); ``timer`` measures durations
    (default: ``clock`` when given, else ``time.monotonic``). The other keywords are
    :class:`BudgetConfig` fields; every number is checked (finite, >= 0) with a one-line
    ValueError.
    """

    def __init__(
        self,
        deadline: DeadlineWatcher | Deadline | None = None,
        *,
        margin: float | None = None,
        initial_step_estimate: float = 0.0,
        initial_save_estimate: float | None = None,
        initial_exit_estimate: float | None = None,
        slack: float = SLACK,
        warmup_steps: int = 2,
        step_window: int = 50,
        step_quantile: float = 0.9,
        save_window: int = 20,
        save_quantile: float = 0.995,
        exit_window: int = 5,
        signal_lead: float | None = None,
        signal_jitter: float = 35.0,
        warning_signals: tuple[str, ...] = ("SIGUSR2",),
        signals: StopFlag | None = None,
        timeline: JobTimeline | None = None,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] | None = None,
        timer: Callable[[], float] | None = None,
    ) -> None:
        _check_deadline(deadline)
        self.config = BudgetConfig(
            margin=margin,
            initial_step_estimate=initial_step_estimate,
            initial_save_estimate=initial_save_estimate,
            initial_exit_estimate=initial_exit_estimate,
            slack=slack,
            warmup_steps=warmup_steps,
            step_window=step_window,
            step_quantile=step_quantile,
            save_window=save_window,
            save_quantile=save_quantile,
            exit_window=exit_window,
            signal_lead=signal_lead_from_env(env) if signal_lead is None else signal_lead,
            signal_jitter=signal_jitter,
            warning_signals=warning_signals,
        )
        self._deadline = deadline
        self.signals = signals
        self._meaning = self.meaning  # fixed with the config: read at every step
        self.timeline = timeline
        self._clock, self._timer = _clocks(deadline, clock, timer)
        self._start_measuring()
        if timeline is not None:
            self.load_timeline(timeline)

    def _start_measuring(self) -> None:
        """Empty estimates, shaped by the config (load_state_dict and the timeline fill them)."""
        cfg = self.config
        self._steps = RobustEstimate(
            skip=cfg.warmup_steps, window=cfg.step_window, quantile=cfg.step_quantile
        )
        self._saves = SaveTail(window=cfg.save_window, quantile=cfg.save_quantile)
        self._exits: dict[tuple[str, int], float] = {}
        self.launch_s: float | None = None  # record_launch()
        self._first_left: float | None = None  # seconds left when the budget first looked
        self._warnings_seen = 0
        self._said: set[str] = set()
        self._parts_cache: dict[bool, tuple[float, str]] = {}  # with_step -> (needed, said)

    # -- measuring --------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time the body as one training step (not recorded if it raises)."""
        start = self._timer()
        yield
        self.record_step(self._timer() - start)

    @contextlib.contextmanager
    def save(self, *, final: bool = False, background: bool = False) -> Iterator[None]:
        """Time the body as one checkpoint save, until durable (not recorded if it raises).

        ``final=True``: the last save of this run; the timeline is marked ``saved`` at its end,
        so the exit that follows is measured (by ``slurmclock mark``/``requeue`` in the script).
        ``background``: see :meth:`record_save`.
        """
        start = self._timer()
        yield
        self.record_save(self._timer() - start, final=final, background=background)

    def record_step(self, seconds: float) -> None:
        """Add a measured step duration."""
        if self._valid("step", seconds):
            self._steps.add(float(seconds))

    def record_save(
        self,
        seconds: float,
        *,
        final: bool = False,
        background: bool = False,
        step: int | None = None,
    ) -> None:
        """Add a measured save duration (until the checkpoint is durable); see :meth:`save`.

        ``step``: the checkpoint's step, marked ``checkpoint`` in the job's timeline (how
        ``slurmclock supervise`` tells a failure at the same step from one after progress).

        ``background=True``: training went on while it was written (an async save, timed until
        durable). Such saves take longer than one with the machine to itself, so they get their
        own median: the final save's bound comes from blocking saves (from background ones only
        until a blocking save was measured), the bound of a background save from background ones.
        """
        valid = self._valid("save", seconds)
        if valid:
            self._saves.add(float(seconds), background=background)
            self._parts_cache.clear()
        self._mark_checkpoint(step, float(seconds) if valid else None, background)
        if final and self.timeline is not None:
            self.timeline.mark("saved", seconds=round(float(seconds), 3))

    def _mark_checkpoint(
        self, step: int | None, seconds: float | None = None, background: bool = False
    ) -> None:
        """``checkpoint step=N``, with the save's ``seconds`` (and ``background``) when it is a
        save-time sample: the job's next runs read them (:meth:`load_timeline`)."""
        if step is None or self.timeline is None:
            return
        info: dict[str, Any] = {"step": int(step)}
        if seconds is not None:
            info["seconds"] = round(seconds, 3)
            if background:
                info["background"] = True
        self.timeline.mark("checkpoint", **info)

    def record_exit(self, seconds: float, *, job: str = "?", restart: int = -1) -> None:
        """Add what one earlier run needed after its final save (exit, teardown, requeue).

        :meth:`load_timeline` does this from the job's timeline; call it yourself when you
        measure the exit some other way. ``(job, restart)`` identifies the run: once is enough.
        """
        if self._valid("exit", seconds):
            self._exits.pop((job, restart), None)
            self._exits[(job, restart)] = float(seconds)
            while len(self._exits) > self.config.exit_window:
                del self._exits[next(iter(self._exits))]
            self._parts_cache.clear()

    def record_launch(self, seconds: float) -> None:
        """This allocation's launch: its start (SLURM) -> this process's start. Until an exit is
        measured, the exit is guessed from it (the way out retraces the way in)."""
        if self._valid("launch", seconds):
            self.launch_s = float(seconds)
            self._parts_cache.clear()

    def load_timeline(self, timeline: JobTimeline) -> int:
        """Read the exit times of this job's earlier allocations; returns how many it found.

        Also the save times its earlier runs and launches marked (``checkpoint`` with
        ``seconds``): a loop that keeps no budget state of its own (:meth:`state_dict`) still
        starts its next run from measured saves. A state loaded later from a checkpoint
        (:meth:`load_state_dict`) replaces them."""
        events = timeline.events()
        samples: list[ExitSample] = timeline.exit_samples(events)
        for s in samples:
            self.record_exit(s.seconds, job=s.job, restart=s.restart)
        for background in (False, True):
            saves = save_samples(events, background=background)
            if saves:
                self._saves.load(saves, background=background)
                self._parts_cache.clear()
        return len(samples)

    def _valid(self, what: str, seconds: float) -> bool:
        # A bad measurement (clock jumped back) is dropped, not raised: training goes on.
        if _number(seconds) and seconds >= 0:
            return True
        log.warning("ignoring %s duration %r: not a finite number of seconds >= 0", what, seconds)
        return False

    def now(self) -> float:
        """Epoch seconds by the budget's clock (the deadline's)."""
        return self._clock()

    @property
    def timer(self) -> Callable[[], float]:
        """What measures durations (monotonic seconds; the clock when one was given)."""
        return self._timer

    @property
    def has_save_estimate(self) -> bool:
        """A save time is known (measured here, or loaded from an earlier allocation)."""
        return self._saves.bound() is not None

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
        """Tail bound of a blocking save (the final one) from measured saves; None before the
        first one."""
        return self._saves.bound()

    @property
    def background_save_estimate(self) -> float | None:
        """Tail bound of a background save, until durable; None before the first save."""
        return self._saves.bound(background=True)

    @property
    def exit_estimate(self) -> float | None:
        """Bound of what the job needs after its final save; None before one was measured."""
        if not self._exits:
            return None
        return EXIT_FACTOR * max(self._exits.values())

    # -- the deadline and signals -----------------------------------------------------------

    def _source_deadline(self) -> Deadline | None:
        if isinstance(self._deadline, DeadlineWatcher):
            return self._deadline.get()
        return self._deadline

    @property
    def signals(self) -> StopFlag | None:
        """The stop flag whose arrivals the budget reads (None: no signals)."""
        return self._signals

    @signals.setter
    def signals(self, flag: StopFlag | None) -> None:
        if flag is not None and not isinstance(flag, StopFlag):
            raise TypeError(
                f"signals must be a stop flag with requested, received and arrivals (e.g. "
                f"slurmclock.StopSignals or AnyFlag), got {type(flag).__name__}"
            )
        self._signals = flag

    @property
    def meaning(self) -> SignalMeaning:
        """What each arrival means to this budget (a warning with a known lead, or stop now)."""
        return SignalMeaning(self.config.signal_lead, self.config.warning_signals)

    def _warning(self) -> tuple[str, float] | None:
        """The earliest warning signal (name, epoch time) among the arrivals, if any."""
        warnings = self._meaning.warnings_in(self._signals)
        if len(warnings) > self._warnings_seen:
            # News from SLURM: the time limit may have changed since the last poll.
            self._warnings_seen = len(warnings)
            if isinstance(self._deadline, DeadlineWatcher):
                self._deadline.refresh()
        return min(warnings, key=lambda a: a[1]) if warnings else None

    def deadline(self) -> Deadline | None:
        """The deadline the budget works with: SLURM's (or the override), bounded by a warning.

        A warning signal with a known lead says the end is at ``receipt + lead`` (SLURM sends
        it up to 30 s early, so a known deadline up to ``signal_jitter`` later still agrees).
        """
        known = self._source_deadline()
        warning = self._warning()
        if warning is None:
            return known
        name, at = warning
        lead = self.config.signal_lead or 0.0
        bound = at + lead
        job = None if known is None else known.job_id
        if known is not None and known.end is not None:
            if known.end <= bound + self.config.signal_jitter:
                return known
            self._say(
                "disagree",
                f"{name} came {known.end - at:.0f} s before the deadline {known}, but the signal "
                f"lead is {lead:g} s: using the earlier end; if you submitted with another "
                f"--signal=...@LEAD, export {LEAD_ENV}=LEAD",
            )
        return Deadline(bound, "signal", job)

    def seconds_left(self) -> float | None:
        """Seconds until the deadline; None without one."""
        d = self.deadline()
        return None if d is None else d.seconds_left(self._clock())

    def _say(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning("%s", message)

    # -- deciding ---------------------------------------------------------------------------

    def _save_part(self, name: str, *, background: bool = False) -> _Part:
        value = self._saves.bound(background=background)
        if value is None:
            return _Part(name, *self._save_guess())
        return _Part(name, value, self._saves.describe(background=background))

    def _save_guess(self) -> tuple[float, str]:
        """(seconds, how) of a save before one is measured: see the module docstring."""
        given = self.config.initial_save_estimate
        if given is not None:
            return given, "initial guess, no save measured yet"
        if self._first_left is None:
            self._first_left = self.seconds_left()
        if self._first_left is None or self._first_left * SAVE_GUESS_SHARE >= SAVE_GUESS:
            return SAVE_GUESS, "initial guess, no save measured yet"
        guess = max(0.0, self._first_left * SAVE_GUESS_SHARE)
        return guess, f"initial guess: {SAVE_GUESS_SHARE:g} of the {_fmt(self._first_left)} s left"

    def _step_part(self) -> _Part:
        step = self._steps.value
        if step is None:
            how = "initial guess" if self.config.initial_step_estimate else "no step measured yet"
            return _Part("next step", self.config.initial_step_estimate, how)
        return _Part("next step", step, self._steps.describe("step"))

    def _exit_guess(self) -> tuple[float, str]:
        """(seconds, how) of the exit before one is measured."""
        if self.config.initial_exit_estimate is not None:
            return self.config.initial_exit_estimate, "initial guess, none measured"
        if self.launch_s is not None:
            guess = EXIT_GUESS_BASE + EXIT_PER_LAUNCH * self.launch_s
            return (
                guess,
                f"{EXIT_GUESS_BASE:g} + {EXIT_PER_LAUNCH:g} x launch {_fmt(self.launch_s)} s",
            )
        return EXIT_GUESS, "initial guess, none measured"

    def _end_parts(self, save_name: str) -> list[_Part]:
        cfg = self.config
        parts = [self._save_part(save_name)]
        if cfg.margin is not None:
            parts.append(_Part("margin", cfg.margin, ""))
            return parts
        exit_bound = self.exit_estimate
        if exit_bound is None:
            parts.append(_Part("exit", *self._exit_guess()))
        else:
            n = len(self._exits)
            parts.append(_Part("exit", exit_bound, f"{EXIT_FACTOR:g} x max of {n} measured"))
        parts.append(_Part("slack", cfg.slack, ""))
        return parts

    def _needed(self, *, with_step: bool) -> tuple[float, str]:
        """(seconds needed, the parts said). The save/exit part is cached until a save or exit
        is measured: should_stop() runs every step and must cost microseconds."""
        cached = self._parts_cache.get(with_step)
        if cached is None:
            parts = self._end_parts("final save" if with_step else "save")
            cached = (sum(p.seconds for p in parts), " + ".join(map(str, parts)))
            self._parts_cache[with_step] = cached
        if not with_step:
            return cached
        step = self._step_part()
        return step.seconds + cached[0], f"{step} + {cached[1]}"

    def needed_after_save(self) -> float:
        """Seconds kept free after the final save: the exit and the slack (or the margin)."""
        return sum(p.seconds for p in self._end_parts("save")[1:])

    def needed_to_stop(self) -> float:
        """Seconds the next step, a final save, the exit and the slack need together."""
        return self._needed(with_step=True)[0]

    def should_stop(self) -> Decision:
        """Stop now? Yes on a stop signal, or when time left < step + save + exit + slack."""
        needed, said = self._needed(with_step=True)
        d = self.deadline()
        left = None if d is None else d.seconds_left(self._clock())
        stop_signal = self.stop_signal()
        if stop_signal is not None:
            when = "" if left is None else f"; {_fmt(left, down=True)} s left"
            return Decision(True, f"stop: received {stop_signal}{when}", left, needed, "signal")
        if d is None or left is None:
            return Decision(False, f"continue: {self._no_deadline(d)}", None, needed)
        src = self._signal_source(d)
        if left < needed:
            reason = f"stop: {_fmt(left, down=True)} s left{src} < {_fmt(needed)} s needed = {said}"
            return Decision(True, reason, left, needed, "time")
        reason = (
            f"continue: {_fmt(left, down=True)} s left{src} >= {_fmt(needed)} s needed = {said}"
        )
        return Decision(False, reason, left, needed)

    def can_save(self, *, background: bool = False) -> Decision:
        """Can a save started now finish, with the exit after it, before the deadline?

        ``background=True`` asks about a save written while training goes on (async): it must
        be durable before the stop comes due, so that the final save does not wait for it --
        it needs its own bound plus all that :meth:`should_stop` keeps free. When it does not
        fit, skipping it loses nothing: the final save comes first.
        """
        if background:
            part = self._save_part("background save", background=True)
            stop, stop_said = self._needed(with_step=True)
            needed, said = part.seconds + stop, f"{part} + then the stop: {stop_said}"
        else:
            needed, said = self._needed(with_step=False)
        d = self.deadline()
        left = None if d is None else d.seconds_left(self._clock())
        if left is None:
            return Decision(True, f"save fits: {self._no_deadline(d)}", None, needed)
        if left < needed:
            reason = f"no time to save: {_fmt(left, down=True)} s left < {_fmt(needed)} s = {said}"
            return Decision(False, reason, left, needed)
        reason = f"save fits: {_fmt(left, down=True)} s left >= {_fmt(needed)} s = {said}"
        return Decision(True, reason, left, needed)

    def extra_save(self, *, min_gain: float = 1.0) -> ExtraSave | None:
        """After the final save is durable: train on and save once more? None when not worth it.

        The time the final save's tail bound kept free and the save did not use would otherwise
        be idle. Training ``x`` more seconds and then saving persists ``x`` if the save is
        durable by ``abandon_at`` (deadline - exit - slack, or - margin), which happens with
        probability F(room - x), F the fitted log-normal of blocking saves (its prediction
        spread). The plan maximizes x * F(room - x) over whole steps; None when that is under
        ``min_gain`` seconds or one step, on a stop signal, without a deadline, or before a
        blocking save was measured. Call it again after an extra save is durable: the plan for
        the time then left.
        """
        if self.stop_signal() is not None:
            return None
        d, fit, step = self.deadline(), self._saves.fit(), self._steps.value
        step = step if step is not None else self.config.initial_step_estimate
        if d is None or d.end is None or fit is None or not step > 0:
            return None
        # Nothing is left over for the exit once an extra save has used the time, as the final
        # save's unused bound is for the stop: the exit part counts EXTRA_EXIT_FACTOR times.
        end = sum(
            p.seconds * (EXTRA_EXIT_FACTOR if p.name == "exit" else 1.0)
            for p in self._end_parts("save")[1:]
        )
        now = self._clock()
        abandon_at = d.end - end
        room = abandon_at - now
        whole = int(room // step)
        if whole < 1:
            return None
        best = (0.0, 0.0, 0.0)  # (expected gain, train seconds, chance)
        for k in sorted({max(1, round(whole * i / 256)) for i in range(1, 257)}):
            x = k * step
            if x >= room:
                break
            chance = self._saves.chance_within(room - x) or 0.0
            if x * chance > best[0]:
                best = (x * chance, x, chance)
        gain, x, chance = best
        if gain < max(min_gain, step):
            return None
        reason = (
            f"extra save: train {_fmt(x)} s more, then save (median {_fmt(fit[0])} s); durable "
            f"by the exit in {_fmt(room, down=True)} s with chance {chance:.0%}, else abandoned "
            f"(the final save stands): {_fmt(gain)} s of training expected to be kept"
        )
        return ExtraSave(now + x, abandon_at, chance, gain, reason)

    def extra_saved(self, seconds: float, *, step: int | None = None) -> None:
        """An extra save (of ``step``) is durable: the exit begins now (the timeline is marked
        ``checkpoint`` and ``saved``). Its time is not a sample of the save tail: the abandoned
        ones would be missing from it, the slow ones, which would make the final save's bound
        too tight."""
        self._mark_checkpoint(step)
        if self.timeline is not None:
            self.timeline.mark("saved", seconds=round(float(seconds), 3), extra=True)

    def extra_abandoned(self, step: int) -> None:
        """An extra save (of ``step``) is abandoned: the exit begins now (timeline ``saved``)."""
        if self.timeline is not None:
            self.timeline.mark("saved", abandoned=int(step))

    def stop_signal(self) -> str | None:
        """The first stop signal received (a warning signal with a known lead is not one)."""
        return self._meaning.stop_now(self._signals)

    def _signal_source(self, d: Deadline) -> str:
        if d.source != "signal":
            return ""
        warning = self._warning()
        name = warning[0] if warning else "warning"
        return f" (deadline: {name} + lead {_fmt(self.config.signal_lead or 0.0)} s)"

    def describe_rule(self) -> str:
        """The stop rule in one line, for a start banner: what is kept free, what signals mean."""
        cfg = self.config
        if cfg.margin is not None:
            end = f"a fixed margin of {cfg.margin:g} s"
        else:
            how = "measured" if self._exits else "not measured yet"
            end = f"exit ({how}) + {cfg.slack:g} s slack"
        return f"stop when left < next step + final save + {end}; {self._meaning.describe()}"

    @staticmethod
    def _no_deadline(d: Deadline | None) -> str:
        return f"no deadline ({'not given' if d is None else d}), never stops for time"

    # -- reporting and remembering ----------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything the budget knows, JSON-ready, for logs."""
        d = self.deadline()
        return {
            "deadline": None if d is None else d.iso(),
            "deadline_source": None if d is None else d.source,
            "seconds_left": None if d is None else d.seconds_left(self._clock()),
            "step_estimate": self.step_estimate,
            "save_estimate": self.save_estimate,
            "background_save_estimate": self.background_save_estimate,
            "exit_estimate": self.exit_estimate,
            "steps_measured": self.steps_measured,
            "saves_measured": self.saves_measured,
            "exits_measured": len(self._exits),
            "launch_s": self.launch_s,
            "margin": self.config.margin,
            "slack": self.config.slack,
            "signal_lead": self.config.signal_lead,
            "needed_to_stop": self.needed_to_stop(),
            "stop_signal": None if self.signals is None else self.signals.received,
        }

    def state_dict(self) -> dict[str, Any]:
        """The measured figures, JSON-ready: store it in the checkpoint's metadata and give it to
        :meth:`load_state_dict` in the next allocation, which then starts from measured numbers.
        ``saves`` are blocking saves, ``background_saves`` async ones (a state written before
        the two were told apart has ``saves`` only, read as blocking: a wider bound, never a
        tighter one)."""
        return {
            "version": STATE_VERSION,
            "steps": self._steps.samples,
            "saves": self._saves.samples,
            "background_saves": self._saves.background_samples,
            "exits": [
                {"job": job, "restart": restart, "seconds": seconds}
                for (job, restart), seconds in self._exits.items()
            ],
        }

    def save_state_file(self, path: str | os.PathLike[str]) -> str | None:
        """Write :meth:`state_dict` to ``path`` (one JSON line, atomically: a temporary file
        renamed); None when written, else the one line why not (an estimate is not worth a
        failure). :meth:`load_state_file` reads it in the next run -- of this job or of the
        next job of a chain -- for a loop that keeps no state of its own in its checkpoint."""
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            tmp.write_text(json.dumps(self.state_dict()) + "\n", encoding="utf-8")
            os.replace(tmp, target)
        except OSError as e:
            return f"could not write the time budget state {target}: {e.strerror or e}"
        return None

    def load_state_file(self, path: str | os.PathLike[str]) -> str | None:
        """Start from the state :meth:`save_state_file` wrote to ``path``. The file is read as
        untrusted input (:mod:`slurmclock.untrusted`: a regular file, bounded, never blocking);
        None when loaded or missing, else the one line (its values quoted) saying why it was
        ignored: the run then starts from the first-run guesses."""
        try:
            data, _, cut = read_bytes(path, limit=MAX_LINE + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"ignoring the time budget state {path}: {e.strerror or e}"
        state = None if cut else parse_record(data.strip())
        if state is None:
            return f"ignoring the time budget state {path}: not one bounded JSON object"
        try:
            self.load_state_dict(state)
        except ValueError as e:
            return f"ignoring the time budget state {path}: {quote(str(e))}"
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Start from the figures of :meth:`state_dict` (an empty mapping changes nothing).

        Loaded steps stand in until this run measured its own; loaded saves and exits join this
        run's. A malformed state raises one ValueError naming the entry (nothing is loaded).
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"time budget state must be a mapping (state_dict()), got {state!r}")
        if not state:
            return
        version = state.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version > STATE_VERSION:
            raise ValueError(
                f"time budget state version {version!r} is not one this slurmclock reads "
                f"(<= {STATE_VERSION}): upgrade slurmclock, or drop the state to start afresh"
            )
        steps = _check_samples("steps", _list(state, "steps"))
        saves = _check_samples("saves", _list(state, "saves"))
        background = _check_samples("background_saves", _list(state, "background_saves"))
        exits = [_exit_entry(i, e) for i, e in enumerate(_list(state, "exits"))]
        self._steps.load(steps)
        if saves or background:  # replace the timeline's: the checkpoint holds the same saves
            self._saves.load(saves)
            self._saves.load(background, background=True)
        self._parts_cache.clear()
        mine = dict(self._exits)
        self._exits.clear()
        for job, restart, seconds in exits:
            self.record_exit(seconds, job=job, restart=restart)
        for (job, restart), seconds in mine.items():
            self.record_exit(seconds, job=job, restart=restart)


def save_samples(events: Iterable[Event], *, background: bool = False) -> list[float]:
    """The save times (seconds until durable) of the timeline's ``checkpoint`` marks of one
    kind, oldest first; marks without ``seconds`` (an extra save, an older slurmclock) and
    values that are not seconds are left out."""
    out = []
    for ev in events:
        seconds = ev.info.get("seconds")
        if ev.name != "checkpoint" or not isinstance(seconds, (int, float)):
            continue
        if _number(seconds) and seconds >= 0 and (ev.info.get("background") is True) == background:
            out.append(float(seconds))
    return out


def _list(state: Mapping[str, Any], key: str) -> list[Any]:
    value = state.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"time budget state: {key} must be a list, got {type(value).__name__}")
    return value


def _exit_entry(i: int, entry: Any) -> tuple[str, int, float]:
    where = f"time budget state: exits[{i}]"
    if not isinstance(entry, Mapping) or not {"job", "restart", "seconds"} <= set(entry):
        raise ValueError(f"{where} must be {{'job': ..., 'restart': ..., 'seconds': ...}}")
    restart = entry["restart"]
    if isinstance(restart, bool) or not isinstance(restart, int) or not 0 <= restart < 2**31:
        shown = restart if isinstance(restart, int) and abs(restart) < 10**30 else "out of range"
        raise ValueError(f"{where}.restart must be a whole number >= 0, got {shown!r}")
    return str(entry["job"]), restart, check_seconds(f"{where}.seconds", entry["seconds"])
