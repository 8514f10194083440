"""The rendezvous: every rank reaches rank 0's store, in short waits that a stop signal can end.

torch's ``env://`` rendezvous waits inside C++ (rank 0's ``TCPStore`` for its workers, a worker's
connect loop for rank 0) for the whole rendezvous timeout, 300 s here: a Python signal handler
only runs once that call returns, so SIGTERM and Ctrl-C did nothing for five minutes. Here every
wait is a short Python loop: rank 0 starts its store without waiting for workers, a worker probes
the port with a plain socket before it connects, and every rank counts itself in at the store and
polls the count. Between two polls :class:`StopWatch` says whether a stop signal arrived or the
caller's ``abort()`` is true.

A port derived from a job id can be taken (another job on the node whose id maps to it, another
SLURM cluster on the host with the same job id, any program). Rank 0 then listens on the next of
:func:`ddpkit.env.fallback_ports` that is free and says so in one line; the other ranks cannot be
told where (the store is what would tell them), so they probe the same list in turn and take the
store whose ``ddpkit/token`` names their own job (cluster, job, step, restart, world size,
launcher): a store of another job, or anything else listening there, is skipped.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import Any

import torch.distributed as tdist

from ddpkit.env import DistInfo, fallback_ports
from ddpkit.errors import InitInterrupted, PeerError, first_line

POLL_S = 0.1  # between two arrival polls / connect probes: a signal ends the wait this fast
CONNECT_PROBE_S = 0.5
# A worker's look at a fallback port: a TCPStore client that must read our token within this.
# Against something that is not a TCPStore the client's constructor never returns, so each look
# runs in a daemon thread that is abandoned if it outlasts this.
TOKEN_PROBE_S = 3.0
TOKEN_RETRY_S = 10.0  # a port that held something else is looked at again after this
TOKEN_KEY = "ddpkit/token"
DEFAULT_STOP_SIGNALS = ("TERM", "INT")
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

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=max(self.seconds, 1.0))

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


@dataclass(slots=True)
class Joined:
    """The rendezvous' result: rank 0's store, the port it listens on, this rendezvous' key prefix
    (``ddpkit/<restart>/<n>``: a restarted torchrun generation or a second ``init()`` never reads
    stale keys) and each rank's arrival record (``me``, as given by each rank)."""

    store: tdist.Store
    port: int
    prefix: str

    def record(self, rank: int) -> str:
        return bytes(self.store.get(f"{self.prefix}/arrived/{rank}")).decode()


