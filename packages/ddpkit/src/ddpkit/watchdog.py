"""The watchdog: a rank that dies or freezes ends the whole step within seconds.

Without it, the survivors learn of a dead peer only when a collective fails -- after the
collective timeout (180 s here, 10-30 min in torch) -- and of a frozen one never. Each rank runs
two daemon threads from ``init()`` on:

- a **store thread** bumps this rank's heartbeat counter in the rendezvous store every
  ``interval`` and reads two keys: the counter of the rank it watches (the next rank, in a ring)
  and the job's fault record. It has its own store connection with its own blocking calls: a
  store whose host is stopped (SIGSTOP) never answers a call, so nothing else may wait on it.
- a **watch thread** never touches the store. Each rank listens on a TCP port of its own (the
  *beacon*, published with its host name at the rendezvous); the watch thread holds a connection
  to the beacon of the rank it watches and to rank 0's (which hosts the store). When a process
  dies, by SIGKILL, the OOM killer or a segfault, the kernel closes its sockets: its watcher sees
  the connection close at once. A process that is stopped or stuck with the GIL held keeps its
  connections (the kernel still answers for it) but its counter stops: after ``frozen_after``
  seconds of silence it is frozen. A node that vanishes closes nothing: after a few silent
  intervals a fresh connection to its beacon fails, and it is dead.

The rank that sees a failure prints one line, appends it to ``DDPKIT_FAULT_FILE``, publishes it
(the fault key, and an ``F`` message to the ranks connected to its own beacon) and ends its
process with exit 69; the others follow as soon as they read either, with one line each. A
frozen rank cannot end itself: on the same machine its watcher SIGKILLs it (only the process it
published: pid, start time, pid namespace); on another node the launcher (torchrun, mpirun,
``srun --kill-on-bad-exit``) ends it once the others have exited. The job script can requeue.
A rank that leaves normally says so first (``L``), one that leaves with an exception says which
(``E``): neither is taken for dead.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ddpkit import faults
from ddpkit.beacon import Beacon, Link
from ddpkit.errors import DistConfigError, first_line
from ddpkit.faults import EXIT_PEER_LOST, EXIT_STOPPED, FAULT_FILE_ENV, Fault

WATCHDOG_ENV = "DDPKIT_WATCHDOG"
FROZEN_ENV = "DDPKIT_FROZEN_AFTER"
# A silent counter means a stopped process or one holding the GIL: nothing else stops the
# heartbeat thread (torch.save, compiles, CUDA init and collectives release the GIL; a 5-million
# object gc.collect() holds it 1 s). 20 s is ten intervals: no step, save or compile reaches it.
DEFAULT_FROZEN_AFTER_S = 20.0
MIN_INTERVALS_FROZEN = 3
DEAD_PROBE_INTERVALS = 3  # a silent rank's beacon is probed after this many intervals ...
MIN_DEAD_PROBE_S = 5.0  # ... but not sooner than this
TICK_S = 0.25  # the watch thread's wake-up: how late a message or a closed connection is read
STORE_GONE_GRACE_S = 1.0  # a store error waits this long for the news from rank 0's beacon
# A rank leaving with an error first lets its watch thread look this many more times (bounded
# by VERDICT_WAIT_S): the error may be a peer's death seen first by a collective.
VERDICT_TICKS = 2
VERDICT_WAIT_S = 2.0
DYING_WAIT_S = 5.0  # how long a leaving rank waits for a dying watch thread's own exit


class WatchStore(Protocol):
    """The part of ``torch.distributed.Store`` the store thread uses."""

    def add(self, key: str, amount: int, /) -> int: ...

    def check(self, keys: list[str], /) -> bool: ...

    def get(self, key: str, /) -> bytes: ...

    def set(self, key: str, value: str, /) -> None: ...


@dataclass(kw_only=True, slots=True)
class WatchdogOptions:
    """How the watchdog behaves; every None is read from the environment (then the default).

    ``enabled``: ``DDPKIT_WATCHDOG`` (``0`` turns it off), default on. ``frozen_after``: seconds
    of silence before a rank that is still there counts as frozen, ``DDPKIT_FROZEN_AFTER`` or
    20. ``fault_file``: ``DDPKIT_FAULT_FILE``, where the reporter appends one JSON line per
    failure. ``exit_code``: what the watchdog ends a rank with (69).
    """

    enabled: bool | None = None
    frozen_after: float | None = None
    fault_file: str | None = None
    exit_code: int = EXIT_PEER_LOST

    def __post_init__(self) -> None:
        if self.enabled not in (None, True, False):
            raise DistConfigError(f"watchdog enabled={self.enabled!r} must be True or False")
        if self.frozen_after is not None and not (
            isinstance(self.frozen_after, (int, float)) and self.frozen_after > 0
        ):
            raise DistConfigError(
                f"frozen_after={self.frozen_after!r} must be a positive number of seconds, e.g. 20"
            )
        if not (isinstance(self.exit_code, int) and 1 <= self.exit_code <= 255):
            raise DistConfigError(f"exit_code={self.exit_code!r} must be an int in 1..255")
        if self.exit_code == EXIT_STOPPED:
            raise DistConfigError(
                f"exit_code={EXIT_STOPPED} must not be used: job scripts read it as 'stopped "
                f"with a checkpoint, resume'; keep {EXIT_PEER_LOST} or pick another code"
            )

    def settings(self, env: Mapping[str, str], interval: float) -> Settings | None:
        """The values in force (None: off), checked against ``interval``; one-line errors."""
        enabled = env_switch(env) if self.enabled is None else self.enabled
        if not enabled:
            return None
        frozen = self.frozen_after
        source = "frozen_after"
        if frozen is None:
            frozen, source = env_frozen_after(env), FROZEN_ENV
        if frozen < MIN_INTERVALS_FROZEN * interval:
            raise DistConfigError(
                f"{source}={frozen:g} s is shorter than {MIN_INTERVALS_FROZEN} heartbeat "
                f"intervals ({MIN_INTERVALS_FROZEN * interval:g} s): a busy rank would be taken "
                "for frozen; raise it"
            )
        path = self.fault_file if self.fault_file is not None else env.get(FAULT_FILE_ENV)
        path = faults.check_fault_file(path) if path and path.strip() else None
        return Settings(
            interval=interval, frozen_after=float(frozen), fault_file=path, exit_code=self.exit_code
        )


def env_switch(env: Mapping[str, str]) -> bool:
    """``DDPKIT_WATCHDOG``: on unless 0 (off, false, no); anything else is one line. Read on
    every process, one rank too: a typo is said where it is made, not first on a big launch."""
    text = env.get(WATCHDOG_ENV, "").strip().lower()
    if text not in ("", "0", "1", "on", "off", "true", "false", "yes", "no"):
        raise DistConfigError(
            f"{WATCHDOG_ENV}={text!r} must be 1 (on, the default) or 0 (off); fix or unset it"
        )
    return text not in ("0", "off", "false", "no")


def env_frozen_after(env: Mapping[str, str]) -> float:
    """``DDPKIT_FROZEN_AFTER`` in seconds (default 20); anything but a positive number is one
    line."""
    text = env.get(FROZEN_ENV, "").strip()
    try:
        frozen = float(text) if text else DEFAULT_FROZEN_AFTER_S
    except ValueError:
        frozen = float("nan")
    if not frozen > 0 or frozen == float("inf"):
        raise DistConfigError(
            f"{FROZEN_ENV}={text!r} must be a positive number of seconds, e.g. 20"
        )
    return frozen


@dataclass(frozen=True, slots=True)
class Settings:
    interval: float
    frozen_after: float
    fault_file: str | None
    exit_code: int

    @property
    def dead_probe_after(self) -> float:
        return min(max(DEAD_PROBE_INTERVALS * self.interval, MIN_DEAD_PROBE_S), self.frozen_after)


# -- the watchdog ------------------------------------------------------------------------------


def _stderr(line: str) -> None:
    # os.write, not print: the main thread may hold sys.stderr's lock (stopped in a write).
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())


def _flush_std(timeout: float) -> None:
    """Flush Python's stdout/stderr buffers, giving up after ``timeout`` (a held lock)."""

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    t = threading.Thread(target=flush, daemon=True)
    t.start()
    t.join(timeout)


