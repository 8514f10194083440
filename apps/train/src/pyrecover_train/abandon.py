"""A blocking call with a hard end: at a time, or at once on a stop signal, the process exits.

An extra save (after the final one is durable) may still be writing when the exit must begin.
ckptstore commits a checkpoint with one atomic step after everything is written, so ending the
process mid-save is what a SIGKILL would do: the half-written step is ignored and swept, the
final save stands. ``os._exit`` is the one way out that does not wait for a thread still
writing (a storage client may not be interruptible); the watchdog says why first, and flushes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

__all__ = ["AbandonAt"]

log = logging.getLogger("pyrecover_train")


class AbandonAt:
    """``with AbandonAt(at, ...):`` -- if the body is still running at ``at`` (epoch seconds, by
    ``clock``), or when ``interrupted()`` returns a reason, ``on_abandon(why)`` runs on the
    watchdog thread and the process exits with ``code``. A body that ends first wins: the
    watchdog then does nothing (a lock decides the race)."""

    def __init__(
        self,
        at: float,
        *,
        code: int,
        on_abandon: Callable[[str], None],
        interrupted: Callable[[], str | None] = lambda: None,
        clock: Callable[[], float] = time.time,
        poll: float = 0.05,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.at, self.code, self.poll, self.clock, self.exit = at, code, poll, clock, exit
        self.on_abandon, self.interrupted = on_abandon, interrupted
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="abandon-at", daemon=True)
        self.abandoned: str | None = None

    def __enter__(self) -> AbandonAt:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._lock:  # once the watchdog holds it, the process is on its way out
            self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._done.wait(max(0.0, min(self.poll, self.at - self.clock()))):
            why = self.interrupted()
            if why is None and self.clock() < self.at:
                continue
            with self._lock:
                if self._done.is_set():
                    return
                self.abandoned = why or "the exit must begin"
                try:
                    self.on_abandon(self.abandoned)
                except Exception as e:  # the exit matters more than its description
                    log.error("while abandoning: %s", e)
                finally:
                    _flush()
                    self.exit(self.code)
                return


def _flush() -> None:
    """What os._exit would drop: buffered log records and console output."""
    handlers = [*logging.getLogger().handlers, *log.handlers]
    for target in (*handlers, sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream: nothing to keep
            target.flush()