def rendezvous(
    info: DistInfo,
    seconds: float,
    watch: StopWatch,
    *,
    me: str = "1",
    env: Mapping[str, str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Joined:
    """rank 0's store once every rank has reached it (its timeout is still ``seconds``).

    ``me`` is this rank's arrival record (any text; the watchdog's address). Raises
    :class:`PeerError` when ``seconds`` pass first (naming the ranks that never came) and
    :class:`InitInterrupted` as soon as ``watch`` reports a signal or ``abort()``.
    """
    env = os.environ if env is None else env
    wait = _Wait(info, seconds, watch, clock, sleep, start=clock())
    store, port = _open_store(wait, job_token(info, env))
    prefix = f"ddpkit/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_generation)}"
    key = f"{prefix}/arrived"
    store.set(f"{key}/{info.rank}", me)
    count = store.add(key, 1)
    while count < info.world_size:
        wait.tick(lambda: _missing(store, key, info.world_size))
        count = store.add(key, 0)
    return Joined(store, port, prefix)


def job_token(info: DistInfo, env: Mapping[str, str]) -> str:
    """What tells this job's store from another job's on the same port: two SLURM clusters on one
    host both have a job 1, so the cluster's name is in it, and the restart count."""
    parts = (
        env.get("SLURM_CLUSTER_NAME", ""),
        info.job_id or "",
        env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")),
        env.get("SLURM_RESTART_COUNT", ""),
        info.launcher,
        str(info.world_size),
        info.master_source,
    )
    return "|".join(parts)


def _open_store(wait: _Wait, token: str) -> tuple[tdist.Store, int]:
    info = wait.info
    # torchrun's agent hosts the store (every worker is a client); otherwise rank 0 does.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    ports = fallback_ports(info.master_port) if info.derived_port and not agent else []
    if info.rank == 0 and not agent:
        return _listen(wait, ports or [info.master_port], token)
    if len(ports) > 1:
        return _find(wait, ports, token)
    while not _accepts(info.master_addr, info.master_port, min(CONNECT_PROBE_S, wait.left())):
        wait.tick(lambda: f"nothing listens at {wait.where} yet (rank 0's store)")
    try:
        client = tdist.TCPStore(
            info.master_addr, info.master_port, info.world_size, False, wait.timeout
        )
    except (RuntimeError, ValueError) as e:
        raise wait.failed(first_line(e)) from e
    return client, info.master_port


def _listen(wait: _Wait, ports: list[int], token: str) -> tuple[tdist.Store, int]:
    """rank 0's store on the first of ``ports`` that is free (a line on stderr if not the first)."""
    info, taken = wait.info, []
    for port in ports:
        try:
            store = tdist.TCPStore(
                info.master_addr,
                port,
                info.world_size,
                True,
                wait.timeout,
                wait_for_workers=False,  # counted below, in waits a signal can end
                multi_tenant=True,
            )
        except (RuntimeError, ValueError) as e:
            if len(ports) > 1 and "EADDRINUSE" in str(e):
                taken.append(port)
                continue
            raise wait.failed(first_line(e)) from e
        store.set(TOKEN_KEY, token)
        if taken:
            print(
                f"ddpkit: port {taken[0]} ({info.master_source}) is in use on "
                f"{socket.gethostname()}; rank 0 listens on {port} instead and the other ranks "
                "find it there (export MASTER_PORT=<a free port> to choose one)",
                file=sys.stderr,
                flush=True,
            )
        return store, port
    raise wait.failed(
        f"ports {', '.join(map(str, taken))} (derived from the job id, and its fallbacks) are all "
        "in use on this host"
    )


def _find(wait: _Wait, ports: list[int], token: str) -> tuple[tdist.Store, int]:
    """A worker's search for rank 0's store among ``ports``: the one holding our token."""
    looks: dict[int, _Look] = {}
    while True:
        for port in ports:
            look = looks.get(port)
            if look is not None and look.store is not None:
                look.store.set_timeout(wait.timeout)
                return look.store, port
            if look is not None and not look.may_retry(wait.clock()):
                continue
            if _accepts(wait.info.master_addr, port, min(CONNECT_PROBE_S, max(wait.left(), 0))):
                looks[port] = _Look(wait.info, port, token, wait.clock()).start()
        wait.tick(
            lambda: (
                f"no store of this job at {wait.info.master_addr} ports "
                f"{', '.join(map(str, ports))} yet (rank 0's store)"
            )
        )


@dataclass(slots=True)
class _Look:
    """One look at a port, in a daemon thread: is this rank 0's store of our job?"""

    info: DistInfo
    port: int
    token: str
    started: float
    store: tdist.Store | None = None
    done: bool = False
    thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> _Look:
        self.thread = threading.Thread(target=self._run, name="ddpkit-store-look", daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            client = tdist.TCPStore(
                self.info.master_addr,
                self.port,
                self.info.world_size,
                False,
                timedelta(seconds=TOKEN_PROBE_S),
            )
            if bytes(client.get(TOKEN_KEY)).decode() == self.token:
                self.store = client
        except Exception:  # not a store, or not ours: look again later
            pass
        finally:
            self.done = True

    def may_retry(self, now: float) -> bool:
        return self.done and self.store is None and now - self.started > TOKEN_RETRY_S


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
