"""Heartbeats through the rendezvous store, so a failed collective can name the rank that died.

gloo and NCCL say "connection closed by peer [10.0.0.7]:41234" or "timed out": neither names a
rank. Each rank bumps a counter in the store every ``interval`` seconds from a daemon thread;
after a failure the survivors read the counters twice, ``settle`` seconds apart: a counter that
did not move belongs to a rank that is gone (or frozen with the GIL held). One tiny store write
per rank every few seconds costs nothing next to a training step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

from ddpkit.errors import first_line

KEY_PREFIX = "ddpkit/hb/"


class CounterStore(Protocol):
    """The part of ``torch.distributed.Store`` the heartbeats use."""

    def add(self, key: str, amount: int, /) -> int: ...

    def set_timeout(self, timeout: timedelta, /) -> None: ...


def heartbeat_interval(timeout_s: float) -> float:
    """A tenth of the collective timeout, between 0.5 s and 2 s: diagnosis stays well inside it."""
    return min(2.0, max(0.5, timeout_s / 10))


class Heartbeat:
    """A daemon thread bumping ``ddpkit/hb/<rank>`` every ``interval`` seconds until stopped."""

    def __init__(
        self, store: CounterStore, rank: int, interval: float, *, prefix: str = KEY_PREFIX
    ) -> None:
        self._store = store
        self._key = f"{prefix}{rank}"
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"ddpkit-heartbeat-{rank}", daemon=True
        )

    def start(self) -> Heartbeat:
        self._store.add(self._key, 1)  # exists before anyone could diagnose
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval):
                self._store.add(self._key, 1)
        except Exception:
            return  # the store is gone (rank 0 died); the collectives will say so

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval + 1.0)


def diagnose(
    store: CounterStore,
    world_size: int,
    me: int,
    interval: float,
    *,
    prefix: str = KEY_PREFIX,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """One sentence on which ranks stopped answering (blocks about ``2.5 * interval``).

    ``prefix``: the counters' keys without the rank (the watchdog's ``<rendezvous prefix>/hb/``).
    """
    settle = 2.5 * interval
    try:
        store.set_timeout(timedelta(seconds=max(5.0, settle)))
        before = [store.add(f"{prefix}{r}", 0) for r in range(world_size)]
        sleep(settle)
        after = [store.add(f"{prefix}{r}", 0) for r in range(world_size)]
    except Exception as e:
        return (
            "the rendezvous store is unreachable, so the process hosting it (rank 0, or the "
            f"torchrun agent) is probably gone ({first_line(e)})"
        )
    silent = [r for r in range(world_size) if r != me and after[r] == before[r]]
    if silent:
        which = ", ".join(map(str, silent))
        return (
            f"rank{'s' if len(silent) > 1 else ''} {which} stopped answering (no heartbeat for "
            f"{settle:.1f} s): look at {'their' if len(silent) > 1 else 'its'} log for the "
            "first error"
        )
    return (
        "every rank still answers: one of them is alive but not in this collective (stuck, "
        "slower, or on another code path such as uneven data)"
    )
