"""One job's timeline: timestamps written by the trainer and the batch script, read next time.

What a run needs after its final save is durable -- process exit, ``srun`` teardown, the batch
script's ``scontrol requeue`` -- happens after the last moment the trainer can write anything
into its checkpoint. So both write a line to a small per-job file instead, and the next
allocation of the same job (``SLURM_JOB_ID`` stays the same across requeues) reads it:

==============  ===================================================================================
event           written by, with which details
==============  ===================================================================================
``start``       the batch script or ``slurmclock supervise``, first thing: ``chain``, ``link``,
                ``previous`` (the run's chain of jobs: :mod:`slurmclock.chain`)
``signal``      the batch script / supervisor when a signal arrives: ``name`` (TERM, USR2),
                ``kind`` (what a TERM meant: stop, limit, preempted, requeued, cancelled),
                ``forwarded`` (0: a USR2 that agreed with the known end time)
``saved``       the trainer when its final save is durable (``TimeBudget.record_save(final=True)``):
                ``seconds``; after an extra save also ``extra``, or ``abandoned`` (its step)
``exited``      the batch script / supervisor when the training step has exited: ``rc``
``requeued``    ``slurmclock requeue`` / :func:`slurmclock.requeue` once SLURM accepted it:
                ``confirmed`` (false: scontrol was killed before it answered)
``checkpoint``  the trainer whenever a checkpoint is durable: ``step`` (``record_save(step=)``)
``failed``      ``slurmclock supervise`` when the step failed: ``rc``, ``step`` (newest checkpoint),
                ``why``, ``nodes``
``gave_up``     ``slurmclock supervise`` when it stopped the chain: ``why`` (the line it logged)
``first_step``  the trainer (``TimeLoop``) when its first step is done: ``step``, ``seconds``
``fault``       ``slurmclock supervise`` when it read a rank's fault record (ddpkit's) while the
                step ran: ``node``, ``rank``, ``what``, ``reporter``, ``reported`` (its time)
``relaunched``  ``slurmclock supervise`` when it starts the step again in the allocation:
                ``attempt`` (the launch), ``nodes`` (where it placed it; empty: as launched)
==============  ===================================================================================

Every line also has ``event``, ``time`` (epoch seconds), ``restart`` (the run:
``SLURM_RESTART_COUNT``), ``host`` and ``pid`` (:data:`~slurmclock.job.RESERVED_KEYS`); the
names are :data:`~slurmclock.job.EVENTS`. Only the job's leader writes
(:func:`slurmclock.job.is_leader`).

The file is ``$SLURMCLOCK_DIR/CLUSTER-JOBID.jsonl`` (default directory
``$XDG_CACHE_HOME/slurmclock`` or ``~/.cache/slurmclock``: it must be on a file system every node
of the job sees, as ``$HOME`` usually is). One JSON object per line, appended; a line that does
not parse is skipped and counted (:attr:`JobTimeline.unreadable`, one warning naming the file
and the lines). Writing never raises: a timeline is a measurement, not a reason to fail. The job
id and ``SLURM_CLUSTER_NAME`` in the file name are checked first: nothing escapes the directory.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import socket
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from slurmclock.commands import CommandError
from slurmclock.durations import check_seconds
from slurmclock.job import (
    EVENTS,
    RESERVED_KEYS,
    JobFacts,
    Scheduler,
    _warn_once,
    check_job_id,
    cluster_name,
    global_rank,
    is_cluster_name,
    is_leader,
    restart_count,
)
from slurmclock.job import job_id as _job_id
from slurmclock.untrusted import NotRegularFile, parse_record, read_records

__all__ = ["EVENTS", "Event", "ExitSample", "JobTimeline", "find_timeline", "timeline_dir"]

log = logging.getLogger("slurmclock")
_APPEND = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def timeline_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$SLURMCLOCK_DIR``, else ``$XDG_CACHE_HOME/slurmclock``, else ``~/.cache/slurmclock``."""
    e = os.environ if env is None else env
    if e.get("SLURMCLOCK_DIR", "").strip():
        return Path(e["SLURMCLOCK_DIR"].strip()).expanduser()
    cache = e.get("XDG_CACHE_HOME", "").strip() or str(Path(e.get("HOME", "~")) / ".cache")
    return Path(cache).expanduser() / "slurmclock"