class Watchdog:
    """The two threads of one rank (see the module's docstring). Made and started by ``init()``.

    ``store`` is a connection of the watchdog's own; ``prefix`` the rendezvous' key prefix;
    ``records(rank)`` a rank's arrival record (its beacon). ``store_host_is_rank0`` is False
    under torchrun's agent store. ``clock``, ``exit`` and ``write`` are injectable for tests.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        store: WatchStore,
        prefix: str,
        beacon: Beacon,
        settings: Settings,
        job_id: str | None = None,
        store_host_is_rank0: bool = True,
        store_where: str = "",
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], Any] = os._exit,
        write: Callable[[str], None] = _stderr,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self._store, self._prefix, self._beacon = store, prefix, beacon
        self.settings = settings
        self._job_id = job_id
        self._store_is_rank0, self._store_where = store_host_is_rank0, store_where
        self._clock, self._exit, self._write = clock, exit, write
        self._host = socket.gethostname()
        self._target: int | None = (rank + 1) % world_size if world_size > 1 else None
        self._links: dict[int, Link] = {}
        self._stop = threading.Event()  # both threads end
        self._store_stop = threading.Event()  # the store thread ends (the store is going away)
        self._lock = threading.Lock()
        self._dying = False
        self._ticks = 0  # the watch thread's completed looks, each after a fresh select
        self._ticked = threading.Condition()
        self._watch_over = False
        self._leaving_with_error = False
        self.fault: Fault | None = None  # what made this rank exit (tests read it)
        now = clock()
        self._last_ok = now
        self._store_error: str | None = None
        self._store_error_at = 0.0
        self._store_fault: Fault | None = None
        self._hb: int | None = None
        self._hb_since = now
        self._hb_read = now
        self._probed_at = 0.0
        self._threads: list[threading.Thread] = []

    def _key(self, what: str, rank: int | None = None) -> str:
        return f"{self._prefix}/{what}" + ("" if rank is None else f"/{rank}")

    # -- life cycle ----------------------------------------------------------------------------

    def start(self, records: Callable[[int], str]) -> Watchdog:
        """Connect to the watched beacons, beat once, start both threads."""
        for peer in sorted({r for r in (self._target, 0) if r is not None and r != self.rank}):
            link = Link(peer, json.loads(records(peer)))
            try:
                self._links[peer] = link.connect()
            except OSError as e:
                # Firewalled ports between nodes: the counters still catch it, later.
                self._write(
                    f"ddpkit: [rank {self.rank}] cannot reach rank {peer}'s beacon at "
                    f"{link.addr[0]}:{link.addr[1]} ({e}); a death there is seen from its "
                    "heartbeat only"
                )
        self._store.add(self._key("hb", self.rank), 1)  # exists before anyone looks
        for target in (self._store_loop, self._watch_loop):
            t = threading.Thread(target=target, name=f"ddpkit-{target.__name__[1:]}", daemon=True)
            t.start()
            self._threads.append(t)
        _LIVE.add(self)
        return self

    def forget_in_child(self) -> None:
        """In a forked child: close the copies of the sockets (the parent keeps its own)."""
        self._stop.set()
        for link in self._links.values():
            link.close()
        self._beacon.close()

    def leave(self, error: str | None = None) -> None:
        """This rank is done: tell the watchers (``L``, or ``E`` with the error), stop.

        Rank 0 (whose store the others use) then waits up to one interval for the others to
        hang up, so no store thread is left talking to a store that just went away.
        """
        if error is not None:
            self._await_verdict()
        with self._lock:
            if self._dying or self._stop.is_set():
                self._shutdown()
                return
            self._stop.set()
        self._store_stop.set()
        for t in self._threads:
            t.join(timeout=TICK_S + 1.0)
        if error is None:
            self._beacon.send("L\n")
        else:
            me = Fault(
                rank=self.rank,
                host=self._host,
                what="error",
                reporter=self.rank,
                job_id=self._job_id,
                detail=error,
            )
            self._publish(me)  # for the ranks not connected to this one
            self._beacon.send(f"E {me.to_json()}\n")
        if self.rank == 0 and error is None:
            self._wait_hang_ups(self.settings.interval + 0.5)
        self._shutdown()

    def _await_verdict(self) -> None:
        """Before leaving with an error, let the watch thread look again. When a peer is killed,
        this rank's collective fails ("Connection reset by peer") the moment its connection to
        the peer's beacon closes; the ``with`` block may end in that error before the watch
        thread has read the close, and leaving would silence it: the job would hear "error,
        exit 1" instead of "rank N on HOST is dead, exit 69, in the fault file". VERDICT_TICKS
        fresh looks (at most a TICK_S each, more on a loaded machine; bounded by VERDICT_WAIT_S)
        settle it; a watch thread that found a failure ends the process meanwhile (its exit). A
        peer's error (its ``E``) is no such failure: this rank ends with its own."""
        watch = self._threads[-1] if self._threads else None  # started last in start()
        if watch is None or not watch.is_alive():
            return
        self._leaving_with_error = True
        with self._ticked:
            goal = self._ticks + VERDICT_TICKS
            self._ticked.wait_for(
                lambda: self._ticks >= goal or self._stop.is_set() or self._watch_over,
                timeout=VERDICT_WAIT_S,
            )
        if self._dying:  # it found one: its exit code and line, not this rank's error
            watch.join(DYING_WAIT_S)

    def _wait_hang_ups(self, seconds: float) -> None:
        end = self._clock() + seconds
        while self._beacon.conns and self._clock() < end:
            readable = _select(self._beacon.conns, min(TICK_S, max(end - self._clock(), 0)))
            self._beacon.drain(readable)

    def _shutdown(self) -> None:
        self._stop.set()
        self._store_stop.set()
        for link in self._links.values():
            link.close()
        self._beacon.close()

    # -- the store thread ------------------------------------------------------------------------

    def _store_loop(self) -> None:
        me, fault_key = self._key("hb", self.rank), self._key("fault")
        while not (self._stop.is_set() or self._store_stop.is_set()):
            try:
                self._store.add(me, 1)
                target = self._target
                if target is not None:
                    value = self._store.add(self._key("hb", target), 0)
                    self._saw(target, value)
                if self._store.check([fault_key]):
                    text = bytes(self._store.get(fault_key)).decode()
                    self._store_fault = Fault.from_json(text)
                self._last_ok = self._clock()
            except Exception as e:  # a broken connection stays broken: stop here
                self._store_error = first_line(e)
                self._store_error_at = self._clock()
                return
            self._store_stop.wait(self.settings.interval)

    def _saw(self, target: int, value: int) -> None:
        now = self._clock()
        with self._lock:
            if target != self._target:
                return
            if value != self._hb:
                self._hb, self._hb_since = value, now
            self._hb_read = now

    # -- the watch thread ----------------------------------------------------------------------

    def _watch_loop(self) -> None:
        try:
            self._watch()
        finally:
            self._watch_over = True
            self._looked()

    def _watch(self) -> None:
        last = self._clock()
        while not self._stop.is_set():
            socks: list[Any] = [self._beacon.sock, *self._beacon.conns]
            socks += [lk.sock for lk in self._links.values() if lk.sock is not None]
            readable = _select(socks, TICK_S)
            now = self._clock()
            if now - last > TICK_S + 1.0:
                self._stalled(now - last)  # this process was not running: judge nobody for it
            last = now
            if self._stop.is_set():
                return
            if self._beacon.sock in readable:
                self._beacon.accept()
            self._beacon.drain(readable)
            for link in self._links.values():
                link.read()
            verdict = self.judge(now)
            if verdict is None:
                self._looked()
                continue
            if isinstance(verdict, str):  # "stop": rank 0 left, the job is ending
                self._beacon.send("L\n")  # first: a closed beacon alone would look dead
                self._shutdown()
                return
            fault, reporter = verdict
            if fault.what == "error" and self._leaving_with_error:
                return  # this rank ends with an error of its own: a peer's changes nothing
            self._die(fault, reporter)
            return

    def _looked(self) -> None:
        """One more look done (or the watch over): wakes a leave() waiting for a verdict."""
        with self._ticked:
            self._ticks += 1
            self._ticked.notify_all()

    def _stalled(self, gap: float) -> None:
        with self._lock:
            self._hb_since += gap
            self._last_ok += gap

    def judge(self, now: float) -> tuple[Fault, bool] | str | None:
        """What to do now: None (all well), "stop" (rank 0 left: the job is ending), or (the
        fault, whether this rank is its reporter)."""
        for link in list(self._links.values()):
            verdict = self._judge_link(link, now)
            if verdict is not None:
                return verdict
        if self._store_fault is not None:
            return self._store_fault, False
        if self._store_error is not None and now - self._store_error_at > STORE_GONE_GRACE_S:
            return self._store_host_failed("dead", f"its store closed: {self._store_error}", now)
        if self._store_error is None and now - self._last_ok > self.settings.frozen_after:
            return self._store_host_failed("frozen", "its store stopped answering", now)
        return self._judge_target(now)

    def _judge_link(self, link: Link, now: float) -> tuple[Fault, bool] | str | None:
        while link.lines:
            line = link.lines.pop(0)
            if line == "L":
                if link.rank == 0:
                    return "stop"  # rank 0 is done: the job ends, and its store with it
                self._unwatch(link)
                return None
            kind, _, body = line.partition(" ")
            if kind in ("E", "F"):
                try:
                    return Fault.from_json(body), False
                except (ValueError, TypeError):
                    continue
        if not link.closed:
            return None
        silent = now - self._hb_since if link.rank == self._target else 0.0
        fault = self._fault(link.rank, link.host, "dead", silent, "its connection closed")
        return self._as_reporter_or_not(fault)

    def _unwatch(self, link: Link) -> None:
        link.close()
        self._links.pop(link.rank, None)
        with self._lock:
            if link.rank == self._target:
                self._target = None  # it left: nobody's counter to read any more

    def _store_host_failed(self, what: str, detail: str, now: float) -> tuple[Fault, bool]:
        if not self._store_is_rank0:
            fault = Fault(
                rank=None,
                host=self._store_where,
                what="dead" if what == "dead" else "frozen",
                reporter=self.rank,
                silent_s=now - self._last_ok,
                job_id=self._job_id,
                detail=detail,
            )
            return fault, False
        link = self._links.get(0)
        if what == "frozen" and link is not None and not link.probe():
            what, detail = "dead", "its node does not answer"
        host = link.host if link is not None else self._store_where
        return self._as_reporter_or_not(self._fault(0, host, what, now - self._last_ok, detail))

    def _judge_target(self, now: float) -> tuple[Fault, bool] | None:
        target = self._target
        if target is None:
            return None
        with self._lock:
            silent = self._hb_read - self._hb_since
        if silent < self.settings.dead_probe_after:
            return None
        link = self._links.get(target)
        if now - self._probed_at < self.settings.dead_probe_after:
            alive = True
        else:
            self._probed_at = now
            alive = link.probe() if link is not None else True
        if not alive:
            host = link.host if link is not None else "?"
            return self._fault(target, host, "dead", silent, "its node does not answer"), True
        if silent >= self.settings.frozen_after:
            host = link.host if link is not None else "?"
            detail = "its process is there: stopped, or holding the GIL"
            return self._fault(target, host, "frozen", silent, detail), True
        return None

    def _fault(self, rank: int, host: str, what: str, silent: float, detail: str) -> Fault:
        reporter = (rank - 1) % self.world_size  # the rank that watches it
        return Fault(
            rank=rank,
            host=host,
            what="dead" if what == "dead" else "frozen",
            reporter=reporter,
            silent_s=max(silent, 0.0),
            job_id=self._job_id,
            detail=detail,
        )

    def _as_reporter_or_not(self, fault: Fault) -> tuple[Fault, bool]:
        return fault, fault.reporter == self.rank

    # -- the end -------------------------------------------------------------------------------

    def _die(self, fault: Fault, reporter: bool) -> None:
        with self._lock:
            if self._stop.is_set():
                return  # leave() won the race: this rank is ending normally
            self._dying = True
            self._stop.set()
        self._looked()  # a leave() waiting for a verdict: here it is
        # The rank that watches the failed one records it, however the news reached it first
        # (a follower's F may arrive before its own closed connection or its own count).
        reporter = reporter or fault.reporter == self.rank
        self.fault = fault
        code = self.settings.exit_code
        where = f"[rank {self.rank}/{self.world_size} on {self._host}]"
        told = "seen by this rank" if reporter else f"reported by rank {fault.reporter}"
        note = ""
        frozen_here = self._frozen_here(fault) if reporter else None
        if frozen_here is not None:
            note = "; ends it (SIGKILL)"
        if reporter and self.settings.fault_file and fault.what != "error":
            failed = faults.append(self.settings.fault_file, fault)
            note += f"; not recorded: {failed}" if failed else "; recorded in DDPKIT_FAULT_FILE"
        what = fault.describe()
        if fault.rank == self.rank:  # a stopped rank that was let go on again (SIGCONT)
            what = f"this rank was found {fault.what} ({fault.detail})"
        self._write(
            f"ddpkit: {where} {what}, {told}: ending this rank (exit {code}) so the launcher "
            f"ends the step{note}"
        )
        self._beacon.send(f"F {fault.to_json()}\n")
        store_gone = fault.rank == 0 and fault.what == "dead" and self._store_is_rank0
        if reporter and not store_gone and self._store_error is None:
            self._publish(fault)
        self._store_stop.set()
        _flush_std(timeout=1.0)
        if frozen_here is not None:
            # Last: its death breaks this rank's collectives (and rank 0's, its store), and the
            # main thread's error must not end this process before the exit code below.
            with contextlib.suppress(OSError):
                os.kill(frozen_here, signal.SIGKILL)
        self._exit(code)

    def _frozen_here(self, fault: Fault) -> int | None:
        """The pid of a frozen rank on this machine, to SIGKILL: it cannot end itself, and a
        launcher may wait for it (torchrun gives SIGTERM 30 s, which a stopped process never
        sees). Only the very process it published (pid, start time, pid namespace); on another
        node, ending it is the launcher's."""
        if fault.what != "frozen" or fault.rank is None:
            return None
        link = self._links.get(fault.rank)
        if link is None or not link.same_process_here():
            return None
        return int(link.identity["pid"])

    def _publish(self, fault: Fault) -> None:
        """The fault key, for the ranks not connected to this one (they read it within an
        interval); given up after a second if the store hangs (its host is stopped)."""

        def put() -> None:
            with contextlib.suppress(Exception):
                self._store.set(self._key("fault"), fault.to_json())

        t = threading.Thread(target=put, name="ddpkit-publish", daemon=True)
        t.start()
        t.join(timeout=1.0)


