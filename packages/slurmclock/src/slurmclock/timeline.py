"""One job's timeline: timestamps written by the trainer and the batch script, read next time.

What a run needs after its final save is durable -- process exit, ``srun`` teardown, the batch
script's ``scontrol requeue`` -- happens after the last moment the trainer can write anything
into its checkpoint. So both write a line to a small per-job file instead, and the next
allocation of the same job (``SLURM_JOB_ID`` stays the same across requeues) reads it:

==============  ===================================================================================
event           written by
==============  ===================================================================================
``start``       the batch script, first thing (``slurmclock mark start``)
``signal``      the batch script when SLURM's signal arrives (``slurmclock mark signal``)
``saved``       the trainer when its final save is durable (``TimeBudget.save(final=True)``)
``exited``      the batch script when the training step has exited (``slurmclock mark exited``)
``requeued``    ``slurmclock requeue`` / :func:`slurmclock.requeue` once SLURM accepted it
``checkpoint``  the trainer whenever a checkpoint is durable: ``step`` (``record_save(step=)``)
``failed``      ``slurmclock supervise`` when the step failed: ``rc``, ``step`` (newest checkpoint)
``gave_up``     ``slurmclock supervise`` when it stopped the chain: ``why`` (the line it logged)
==============  ===================================================================================

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
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmclock.durations import check_seconds
from slurmclock.job import _warn_once, check_job_id, restart_count
from slurmclock.job import job_id as _job_id

__all__ = ["EVENTS", "Event", "ExitSample", "JobTimeline", "timeline_dir"]

log = logging.getLogger("slurmclock")

EVENTS = ("start", "signal", "saved", "exited", "requeued", "checkpoint", "failed", "gave_up")


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

    ``path`` is None outside a SLURM job: :meth:`mark` then does nothing and :meth:`events` is
    empty. Only rank 0 writes (``RANK``, else ``SLURM_PROCID``; a batch script is rank 0), so
    every rank may hold one. ``clock`` gives epoch seconds (injectable for tests).
    """

    def __init__(
        self,
        job_id: str | None = None,
        *,
        directory: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        e = os.environ if env is None else env
        self.job_id = check_job_id(job_id, "job_id") if job_id is not None else _job_id(e)
        self.restart = restart_count(e)
        self.directory = Path(directory) if directory is not None else timeline_dir(e)
        cluster = _cluster_name(e)
        self._name = f"{cluster}-{self.job_id}" if cluster else f"job-{self.job_id}"
        self.unreadable: list[int] = []  # line numbers the last events() could not read
        self.read_error: str | None = None  # why the last events() could not read the file
        rank = (e.get("RANK") or e.get("SLURM_PROCID") or "0").strip()
        self.writer = rank in ("", "0")
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
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
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
        """Every readable line, in file order."""
        path = self.path
        if path is None:
            return []
        self.read_error = None
        try:
            text = path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        except OSError as e:
            self.read_error = e.strerror or str(e)
            self._warn(f"cannot read the job timeline {path}: {self.read_error}")
            return []
        events, self.unreadable = [], []
        for number, line in enumerate(text.splitlines(), 1):
            event = _parse(line)
            if event is not None:
                events.append(event)
            elif line.strip():
                self.unreadable.append(number)
        if self.unreadable:
            _warn_once(
                f"skipped {_lines(self.unreadable)} of the job timeline {path} that are not "
                "timeline events (damaged or written by something else)"
            )
        return events

    def exit_samples(self) -> list[ExitSample]:
        """Per finished run: the time from its last ``saved`` to ``requeued`` (else ``exited``).

        The run in progress has no end mark yet, so it gives no sample.
        """
        by_run: dict[int, dict[str, float]] = {}
        for ev in self.events():
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


def _parse(line: str) -> Event | None:
    try:
        record = json.loads(line)
        name, at, restart = record.pop("event"), float(record.pop("time")), record.pop("restart")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(name, str) or not isinstance(restart, int) or isinstance(restart, bool):
        return None
    if not math.isfinite(at) or at < 0 or restart < 0:  # NaN, Infinity: json takes them
        return None
    return Event(name, at, restart, record)


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")
    return f"{len(numbers)} line{'s' if len(numbers) > 1 else ''} ({shown})"


_CLUSTER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _cluster_name(env: Mapping[str, str]) -> str | None:
    """``SLURM_CLUSTER_NAME`` when it can be part of a file name (it is, from SLURM)."""
    cluster = env.get("SLURM_CLUSTER_NAME", "").strip()
    if not cluster:
        return None
    if _CLUSTER.fullmatch(cluster) is None:
        _warn_once(
            f"SLURM_CLUSTER_NAME={cluster[:40]!r} cannot be part of a file name (letters, digits, "
            "'_', '.', '-'); naming the job's timeline job-JOBID.jsonl instead"
        )
        return None
    return cluster
