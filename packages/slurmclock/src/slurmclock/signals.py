"""Stop signals that only raise a flag, and what each signal means.

The handler never does work (no checkpointing inside a signal handler: the main thread may be in
the middle of anything, including a collective or a write of the very same file). The training
loop polls :attr:`StopSignals.requested` at a step boundary and stops cleanly there.

:class:`StopFlag` is what a stop flag offers (:class:`StopSignals`, :class:`AnyFlag`, or a
source of your own: a file to watch, a cloud provider's preemption notice); :class:`SignalMeaning`
says which arrivals are SLURM's *warning* (the end is LEAD seconds away: information) and which
say "stop now".
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, Protocol, runtime_checkable

from slurmclock.durations import check_seconds, parse_duration

__all__ = [
    "LEAD_ENV",
    "STOP_SIGNALS",
    "AnyFlag",
    "SignalMeaning",
    "StopFlag",
    "StopSignals",
    "signal_lead_from_env",
    "signal_number",
]

log = logging.getLogger("slurmclock")

# SLURM's warning (USR2 rather than USR1, which NCCL may catch) and "stop now" (scancel,
# preemption, the time limit): the stop signals every trainer in this repository listens to.
STOP_SIGNALS = ("USR2", "TERM")
LEAD_ENV = "PYRECOVER_SIGNAL_LEAD"


@runtime_checkable
class StopFlag(Protocol):
    """A stop flag: :class:`StopSignals`, :class:`AnyFlag`, or any other source of stop requests.

    ``requested``: anything arrived; ``received``: the first arrival's name (``"SIGUSR2"``);
    ``arrivals``: every arrival as ``(name, epoch time)`` in time order. The arrivals carry the
    meaning (:class:`SignalMeaning`): a warning with a known lead is information, not an order.
    """

    @property
    def requested(self) -> bool: ...

    @property
    def received(self) -> str | None: ...

    @property
    def arrivals(self) -> Sequence[tuple[str, float]]: ...


def signal_lead_from_env(env: Mapping[str, str] | None = None) -> float | None:
    """``PYRECOVER_SIGNAL_LEAD`` in seconds (``300``, ``5m``); None when unset or malformed
    (logged: a broken environment must not stop a training run)."""
    raw = (os.environ if env is None else env).get(LEAD_ENV, "").strip()
    if not raw:
        return None
    try:
        return parse_duration(raw)
    except ValueError as e:
        log.warning("ignoring %s: %s; a warning signal then stops at once", LEAD_ENV, e)
        return None


def signal_name(sig: str) -> str:
    """``"usr2"``, ``"USR2"`` or ``"SIGUSR2"`` -> ``"SIGUSR2"`` (any other name as given)."""
    text = str(sig).strip().upper()
    return text if text.startswith("SIG") else "SIG" + text


@dataclass(frozen=True, slots=True)
class SignalMeaning:
    """What an arrival means: SLURM's warning with a known ``lead`` (seconds between
    ``--signal=B:USR2@LEAD`` and the end) is information; every other arrival -- TERM, INT, a
    ``request()``, a warning whose lead is unknown -- means "stop now"."""

    lead: float | None = None
    warnings: tuple[str, ...] = ("SIGUSR2",)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SignalMeaning:
        """The lead from ``PYRECOVER_SIGNAL_LEAD`` (which the sbatch scripts export)."""
        return cls(signal_lead_from_env(env))

    def is_warning(self, name: str) -> bool:
        return self.lead is not None and signal_name(name) in self.warnings

    def stop_now(self, flag: StopFlag | None) -> str | None:
        """The first arrival on ``flag`` that means "stop now" (None: none, or warnings only)."""
        if flag is None or not flag.requested:
            return None
        return next((n for n, _ in flag.arrivals if not self.is_warning(n)), None)

    def warnings_in(self, flag: StopFlag | None) -> list[tuple[str, float]]:
        """The warning arrivals on ``flag``, in time order."""
        if flag is None or not flag.requested:
            return []
        return [a for a in flag.arrivals if self.is_warning(a[0])]

    def describe(self) -> str:
        """One line for a start banner: what each signal does."""
        names = "/".join(w.removeprefix("SIG") for w in self.warnings)
        if self.lead is None:
            warning = f"SIG{names} stops at once (no {LEAD_ENV})"
        else:
            warning = (
                f"SIG{names} is SLURM's warning {self.lead:g} s before the end ({LEAD_ENV}): "
                "information"
            )
        return f"{warning}; SIGTERM stops at once"


# What signal.getsignal returns: a callable, SIG_DFL/SIG_IGN, or None (set from C).
_Handler = Any


def signal_number(sig: str | int | signal.Signals) -> signal.Signals:
    """``"USR2"``, ``"SIGUSR2"``, ``12`` or ``signal.SIGUSR2`` -> ``signal.SIGUSR2``."""
    if isinstance(sig, signal.Signals):
        return sig
    if isinstance(sig, int) and not isinstance(sig, bool):
        try:
            return signal.Signals(sig)
        except ValueError:
            raise ValueError(f"{sig} is not a signal number on this system") from None
    if isinstance(sig, str):
        name = sig.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        try:
            return signal.Signals[name]
        except KeyError:
            raise ValueError(f"unknown signal {sig!r}; use a name like 'USR2' or 'TERM'") from None
    raise TypeError(f"a signal is a name or a number, got {type(sig).__name__}")


class StopSignals:
    """Raise a stop flag on the given signals (default SIGUSR2 and SIGTERM).

    SIGUSR2 by default rather than SIGUSR1, which NCCL may use. ``install()`` (or ``with``)
    replaces the handlers; ``restore()`` puts the previous ones back. With ``chain=True`` a
    previous *Python* handler is still called after the flag is set; ``SIG_DFL``/``SIG_IGN`` and
    Python's default SIGINT handler (which raises KeyboardInterrupt) are not -- chaining them would
    kill the process or abort the step, the very thing this class prevents.

    ``received`` is the name of the first signal (``"SIGUSR2"``), ``received_at`` its epoch time,
    ``count`` how many arrived, ``arrivals`` every one as ``(name, epoch time)`` (a
    :class:`~slurmclock.TimeBudget` reads a warning signal there as information, not an order).
    Install from the main thread (Python delivers signals there). ``clock`` stamps the arrivals
    (epoch seconds; injectable for simulations and tests).
    """

    def __init__(
        self,
        signals: Iterable[str | int | signal.Signals] = STOP_SIGNALS,
        *,
        chain: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.signals = tuple(dict.fromkeys(signal_number(s) for s in signals))
        if not self.signals:
            raise ValueError("StopSignals needs at least one signal, e.g. ('USR2', 'TERM')")
        for sig in self.signals:
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(f"{sig.name} cannot be caught; pick e.g. USR2 or TERM")
        self.chain = chain
        self._clock = clock
        self.received: str | None = None
        self.received_at: float | None = None
        self.count = 0
        self.arrivals: list[tuple[str, float]] = []
        self._previous: dict[signal.Signals, _Handler] = {}

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived (or :meth:`request` was called)."""
        return self.received is not None

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def request(self, reason: str = "manual") -> None:
        """Raise the flag without a signal (e.g. another rank asked to stop)."""
        now = self._clock()
        if self.received is None:
            self.received, self.received_at = reason, now
        self.count += 1
        self.arrivals.append((reason, now))  # list.append: safe from a signal handler

    def reset(self) -> None:
        """Lower the flag again."""
        self.received = self.received_at = None
        self.count = 0
        self.arrivals = []

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only assignments here: a signal can interrupt the main thread anywhere.
        self.request(signal.Signals(signum).name)
        previous = self._previous.get(signal.Signals(signum))
        if self.chain and callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def install(self) -> StopSignals:
        """Install the handlers (idempotent); returns self."""
        if self._previous:
            return self
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "StopSignals.install() must run in the main thread (Python only lets the main "
                "thread set signal handlers); create it before starting worker threads"
            )
        try:
            for sig in self.signals:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        except BaseException:
            self.restore()
            raise
        log.debug("stop flag armed for %s", ", ".join(s.name for s in self.signals))
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before :meth:`install`."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            # None means "installed from C": the closest Python can set back is the default.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def wait(self, timeout: float | None = None, interval: float = 0.05) -> bool:
        """Sleep until the flag is raised or ``timeout`` s pass; returns :attr:`requested`.

        Polls instead of using an Event: setting an Event from a signal handler can deadlock
        when the signal lands while the main thread holds the Event's lock.
        """
        interval = check_seconds("interval", interval, positive=True)
        end = None if timeout is None else time.monotonic() + check_seconds("timeout", timeout)
        while not self.requested and (end is None or time.monotonic() < end):
            time.sleep(interval if end is None else max(0.0, min(interval, end - time.monotonic())))
        return self.requested

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.restore()

    def __repr__(self) -> str:
        names = ",".join(s.name for s in self.signals)
        return f"StopSignals({names}, received={self.received!r}, installed={self.installed})"


