"""The rendezvous: every rank reaches rank 0's store, in short waits that a stop signal can end.

torch's ``env://`` rendezvous waits inside C++ (rank 0's ``TCPStore`` for its workers, a worker's
connect loop for rank 0) for the whole rendezvous timeout, 300 s here: a Python signal handler
only runs once that call returns, so SIGTERM and Ctrl-C did nothing for five minutes. Here every
wait is a short Python loop: rank 0 starts its store without waiting for workers, a worker probes
the port with a plain socket before it connects, and every rank counts itself in at the store and
polls the count. Between two polls :class:`StopWatch` says whether a stop signal arrived or the
caller's ``abort()`` is true.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import torch.distributed as tdist

from ddpkit.env import DistInfo
from ddpkit.errors import InitInterrupted, PeerError, first_line

POLL_S = 0.1  # between two arrival polls / connect probes: a signal ends the wait this fast
CONNECT_PROBE_S = 0.5
DEFAULT_STOP_SIGNALS = ("TERM", "INT")
_KEY = "ddpkit/arrived"
# All ranks run the same code, so the n-th init() of each process joins the n-th rendezvous (torch
# names its groups the same way); a store reused in one process never mixes two generations.
_generation = itertools.count()


class StopWatch:
    """Notices stop signals and ``abort()`` while the rendezvous waits (a context manager).

    In the main thread it installs a handler for each of ``signals`` that records the signal and
    then calls the handler that was there before, when that was a Python function (a trainer's
    flag-only handler still sets its flag). SIG_IGN is left alone; the default actions (terminate,
    KeyboardInterrupt) are replaced by the one-line :class:`InitInterrupted`. The previous
    handlers come back on exit.
    """

    def __init__(
        self, signals: Iterable[str] = DEFAULT_STOP_SIGNALS, abort: Callable[[], bool] | None = None
    ) -> None:
        self._names = tuple(signals)
        self._abort = abort
        self._previous: dict[int, Any] = {}
        self.signum: int | None = None
        self.aborted = False

    def __enter__(self) -> StopWatch:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal.signal works in the main thread only; abort() still does
        for name in self._names:
            sig = signal.Signals[f"SIG{name.upper().removeprefix('SIG')}"]
            before = signal.getsignal(sig)
            if before is signal.SIG_IGN or before is None:
                continue  # ignored on purpose (nohup), or a handler set outside Python
            self._previous[sig] = before
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, before in self._previous.items():
            signal.signal(sig, before)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        before = self._previous.get(signum)
        if callable(before) and before is not signal.default_int_handler:
            before(signum, frame)

    def stopped(self) -> str | None:
        """Why to stop waiting ("SIGTERM received", "abort() is true"), or None."""
        if self.signum is not None:
            return f"{signal.Signals(self.signum).name} received"
        if self._abort is not None and not self.aborted and self._abort():
            self.aborted = True
        return "abort() is true" if self.aborted else None


@dataclass(slots=True)
class _Wait:
    """One rank's rendezvous: who it is, where it goes, how long it may wait."""

    info: DistInfo
    seconds: float
    watch: StopWatch
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    start: float = 0.0

    @property
    def where(self) -> str:
        return f"{self.info.master_addr}:{self.info.master_port}"

    def left(self) -> float:
        return self.seconds - (self.clock() - self.start)

    def tick(self, missing: Callable[[], str]) -> None:
        """Sleep one poll; raise when a signal came, abort() is true or the time is up."""
        why = self.watch.stopped()
        if why is not None:
            raise InitInterrupted(
                f"[rank {self.info.rank}/{self.info.world_size}] stopped waiting at the rendezvous "
                f"at {self.where} after {self.clock() - self.start:.1f} s: {why}; {missing()}",
                signum=self.watch.signum,
            )
        if self.left() <= 0:
            raise self.failed(f"{missing()}")
        self.sleep(min(POLL_S, max(self.left(), 0.0)))

    def failed(self, why: str) -> PeerError:
        return PeerError(
            f"[rank {self.info.rank}/{self.info.world_size}] could not rendezvous at {self.where} "
            f"({self.info.master_source}) within {self.seconds:g} s: {why}. If the port is in use, "
            "export another MASTER_PORT; if rank 0 never started, read its log"
        )


def rendezvous(
    info: DistInfo,
    seconds: float,
    watch: StopWatch,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tdist.Store:
    """rank 0's store once every rank has reached it (its timeout is still ``seconds``).

    Raises :class:`PeerError` when ``seconds`` pass first (naming the ranks that never came) and
    :class:`InitInterrupted` as soon as ``watch`` reports a signal or ``abort()``.
    """
    wait = _Wait(info, seconds, watch, clock, sleep, start=clock())
    store = _open_store(wait)
    key = f"{_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_generation)}"
    store.set(f"{key}/{info.rank}", "1")
    count = store.add(key, 1)
    while count < info.world_size:
        wait.tick(lambda: _missing(store, key, info.world_size))
        count = store.add(key, 0)
    return store


def _open_store(wait: _Wait) -> tdist.Store:
    info = wait.info
    timeout = timedelta(seconds=max(wait.seconds, 1.0))
    # torchrun's agent hosts the store (every worker is a client); otherwise rank 0 does.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if info.rank == 0 and not agent:
        try:
            return tdist.TCPStore(
                info.master_addr,
                info.master_port,
                info.world_size,
                True,
                timeout,
                wait_for_workers=False,  # counted below, in waits a signal can end
                multi_tenant=True,
            )
        except (RuntimeError, ValueError) as e:
            raise wait.failed(first_line(e)) from e
    while not _accepts(info.master_addr, info.master_port, min(CONNECT_PROBE_S, wait.left())):
        wait.tick(lambda: f"nothing listens at {wait.where} yet (rank 0's store)")
    try:
        return tdist.TCPStore(info.master_addr, info.master_port, info.world_size, False, timeout)
    except (RuntimeError, ValueError) as e:
        raise wait.failed(first_line(e)) from e


def _accepts(host: str, port: int, timeout: float) -> bool:
    """A plain connect: unlike a TCPStore client, a refused one returns at once and logs nothing."""
    try:
        with socket.create_connection((host, port), timeout=max(timeout, 0.05)):
            return True
    except OSError:
        return False


def _missing(store: tdist.Store, key: str, world_size: int) -> str:
    try:
        absent = [r for r in range(world_size) if not store.check([f"{key}/{r}"])]
    except Exception as e:  # the store itself went away
        return f"the store stopped answering ({first_line(e)})"
    if not absent:
        return "every rank arrived"
    shown = ", ".join(map(str, absent[:16])) + (", ..." if len(absent) > 16 else "")
    return (
        f"{world_size - len(absent)} of {world_size} ranks arrived "
        f"(rank{'s' if len(absent) > 1 else ''} {shown} never did)"
    )