# The watchdogs of this process. A forked child (a DataLoader worker) inherits their sockets:
# its copies are closed, or a dead parent's connections would stay open while the child lives.
_LIVE: weakref.WeakSet[Watchdog] = weakref.WeakSet()


_HELD: list[threading.Lock] = []  # the beacons' accept locks a fork in progress holds


def _before_fork() -> None:
    """Wait for an accept in progress on another thread: the connection it made exists in the
    fd table the child copies but is not yet in ``conns``, which the child closes -- it would
    stay open in the child, and a dead parent would look alive (seen: 1 fork in 6)."""
    for dog in list(_LIVE):
        lock = dog._beacon.accepting
        if lock.acquire(timeout=1.0):  # bounded: a fork must never hang on the watchdog
            _HELD.append(lock)


def _after_fork_in_parent() -> None:
    while _HELD:
        _HELD.pop().release()


def _forget_all_in_child() -> None:
    for dog in list(_LIVE):
        dog.forget_in_child()
    _LIVE.clear()
    _after_fork_in_parent()  # the copies of the locks, held: free, as in the parent


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_forget_all_in_child,
    )


def _select(socks: list[Any], timeout: float) -> list[Any]:
    live = [s for s in socks if s is not None and s.fileno() >= 0]
    if not live:
        time.sleep(timeout)
        return []
    try:
        readable, _, _ = select.select(live, [], [], timeout)
    except (OSError, ValueError):
        return []
    return readable
