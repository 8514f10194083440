"""What the job's timeline says about its past, for the supervisor's decisions.

* the crash-loop guard: :func:`failure_streak` -- failures in a row at one checkpoint step,
  over in-allocation restarts and requeues alike (each is a ``failed`` event), and over the
  links of a chain of successor jobs (the supervisor puts the events of the links before this
  job first: :func:`slurmclock.chain.earlier`, walked back until :func:`settled`);
* where training stands: :func:`newest_checkpoint`;
* a run that ended without a word (its node gone): :func:`vanished_run`;
* what a restart costs: :func:`restart_cost` -- the measured start-up (from a launch, ``start``
  or ``relaunched``, to the trainer's ``first_step``), that first step's time and the newest
  final save's, so that a restart in the allocation happens only when the time left is worth it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from slurmclock.job import SLURM_ENDS
from slurmclock.timeline import Event

__all__ = [
    "RestartCost",
    "Streak",
    "failure_streak",
    "newest_checkpoint",
    "restart_cost",
    "settled",
    "vanished_run",
]


@dataclass(frozen=True, slots=True)
class Streak:
    """Failures in a row at the same newest checkpoint step (``step`` None: before any)."""

    count: int = 0
    step: int | None = None
    last: Event | None = None


def failure_streak(events: Sequence[Event]) -> Streak:
    """The trailing run of ``failed`` events at one checkpoint step. A failure at another step
    starts a new run; a clean end (``exited`` 0 or 75) or ``gave_up`` (someone resumed the job
    after the chain stopped) ends it; time limits, preemptions and store outages (exit 74)
    neither count nor end it."""
    streak = Streak()
    for ev in events:
        if ev.name == "failed":
            step = as_int(ev.info.get("step"))
            count = streak.count + 1 if streak.count and step == streak.step else 1
            streak = Streak(count, step, ev)
        elif _ends_streak(ev):
            streak = Streak()
    return streak


def _ends_streak(ev: Event) -> bool:
    return ev.name == "gave_up" or (ev.name == "exited" and ev.info.get("rc") in (0, 75))


def settled(events: Sequence[Event]) -> bool:
    """Whether nothing before ``events`` can change what this module derives from them: a
    streak boundary (a clean end, ``gave_up``) ends :func:`failure_streak` there, a
    ``checkpoint`` answers :func:`newest_checkpoint` and a ``first_step`` a start-up
    (:func:`restart_cost`). How far back the chain's earlier links are read."""
    names = {ev.name for ev in events}
    return any(map(_ends_streak, events)) and {"checkpoint", "first_step"} <= names


def newest_checkpoint(events: Sequence[Event]) -> int | None:
    """The step of the last ``checkpoint`` event (the newest durable checkpoint), or None."""
    for ev in reversed(events):
        if ev.name == "checkpoint" and (step := as_int(ev.info.get("step"))) is not None:
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
        if ev.name == "signal" and ev.info.get("kind") in SLURM_ENDS:
            return None
    return events[start]


@dataclass(frozen=True, slots=True)
class RestartCost:
    """What starting the step again takes, measured in the timeline: ``startup`` seconds from
    a launch to the end of the first step (None: never measured), ``step`` that first step's
    seconds (an upper bound of a step: it includes warm-up), ``save`` the newest final save's."""

    startup: float | None = None
    step: float | None = None
    save: float | None = None

    def seconds(self, *, guess: float, steps: int) -> float:
        """Start-up (``guess`` when not measured), ``steps`` steps and a final save."""
        startup = guess if self.startup is None else self.startup
        return startup + steps * (self.step or 0.0) + (self.save or 0.0)


def restart_cost(events: Sequence[Event]) -> RestartCost:
    """The newest start-up measured (a ``first_step`` after the ``start`` or ``relaunched`` of
    the same run), with its first step's time, and the newest final save's time."""
    launched: float | None = None
    run: int | None = None
    startup = step = save = None
    for ev in events:
        if ev.name in ("start", "relaunched"):
            launched, run = ev.time, ev.restart
        elif ev.name == "first_step" and launched is not None and ev.restart == run:
            startup, step = max(0.0, ev.time - launched), as_float(ev.info.get("seconds"))
            launched = None  # one sample per launch
        elif ev.name == "saved" and (seconds := as_float(ev.info.get("seconds"))) is not None:
            save = seconds
    return RestartCost(startup, step, save)


def as_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def as_float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
