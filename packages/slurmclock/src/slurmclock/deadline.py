"""When does this job end? Deadline discovery from overrides, the environment and SLURM.

Sources, first answer wins (the name is :attr:`Deadline.source`):

1. ``"override"`` -- an ``end_time=`` argument (epoch seconds or ISO-8601);
2. ``"PYRECOVER_END_TIME"`` -- that environment variable (epoch seconds or ISO-8601);
3. ``"time-limit"`` -- a ``time_limit=`` argument, counted from ``started_at`` (the start of this
   process by default);
4. ``"SLURM_JOB_END_TIME"`` -- set by newer SLURM versions (not 22.05); it is fixed at job start,
   so it only answers the first poll (no subprocess at start-up) and later polls ask squeue;
5. ``"squeue"`` -- ``squeue -h -j $SLURM_JOB_ID -o "%e %l"`` (end time in the controller's local
   time, and the time limit, to tell "no limit" from "unknown");
6. ``"scontrol"`` -- ``EndTime=`` of ``scontrol show job $SLURM_JOB_ID``;
7. ``"none"`` -- no deadline: outside SLURM without an override, or nothing usable.

A job without a time limit (``UNLIMITED``; 22.05 gives it a limit of 365 days) has
``end=None`` with the source that said so. Anything malformed -- an environment value, a command's
output, a missing binary, an end time implausibly far in the past (clock skew) -- is logged as a
warning on the ``slurmclock`` logger and the next source is tried; nothing here raises during
training. Only bad *arguments* raise ``ValueError``, at construction.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone

from slurmclock.commands import CommandError, Runner
from slurmclock.durations import check_seconds, parse_duration, parse_time, parse_time_limit
from slurmclock.job import Scheduler, is_leader, variables
from slurmclock.job import job_id as _job_id
from slurmclock.schedulers import default_scheduler

__all__ = [
    "SOURCES",
    "Deadline",
    "DeadlineWatcher",
    "find_deadline",
    "parse_duration",
    "parse_time",
    "process_start_time",
    "watches_the_clock",
]

log = logging.getLogger("slurmclock")

SOURCES = (
    "override",
    "PYRECOVER_END_TIME",
    "time-limit",
    "SLURM_JOB_END_TIME",
    "squeue",
    "scontrol",
    "none",
)
# What squeue/scontrol print instead of a time when there is none (yet).
_NO_TIME = {"", "unknown", "none", "n/a", "unlimited", "infinite", "invalid", "(null)"}
# SLURM 22.05 gives a job without a limit TimeLimit=365-00:00:00 and EndTime one year out.
NO_LIMIT_SECONDS = 365 * 86400
# How often SLURM is asked: the rank that watches the clock every 5 s (a shortened time limit
# is acted on in time), the others every minute; a poll that took t s waits >= 20 t after it;
# failing polls double the wait, up to 300 s.
CLOCK_RANK_POLL = 5.0
OTHER_RANK_POLL = 60.0
SLOW_FACTOR = 20.0
MAX_BACKOFF = 300.0
REFRESH_WAIT = 2.0  # seconds refresh() waits for the background thread's answer


@dataclass(frozen=True, slots=True)
class Deadline:
    """The end of the job as epoch seconds (None: no deadline), and who said so."""

    end: float | None
    source: str
    job_id: str | None = None

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds until ``end`` (negative once past); None without a deadline."""
        if self.end is None:
            return None
        return self.end - (time.time() if now is None else now)

    def iso(self) -> str | None:
        """``end`` as local-time ISO-8601 with UTC offset, e.g. ``2026-11-22T10:41:07+01:00``."""
        if self.end is None:
            return None
        try:
            when = datetime.fromtimestamp(self.end, tz=timezone.utc).astimezone()
        except (OverflowError, ValueError, OSError):  # built by hand beyond what parse_time takes
            return f"@{self.end:.0f}"
        return when.isoformat("T", "seconds")

    def __str__(self) -> str:
        job = f" (job {self.job_id})" if self.job_id else ""
        if self.end is None:
            return f"no deadline [{self.source}]{job}"
        return f"{self.iso()} [{self.source}]{job}"


_STARTED: dict[int, float] = {}  # pid -> start: computed once (a forked child has its own)


def process_start_time() -> float:
    """When this process started (epoch seconds), from /proc; now where /proc is absent."""
    pid = os.getpid()
    if pid not in _STARTED:
        _STARTED[pid] = _process_start_time()
    return _STARTED[pid]


