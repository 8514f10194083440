"""Saving through a store outage, for a training loop: while the store does not answer
(:class:`~ckptstore.StoreUnreachableError`: refused, reset, timed out, HTTP 5xx, throttled),
training goes on and a save is tried again after a pause that doubles each time (plus jitter,
and at least what the store asked for in Retry-After); one line says when the outage began, one
when a save got through. A save that must be durable (the final one before a stop) is retried
while the time left holds another try; then the loop gives up with one line saying what stands.

Pure logic with injectable clocks: the loop decides when to call, this says what to do::

    outage = Outage()
    ...
    due = schedule.due(step) or outage.due()          # a retry as soon as the pause is over
    try:
        store.save(step, state)
    except StoreUnreachableError as e:
        line = outage.failed(step, e, seconds)        # the first failure: said once
    else:
        line = outage.saved(step)                     # "store back: saved step N" after one
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

FIRST_PAUSE_S = 5.0  # the first retry; each failure doubles it
MAX_PAUSE_S = 300.0
FINAL_LIMIT_S = 300.0  # without a deadline: how long a final save is retried
JITTER = 0.2  # each pause is lengthened by up to this share, at random: ranks and runs that met
# one outage do not all come back in the same second


class Outage:
    """A store that stopped answering, as a training loop meets it."""

    def __init__(
        self,
        *,
        first_pause_s: float = FIRST_PAUSE_S,
        max_pause_s: float = MAX_PAUSE_S,
        final_limit_s: float = FINAL_LIMIT_S,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        jitter: float = JITTER,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 <= jitter <= 1:
            raise ValueError(f"jitter must be in 0..1 (a share of the pause), got {jitter}")
        if not 0 < first_pause_s <= max_pause_s:
            raise ValueError(
                f"pauses must be 0 < first_pause_s <= max_pause_s, got {first_pause_s} and "
                f"{max_pause_s}"
            )
        self.first_pause_s, self.max_pause_s = first_pause_s, max_pause_s
        self.final_limit_s = final_limit_s
        self._clock, self._wall = clock, wall
        # Its own generator: the training's random stream (which a checkpoint holds) must not
        # move because the store was down.
        self.jitter, self._rng = jitter, rng or random.Random()
        self._reset()

    def _reset(self) -> None:
        self.since: float | None = None  # wall time of the first failed save
        self.failures = 0
        self._started = 0.0  # clock time of the first failure
        self._next = 0.0  # clock time of the next try
        self._last_try_s = 0.0  # how long the last failed try took

    @property
    def active(self) -> bool:
        return self.since is not None

    def pause(self) -> float:
        """Seconds until the next try: doubling from ``first_pause_s`` up to ``max_pause_s``."""
        return min(self.max_pause_s, self.first_pause_s * 2 ** max(self.failures - 1, 0))

    def failed(self, step: int, error: BaseException, seconds: float = 0.0) -> str | None:
        """A save of ``step`` failed because the store did not answer (the try took
        ``seconds``); the line to say for the first one, None for the others."""
        first = self.since is None
        if self.since is None:  # since the failed try began
            self.since, self._started = self._wall() - seconds, self._clock() - seconds
        self.failures += 1
        self._last_try_s = seconds
        pause = self.pause() * (1 + self.jitter * self._rng.random())
        asked = getattr(error, "retry_after", None)  # the store's Retry-After: honoured
        self._next = self._clock() + max(pause, asked or 0.0)
        if not first:
            return None
        return (
            f"store unreachable since {_when(self.since)} (saving step {step}: {_cause(error)}); "
            "training on, saving when it is back"
        )

    def due(self) -> bool:
        """Whether a retry is due now (an outage, and its pause is over)."""
        return self.active and self._clock() >= self._next

    def saved(self, step: int) -> str | None:
        """A save got through: the line that ends an outage, None when there was none."""
        if not self.active:
            return None
        down, failures = self._clock() - self._started, self.failures
        self._reset()
        return (
            f"store back: saved step {step} ({down:.0f} s after it stopped answering, "
            f"{failures} save(s) failed meanwhile)"
        )

    def final_pause(self, time_left: float | None) -> float | None:
        """Before another try of a save that must be durable: the pause, or None when no
        try fits. ``time_left``: seconds until the try must have ended (None without a
        deadline: tries then stop ``final_limit_s`` after the outage began)."""
        pause = max(self._next - self._clock(), 0.0)
        if time_left is None:
            spent = self._clock() - self._started
            return pause if spent + pause + self._last_try_s <= self.final_limit_s else None
        return pause if pause + self._last_try_s <= time_left else None

    def gave_up(self, step: int, durable: int | None) -> str:
        """The line when a save that had to be durable never got through."""
        stands = (
            f"the checkpoint of step {durable} is intact and the next start resumes from it"
            if durable is not None
            else "no checkpoint of this run is durable: the next start begins where this one did"
        )
        return (
            f"the store is still unreachable (since {_when(self.since or self._wall())}) and "
            f"no further try fits: step {step} is not saved; {stands}"
        )


def _cause(error: BaseException) -> str:
    """What the storage client said, shortly: the first error below ckptstore's own."""
    e, seen = error, {id(error)}
    while type(e).__module__.startswith("ckptstore") and e.__cause__ is not None:
        e = e.__cause__
        if id(e) in seen:
            break
        seen.add(id(e))
    text = (str(e).strip().splitlines() or [""])[0]
    text = text if len(text) <= 100 else text[:97] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