@dataclass(frozen=True, slots=True)
class Event:
    """One line of the timeline."""

    name: str
    time: float
    restart: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ExitSample:
    """What one run of the job needed after its final save: ``seconds`` until SLURM accepted
    the requeue (or, without a requeue, until the training step had exited); ``exit_s`` is the
    part until the step had exited, None when the script did not mark it."""

    job: str
    restart: int
    seconds: float
    exit_s: float | None = None


class JobTimeline:
    """The timeline file of one job (default: this one, ``$SLURM_JOB_ID``).

    ``job_id``: a job id (restart count, cluster and rank still from ``env``), or a job's
    :class:`~slurmclock.job.JobFacts` (:func:`find_timeline` for a job this process is not
    in). ``path`` is None outside a SLURM job: :meth:`mark` then does nothing and
    :meth:`events` is empty. Only the job's leader writes (``rank`` 0 when given, else
    :func:`slurmclock.job.is_leader`; a batch script leads), so every rank may hold one.
    ``clock`` gives epoch seconds (injectable for tests).
    """

    def __init__(
        self,
        job_id: str | JobFacts | None = None,
        *,
        directory: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] | None = None,
        rank: int | None = None,
    ) -> None:
        e = os.environ if env is None else env
        facts = job_id if isinstance(job_id, JobFacts) else _facts(job_id, e)
        self.job_id = facts.job_id
        self.restart = facts.restart or 0
        self.directory = Path(directory) if directory is not None else timeline_dir(e)
        # Checked here too: a JobFacts built by hand must not lead the file out of its folder.
        cluster = facts.cluster if facts.cluster and is_cluster_name(facts.cluster) else None
        self.cluster = cluster  # the file's (None: ``job-JOBID.jsonl``)
        self._name = f"{cluster}-{self.job_id}" if cluster else f"job-{self.job_id}"
        self.unreadable: list[int] = []  # line numbers the last events() could not read
        self.read_error: str | None = None  # why the last events() could not read the file
        self.writer = is_leader(facts.rank if rank is None else rank)
        self._clock = time.time if clock is None else clock
        self._warned = False

    @property
    def path(self) -> Path | None:
        return None if self.job_id is None else self.directory / f"{self._name}.jsonl"

    def mark(self, event: str, *, at: float | None = None, **info: Any) -> bool:
        """Append ``event`` (one of :data:`EVENTS`) with the time and ``info``; True if written.

        Never raises on I/O: an unwritable directory logs one warning.
        """
        if event not in EVENTS:
            raise ValueError(f"unknown timeline event {event!r}: use one of {', '.join(EVENTS)}")
        reserved = [key for key in RESERVED_KEYS if key in info]
        if reserved:
            raise ValueError(
                f"{', '.join(reserved)}: reserved in a timeline line ({', '.join(RESERVED_KEYS)} "
                "are set by the timeline itself); name the detail otherwise"
            )
        if at is not None:
            check_seconds("at", at)
        path = self.path
        if path is None or not self.writer:
            return False
        record = {
            "event": event,
            "time": round(self._clock() if at is None else at, 3),
            "restart": self.restart,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            **info,
        }
        line = (json.dumps(record, default=str) + "\n").encode()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, _APPEND, 0o644)  # O_NONBLOCK: a FIFO there never waits
            try:
                size = os.fstat(fd).st_size
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    line = b"\n" + line  # a torn last line must not swallow this one
                os.write(fd, line)  # one write with O_APPEND: lines never interleave
            finally:
                os.close(fd)
        except OSError as e:
            # mkdir of a path that is a file says "File exists": say what is wrong instead.
            reason = "Not a directory" if e.errno == errno.EEXIST else (e.strerror or str(e))
            self._warn(
                f"cannot write the job timeline {path}: {reason}; going on without it "
                "(set SLURMCLOCK_DIR to a writable folder every node of the job sees)"
            )
            return False
        return True

    def events(self) -> list[Event]:
        """Every readable line, in file order (of its newest 8 MiB when it is larger). The file
        is untrusted input (:mod:`slurmclock.untrusted`): a line that is not an event is skipped
        and counted; a path that is not a regular file (a FIFO, a device) is not read."""
        path = self.path
        if path is None:
            return []
        found = read_records(path)
        self.read_error = found.error
        if found.error is not None:
            self._warn(f"cannot read the job timeline {path}: {found.error}")
            return []
        events, self.unreadable = [], list(found.skipped)
        for number, record in zip(found.lines, found.records, strict=True):
            event = _event(record)
            if event is not None:
                events.append(event)
            else:
                self.unreadable.append(number)
        if self.unreadable:
            self.unreadable.sort()
            _warn_once(
                f"skipped {_lines(self.unreadable)} of the job timeline {path} "
                "that are not timeline events (damaged, too long or deep, or written by "
                "something else)"
            )
        return events

    def exit_samples(self, events: Sequence[Event] | None = None) -> list[ExitSample]:
        """Per finished run: the time from its last ``saved`` to ``requeued`` (else ``exited``).

        The run in progress has no end mark yet, so it gives no sample. ``events``: the
        timeline's, when already read (default: read now).
        """
        by_run: dict[int, dict[str, float]] = {}
        for ev in self.events() if events is None else events:
            marks = by_run.setdefault(ev.restart, {})
            if ev.name == "saved":
                marks.clear()  # a later save restarts the measurement
            marks[ev.name] = ev.time
        samples = []
        for restart, marks in sorted(by_run.items()):
            saved, end = marks.get("saved"), marks.get("requeued", marks.get("exited"))
            if saved is None or end is None or end < saved:
                continue
            exited = marks.get("exited")
            part = None if exited is None or exited < saved else exited - saved
            samples.append(ExitSample(str(self.job_id), restart, end - saved, part))
        return samples

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s", message)