class AnyFlag:
    """Several stop flags read as one: raised when any of them is.

    E.g. ``AnyFlag(slurm_signals, ctrl_c)`` where Ctrl-C is armed only once training runs.
    ``received`` is the first arrival over all flags, ``arrivals`` all of them in time order;
    ``request()`` raises the first flag.
    """

    def __init__(self, *flags: StopFlag) -> None:
        if not flags:
            raise ValueError("AnyFlag needs at least one flag, e.g. AnyFlag(signals, interrupt)")
        self.flags = flags

    @property
    def requested(self) -> bool:
        return any(f.requested for f in self.flags)

    @property
    def arrivals(self) -> list[tuple[str, float]]:
        return sorted((a for f in self.flags for a in f.arrivals), key=lambda a: a[1])

    @property
    def received(self) -> str | None:
        first = self.arrivals[:1]
        return first[0][0] if first else None

    @property
    def received_at(self) -> float | None:
        first = self.arrivals[:1]
        return first[0][1] if first else None

    def request(self, reason: str = "manual") -> None:
        """Raise the first flag (a :class:`StopSignals` or :class:`AnyFlag`)."""
        first = self.flags[0]
        if not isinstance(first, (StopSignals, AnyFlag)):
            raise TypeError(f"AnyFlag.request() raises the first flag: {first!r} cannot be")
        first.request(reason)

    def __repr__(self) -> str:
        return f"AnyFlag({', '.join(map(repr, self.flags))})"
