"""How long a wait on the store may last: bounds from the caller's time, and a stop.

A store that accepts a connection and never answers (a stalled gateway, a half-dead load
balancer) must not hold a training run past its deadline, nor keep it deaf to SIGTERM. Every
wait ckptstore does on a store that can stall -- one request of an object store, the save in
flight -- goes through :meth:`CallLimits.wait`, which gives the call up (cancels it: its
connection is dropped, the next call makes a new one) and raises
:class:`~ckptstore.StoreUnreachableError` (an outage: nothing was committed) when

- the call has waited ``call_s()`` seconds (the caller derives it from its measured saves),
- the time left (``time_left()``, seconds until any call must have ended) is spent, or
- a stop was asked after the call began (``stopping()`` rose: a bool, or a count of stops, so
  a second signal ends a call the first one began): ``stop_grace_s`` after it, or after
  ``expected_s()`` into the call when that is later (a healthy save in flight is not thrown
  away for a stop; a stalled one, past what a call is expected to take, is).

A call that begins after the stop (the final save) gets what a healthy call takes
(``expected_s()``, at least ``stop_grace_s``) plus ``stop_grace_s``, within the first two. The
defaults (no deadline, no stop source) bound a call by ``call_s`` alone; a trainer passes its
own (``CheckpointStore.set_limits``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import StoreUnreachableError

T = TypeVar("T")

DEFAULT_CALL_S = 300.0  # without a caller's bound: what one call may wait at most


def _no_deadline() -> float | None:
    return None


def _never() -> bool:
    return False


@dataclass(kw_only=True, slots=True)
class CallLimits:
    """The bounds of one wait on the store; see the module docstring."""

    call_s: Callable[[], float] = field(default=lambda: DEFAULT_CALL_S)
    time_left: Callable[[], float | None] = _no_deadline
    stopping: Callable[[], bool | int] = _never
    stop_grace_s: float = 3.0
    expected_s: Callable[[], float] = field(default=lambda: 0.0)
    poll_s: float = 0.2
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if not 0 <= self.stop_grace_s <= 60:
            raise ValueError(
                f"stop_grace_s must be in 0..60 seconds (a stop must end a wait within "
                f"seconds), got {self.stop_grace_s}"
            )
        if not 0 < self.poll_s <= 1:
            raise ValueError(f"poll_s must be in (0, 1] seconds, got {self.poll_s}")

    def bound(self) -> float:
        """Seconds a call that starts now may wait."""
        left = self.time_left()
        return max(0.0, self.call_s() if left is None else min(self.call_s(), left))

    def wait(
        self, done: Callable[[float], bool], what: str, cancel: Callable[[], object] = _never
    ) -> None:
        """Wait until ``done(timeout)`` says the call ended (it waits at most ``timeout``);
        past a bound, ``cancel()`` it and raise StoreUnreachableError naming ``what``."""
        t0 = self.clock()
        stopping_at_start, stop_seen = int(self.stopping()), None
        limit, expected = self.bound(), self.expected_s()  # the time left as the call begins
        by_time = limit < self.call_s()
        if stopping_at_start:  # after a stop nothing waits longer than a healthy call, + grace
            limit = min(limit, max(expected, self.stop_grace_s) + self.stop_grace_s)
        while not done(self.poll_s):
            now = self.clock()
            why = self._over(now - t0, limit, by_time)
            if why is None and int(self.stopping()) > stopping_at_start:
                stop_seen = now if stop_seen is None else stop_seen
                if now >= max(stop_seen + self.stop_grace_s, t0 + expected):
                    why = "a stop was asked"
            if why is not None:
                cancel()
                raise _given_up(what, now - t0, why)

    def _over(self, waited: float, limit: float, by_time: bool) -> str | None:
        if waited >= limit:
            return "the time left for it is spent" if by_time else f"no answer within {limit:.0f} s"
        left = self.time_left()
        if left is not None and left <= 0:
            return "the time left for it is spent"
        return None

    def result(self, future: Future[T], what: str) -> T:
        """``future.result()`` within the bounds (cancelled past them)."""

        def done(timeout: float) -> bool:
            try:
                future.exception(timeout)
            except TimeoutError:
                return False
            except BaseException:  # cancelled: result() below says so
                return True
            return True

        self.wait(done, what, future.cancel)
        return future.result()


def _given_up(what: str, waited: float, why: str) -> StoreUnreachableError:
    err = StoreUnreachableError(
        f"the store did not answer at {what}: given up after {waited:.0f} s ({why}; the "
        "connection is dropped, the next call makes a new one); nothing was committed, what is "
        "committed is intact"
    )
    err.__cause__ = TimeoutError(why)
    return err


def run_async(loop: Any, coro: Any, limits: CallLimits, what: str) -> Any:
    """Run ``coro`` on the event loop ``loop`` (another thread's, as fsspec's) within
    ``limits``: a call given up is cancelled there (aiohttp closes its connection)."""
    import asyncio

    return limits.result(asyncio.run_coroutine_threadsafe(coro, loop), what)