def _parse(line: str | bytes) -> Event | None:
    record = parse_record(line)
    return None if record is None else _event(record)


def _event(record: dict[str, Any]) -> Event | None:
    try:
        name, at, restart = record.pop("event"), float(record.pop("time")), record.pop("restart")
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
        return None
    if not isinstance(name, str) or not isinstance(restart, int) or isinstance(restart, bool):
        return None
    if not math.isfinite(at) or at < 0 or restart < 0:  # NaN, Infinity: json takes them
        return None
    return Event(name, at, restart, record)


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")
    return f"{len(numbers)} line{'s' if len(numbers) > 1 else ''} ({shown})"


def _facts(job: str | None, env: Mapping[str, str]) -> JobFacts:
    """The facts a timeline needs from this process's environment (a given id checked)."""
    return JobFacts(
        job_id=check_job_id(job, "job_id") if job is not None else _job_id(env),
        restart=restart_count(env),
        cluster=cluster_name(env),
        rank=global_rank(env),
    )


def find_timeline(
    job: JobFacts,
    *,
    directory: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    clock: Callable[[], float] | None = None,
    scheduler: Scheduler | None = None,
) -> JobTimeline:
    """The timeline of ``job`` (:func:`slurmclock.job.job_facts`), found from anywhere: a login
    shell has no ``SLURM_CLUSTER_NAME``. Its file is ``CLUSTER-JOBID.jsonl``, the cluster
    ``job.cluster``, else the one file of that job id in the folder, else (several) the
    scheduler's cluster name; ``job-JOBID.jsonl`` is a job that ran without a cluster name.
    Several files and no cluster to choose by: a ValueError naming them and the fix."""
    e = os.environ if env is None else env
    folder = Path(directory) if directory is not None else timeline_dir(e)
    found = _files_of(folder, str(job.job_id))
    cluster = job.cluster
    if cluster is None and len(found) > 1 and scheduler is not None:
        try:
            named = scheduler.cluster_name()
            cluster = named if is_cluster_name(named) else None
        except CommandError as err:
            log.debug("no cluster name from the scheduler: %s", err)
    if cluster is not None and cluster not in found and None in found:
        cluster = None  # written where SLURM_CLUSTER_NAME was not set
    elif cluster is None and len(found) > 1:
        names = ", ".join(sorted(f"{c or 'job'}-{job.job_id}.jsonl" for c in found))
        raise ValueError(
            f"job {job.job_id} has timelines of several clusters in {folder} ({names}): set "
            "SLURM_CLUSTER_NAME to the cluster it ran on"
        )
    elif cluster is None and found:
        cluster = next(iter(found))
    return JobTimeline(replace(job, cluster=cluster), directory=folder, env=e, clock=clock)


def _files_of(folder: Path, job: str) -> set[str | None]:
    """The clusters whose timeline of ``job`` is in ``folder`` (None: ``job-JOBID.jsonl``)."""
    try:
        names = [p.name for p in folder.glob(f"*-{job}.jsonl")]
    except OSError:
        return set()
    prefixes = {name[: -len(f"-{job}.jsonl")] for name in names}
    return {None if p == "job" else p for p in prefixes if is_cluster_name(p)}