def _process_start_time() -> float:
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks after boot); the name in (...) may hold spaces.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_boot = ticks / os.sysconf("SC_CLK_TCK")
        if hasattr(time, "CLOCK_BOOTTIME"):
            # The process's age on the clock its start is counted on: exact to a tick, where
            # /proc/stat's btime has whole seconds (up to 1 s off).
            return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + since_boot
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class DeadlineWatcher:
    """Finds the job's deadline and keeps it fresh: SLURM is re-read every few seconds.

    ``get()`` is cheap enough to call every training step: it returns the last answer. A
    ``scontrol update TimeLimit=`` (shortened or extended) is seen within ``poll_interval``
    seconds plus one ``squeue``: by default 5 s on the rank that watches the clock (the job's
    leader: ``rank`` 0 when given, else :func:`slurmclock.job.is_leader`) and 60 s on the other
    ranks, which the "any rank stops" agreement overrules anyway.

    With the real clock (no ``clock=``) the polls run on a background thread (``background``),
    so a training step never waits for the controller, not even when it hangs. An injected
    clock polls inside ``get()``, deterministically. A slow SLURM is asked less often: after a
    poll that took ``t`` seconds the next waits at least ``20 t`` (at most 5 % of the time in
    squeue), and failed polls back off by doubling, up to 300 s; the last good deadline is kept
    meanwhile. :meth:`refresh` polls at once (on a warning signal: news from SLURM).

    ``end_time`` / ``time_limit`` override SLURM (see the module docstring for the order; a
    ``time_limit`` number is seconds, a string a SLURM time string or ``30s``-style duration:
    :func:`slurmclock.parse_time_limit`); ``env`` replaces ``os.environ``; ``scheduler`` is
    asked for the end time (default: :class:`slurmclock.slurm.Slurm` running squeue/scontrol
    through ``runner``, :mod:`slurmclock.commands`); ``clock`` returns epoch seconds.
    ``command_timeout`` bounds each squeue/scontrol call; an end time more than
    ``skew_tolerance`` seconds in the past is treated as clock skew.

    Args:
        end_time: The deadline as epoch seconds or a time string
            (:func:`slurmclock.parse_time`), instead of SLURM's.
        time_limit: The time limit (seconds, a SLURM time string or ``30s``), counted from
            ``started_at``.
        started_at: Epoch seconds the ``time_limit`` counts from (default: this process's
            start).
        poll_interval: Seconds between polls of SLURM, >= 1 (default 5 s on the leader, 60 s
            on the other ranks).
        env: Replaces ``os.environ``.
        runner: Runs squeue/scontrol (:mod:`slurmclock.commands`).
        clock: Epoch seconds (injected: polls run inside :meth:`get`).
        command_timeout: Bounds each squeue/scontrol call, in seconds.
        skew_tolerance: An end time this many seconds in the past is clock skew.
        background: Poll on a background thread (default: with the real clock).
        scheduler: Asked for the end time (default :class:`slurmclock.slurm.Slurm`).
        rank: This process's rank (0 watches the clock; default: from the environment).
    """

    def __init__(
        self,
        *,
        end_time: float | str | None = None,
        time_limit: float | str | None = None,
        started_at: float | None = None,
        poll_interval: float | None = None,
        env: Mapping[str, str] | None = None,
        runner: Runner | None = None,
        clock: Callable[[], float] | None = None,
        command_timeout: float = 10.0,
        skew_tolerance: float = 300.0,
        background: bool | None = None,
        scheduler: Scheduler | None = None,
        rank: int | None = None,
    ) -> None:
        self._env: Mapping[str, str] = os.environ if env is None else env
        if poll_interval is None:
            leads = is_leader(rank, env=self._env)
            poll_interval = CLOCK_RANK_POLL if leads else OTHER_RANK_POLL
        if not check_seconds("poll_interval", poll_interval) >= 1.0:
            raise ValueError(
                f"poll_interval must be >= 1 s (the SLURM controller is shared; polling it every "
                f"step loads it), got {poll_interval!r}"
            )
        self.poll_interval = float(poll_interval)
        self.command_timeout = check_seconds("command_timeout", command_timeout, positive=True)
        self.skew_tolerance = check_seconds("skew_tolerance", skew_tolerance)
        if started_at is not None:
            check_seconds("started_at", started_at)
        if scheduler is not None and runner is not None:
            raise TypeError("give a scheduler or a runner for SLURM's commands, not both")
        self._scheduler = default_scheduler(runner, env=env) if scheduler is None else scheduler
        self._clock = time.time if clock is None else clock
        self.background = clock is None if background is None else bool(background)
        self.job_id = _job_id(self._env)
        self.polls = 0  # SLURM polls done (each runs squeue, maybe scontrol)
        self.last_poll_seconds: float | None = None  # how long the last poll took
        self._interval = self.poll_interval  # until the next poll; grows when SLURM is slow
        self._failures = 0
        self._warned: set[str] = set()
        self._cached: Deadline | None = None
        self._polled_at: float | None = None
        self._poller = _Poller(self)
        self._static = self._static_deadline(end_time, time_limit, started_at)

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    def __getstate__(self) -> dict[str, object]:
        # A copy (deepcopy, pickle: trainers copy callbacks) gets its own thread and lock.
        state = self.__dict__.copy()
        del state["_poller"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._poller = _Poller(self)

    @property
    def next_poll_in(self) -> float:
        """Seconds from the last poll to the next one (``poll_interval``, or more: back-off)."""
        return self._interval

    def _warn(self, key: str, message: str) -> None:
        # Once per kind of problem: a broken squeue must not print a line every poll.
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    def _static_deadline(
        self, end_time: float | str | None, time_limit: float | str | None, started_at: float | None
    ) -> Deadline | None:
        if end_time is not None and time_limit is not None:
            raise ValueError(
                f"end_time={end_time!r} and time_limit={time_limit!r} both set the deadline; "
                "give one of them"
            )
        if end_time is not None:
            try:
                return Deadline(parse_time(end_time), "override", self.job_id)
            except ValueError as e:
                raise ValueError(f"end_time: {e}") from None
        raw = self._env.get("PYRECOVER_END_TIME", "").strip()
        if raw:
            try:
                return Deadline(parse_time(raw), "PYRECOVER_END_TIME", self.job_id)
            except ValueError as e:
                self._warn(
                    "env",
                    f"ignoring PYRECOVER_END_TIME={raw[:60]!r}: {e}; asking SLURM for the end time",
                )
        if time_limit is not None:
            try:
                limit = parse_time_limit(time_limit)
            except ValueError as e:
                raise ValueError(f"time_limit: {e}") from None
            if math.isinf(limit):
                return Deadline(None, "time-limit", self.job_id)  # 0 / UNLIMITED: no limit
            if started_at is None:
                # A fake clock has its own epoch: count from its now, not from /proc.
                started_at = process_start_time() if self._clock is time.time else self._clock()
            return Deadline(started_at + limit, "time-limit", self.job_id)
        return None

    def get(self) -> Deadline:
        """The current deadline. Polls in here only without a background thread, when due."""
        if self._static is not None:
            return self._static
        cached = self._cached
        if cached is None:
            return self.refresh()  # the first answer: before the first step
        if self.background:
            if self.job_id is not None:
                self._poller.ensure_running()
            return cached
        now = self._clock()
        if self._polled_at is not None and 0 <= now - self._polled_at < self._interval:
            return cached  # (a clock that went back polls at once)
        return self.refresh(now)

    def seconds_left(self) -> float | None:
        """Seconds until the deadline (negative once past); None without one."""
        return self.get().seconds_left(self._clock())

    def refresh(
        self, now: float | None = None, *, force: bool = True, wait: float = REFRESH_WAIT
    ) -> Deadline:
        """Ask SLURM now (``force=False``: only when a poll is due); the current deadline.

        Call it when there is news from SLURM, e.g. on its warning signal (not inside the signal
        handler). With the background thread running, the thread asks and this waits at most
        ``wait`` seconds for its answer (a hung controller does not hold the step; the answer
        arrives with a later ``get()``); otherwise the poll runs here.
        """
        if self._static is not None:
            return self._static
        if self.background and now is None and self._cached is not None and self._poller.alive:
            self._poller.request(force=force, wait=wait)
            return self._cached
        return self._refresh_here(now, force=force)

    def _refresh_here(self, now: float | None, *, force: bool) -> Deadline:
        with self._poller.lock:  # one poll at a time (the thread's, or this one)
            now = self._clock() if now is None else now
            polled = self._polled_at
            fresh = polled is not None and 0 <= now - polled < self._interval
            if not force and fresh and self._cached is not None:
                return self._cached
            return self._poll(now)

    def close(self) -> None:
        """Stop the background thread (it also ends with the watcher or the process); get()
        then polls inline again, when due."""
        self.background = False
        self._poller.stop()

    def _poll(self, now: float) -> Deadline:
        previous, self._polled_at = self._cached, now
        if self.job_id is None:
            self._cached = Deadline(None, "none", None)
            return self._cached
        found = self._from_slurm(self.job_id, now, first=previous is None)
        took = max(0.0, self._clock() - now)
        self._schedule(took, ok=found is not None)
        if found is None:
            if previous is not None and previous.source != "none":
                self._warn(
                    "keep", f"keeping the last known deadline {previous} until SLURM answers"
                )
                return previous
            found = Deadline(None, "none", self.job_id)
        self._announce(previous, found)
        self._cached = found
        return found

    def _schedule(self, took: float, *, ok: bool) -> None:
        """When to poll next: a slow or failing SLURM is asked less often."""
        self.last_poll_seconds = took
        if ok:
            self._failures = 0
            slow = min(SLOW_FACTOR * took, max(self.poll_interval, OTHER_RANK_POLL))
            self._interval = max(self.poll_interval, slow)
        else:
            self._failures += 1
            backoff = self.poll_interval * 2.0 ** min(self._failures, 10)
            self._interval = min(backoff, max(self.poll_interval, MAX_BACKOFF))

    def _announce(self, previous: Deadline | None, found: Deadline) -> None:
        if previous is None or previous.end == found.end:
            return
        if previous.end is not None and (found.end is None or found.end > previous.end):
            log.info("deadline of job %s moved later: %s -> %s", self.job_id, previous, found)
        elif previous.end is not None and found.end is not None:
            log.warning(
                "deadline of job %s moved %.0f s earlier: %s -> %s (time limit shortened?)",
                self.job_id,
                previous.end - found.end,
                previous,
                found,
            )
        else:
            log.info("deadline of job %s: %s -> %s", self.job_id, previous, found)

    def _from_slurm(self, job: str, now: float, *, first: bool) -> Deadline | None:
        # SLURM_JOB_END_TIME answers the first poll without a subprocess; it never changes, so
        # later polls ask the controller (refresh() keeps the last answer when it is silent).
        self.polls += 1
        if first and (found := self._env_end(job, now)) is not None:
            return found
        for thorough in (False, True):  # the quick query, then the job's full record
            if (found := self._ask(job, now, thorough=thorough)) is not None:
                return found
        return None

    def _env_end(self, job: str, now: float) -> Deadline | None:
        name = variables(self._env).end_time
        raw = self._env.get(name, "").strip()
        if not raw:
            return None
        try:
            end = parse_time(raw)
        except ValueError as e:
            self._warn(name, f"ignoring {name}: {e}")
            return None
        return self._plausible(Deadline(end, name, job), now)

    def _ask(self, job: str, now: float, *, thorough: bool) -> Deadline | None:
        try:
            said = self._scheduler.end_time(job, thorough=thorough, timeout=self.command_timeout)
        except CommandError as e:
            source = e.argv[0] if e.argv else self._scheduler.name
            self._warn(f"{source}:{e.kind}", _failure(source, job, e))
            return None
        return self._interpret(said.source, job, said.end, said.limit, now)

    def _interpret(
        self, source: str, job: str, end_text: str, limit: float | None, now: float
    ) -> Deadline | None:
        if limit is not None and limit >= NO_LIMIT_SECONDS:
            return Deadline(None, source, job)  # SLURM says: no time limit
        if end_text.strip().lower() in _NO_TIME:
            self._warn(
                f"{source}:noend",
                f"{source} gives job {job} no end time ({end_text.strip() or 'empty'!r}); "
                "is it still pending?",
            )
            return None
        try:
            end = parse_time(end_text)
        except ValueError as e:
            self._warn(f"{source}:parse", f"cannot read {source}'s end time for job {job}: {e}")
            return None
        return self._plausible(Deadline(end, source, job), now)

    def _plausible(self, found: Deadline, now: float) -> Deadline | None:
        ago = now - (found.end or now)
        if ago > self.skew_tolerance:
            self._warn(
                f"{found.source}:skew",
                f"{found.source} says job {found.job_id} ended at {found.iso()}, {ago:.0f} s "
                "ago by this machine's clock: clock skew between this node and the controller, "
                "or a stale job id; ignoring it",
            )
            return None
        return found


class _Poller:
    """A watcher's background thread: polls when due or asked; ends with the watcher, close()
    or a fork. The thread holds the watcher only weakly, so a dropped watcher stops polling."""

    def __init__(self, watcher: DeadlineWatcher) -> None:
        self._ref = weakref.ref(watcher)
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._wake = threading.Event()  # stop(), or request(): look at the flags now
        self._turn = threading.Condition()  # guards the request counters below
        self._asked = 0  # requests made
        self._answered = 0  # requests whose poll (started after them) is done
        self._thread: threading.Thread | None = None
        self.forced = False  # request(force=True) pending
        self.stopped = False

    def _forked(self) -> None:
        if os.getpid() != self._pid:  # a forked child: the parent's thread and locks stay there
            self._reset()

    @property
    def lock(self) -> threading.Lock:
        self._forked()
        return self._lock

    @property
    def alive(self) -> bool:
        self._forked()
        return self._thread is not None and self._thread.is_alive() and not self.stopped

    def ensure_running(self) -> None:
        if self.stopped or self.alive:
            return
        self._thread = threading.Thread(
            target=_poll_loop, args=(self._ref,), name="slurmclock-deadline", daemon=True
        )
        self._thread.start()

    def request(self, *, force: bool, wait: float) -> None:
        """Have the thread poll now (force) or when due; wait up to ``wait`` s for a poll that
        started after this request."""
        with self._turn:
            self._asked += 1
            mine = self._asked
            self.forced = self.forced or force
        self._wake.set()
        with self._turn:
            self._turn.wait_for(lambda: self._answered >= mine or self.stopped, timeout=wait)

    def take(self) -> tuple[bool, int]:
        """The thread, before a poll: (forced?, the requests this poll answers)."""
        with self._turn:
            force, self.forced = self.forced, False
            return force, self._asked

    def answered(self, upto: int) -> None:
        with self._turn:
            self._answered = max(self._answered, upto)
            self._turn.notify_all()

    def stop(self) -> None:
        self.stopped = True
        self._wake.set()
        with self._turn:
            self._turn.notify_all()


def _poll_loop(ref: weakref.ref[DeadlineWatcher]) -> None:
    pid = os.getpid()
    while True:
        watcher = ref()
        if watcher is None or watcher._poller.stopped or os.getpid() != pid:
            return
        poller = watcher._poller
        polled = watcher._polled_at
        due = 0.0 if polled is None else polled + watcher.next_poll_in - watcher.clock()
        del watcher  # not kept alive by this thread while it sleeps
        if poller._wake.wait(min(max(due, 0.05), MAX_BACKOFF)):
            poller._wake.clear()
        watcher = ref()
        if watcher is None or poller.stopped:
            return
        force, upto = poller.take()
        try:
            watcher._refresh_here(None, force=force)
        except Exception as e:  # a custom runner's bug must not kill the thread silently
            watcher._warn("poller", f"deadline poll failed: {type(e).__name__}: {e}")
        finally:
            poller.answered(upto)
        del watcher


def _failure(source: str, job: str, e: CommandError) -> str:
    """One line for a scheduler that did not answer (an unreadable answer says it itself)."""
    if e.kind in ("output", "error"):
        return str(e)
    hint = " (inside a container without SLURM's commands?)" if e.kind == "missing" else ""
    return f"{source} failed for job {job}: {e}{hint}"


def watches_the_clock(env: Mapping[str, str] | None = None) -> bool:
    """Is this the process that watches the job's clock? The job's leader:
    :func:`slurmclock.job.is_leader` (global rank 0, or not one of several)."""
    return is_leader(env=env)


def find_deadline(
    *,
    end_time: float | str | None = None,
    time_limit: float | str | None = None,
    started_at: float | None = None,
    env: Mapping[str, str] | None = None,
    runner: Runner | None = None,
    clock: Callable[[], float] | None = None,
    command_timeout: float = 10.0,
    skew_tolerance: float = 300.0,
    scheduler: Scheduler | None = None,
) -> Deadline:
    """One look at the deadline (see :class:`DeadlineWatcher` for the arguments)."""
    return DeadlineWatcher(
        end_time=end_time,
        time_limit=time_limit,
        started_at=started_at,
        env=env,
        runner=runner,
        clock=clock,
        command_timeout=command_timeout,
        skew_tolerance=skew_tolerance,
        scheduler=scheduler,
    ).get()
