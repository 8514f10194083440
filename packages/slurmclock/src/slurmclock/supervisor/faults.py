"""ddpkit's fault record, read by the supervisor: which rank, on which node, was dead or frozen.

The step's ranks append one JSON object per line to ``$DDPKIT_FAULT_FILE`` (``{"time", "rank",
"host", "what", "reporter", "silent_s", "job_id"}``: DESIGN.md, "Contracts"), which ``slurmclock
supervise`` sets beside the job's timeline. :func:`read_faults` reads a run's records once the
step is over; :class:`FaultWatch` reads them as they come, while the step runs, so that a dead
or frozen node is named within a poll of its report and the stuck step is ended at once.

The file is untrusted input (:mod:`slurmclock.untrusted`): a line that is not a record is
skipped and counted, never fatal; a FIFO or a device at its path is not read. A record whose
``host`` is not a node of this job (``nodes=``) does not end a step: it is ignored, and said
once (quoted) in :attr:`FaultWatch.said`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurmclock.durations import parse_time
from slurmclock.untrusted import Tail, parse_record, quote, read_records, safe_text

FAULT_FILE_ENV = "DDPKIT_FAULT_FILE"
"""Where the step's ranks append their fault records (ddpkit.faults.FAULT_FILE_ENV; slurmclock
cannot import it: tests/contracts/test_fault_record.py checks the two agree)."""

__all__ = ["FAULT_FILE_ENV", "Fault", "FaultWatch", "read_faults"]


@dataclass(frozen=True, slots=True)
class Fault:
    """One line of the ddpkit fault file: ``rank`` on ``host`` was ``what`` (dead / frozen),
    seen by rank ``reporter`` after ``silent_s`` seconds without a heartbeat."""

    time: float
    rank: int | None
    host: str
    what: str
    reporter: int | None
    silent_s: float | None = None
    job_id: str | None = None

    def describe(self) -> str:
        who = "a rank" if self.rank is None else f"rank {self.rank}"
        by = "" if self.reporter is None else f" (reported by rank {self.reporter})"
        host, what = safe_text(self.host or "?"), safe_text(self.what or "lost")
        return f"{who} on node {host} was {what}{by}"  # values of a file: one line, no escapes


def read_faults(path: str | os.PathLike[str] | None, since: float) -> list[Fault]:
    """The fault file's readable lines written at or after ``since`` (one line per report).
    ``time`` is epoch seconds; ISO-8601 text (what ddpkit wrote before) is read too. Lines that
    are not records are skipped (:func:`slurmclock.untrusted.read_records`)."""
    found = read_records(path)
    faults = [fault for rec in found.records if (fault := _fault(rec)) is not None]
    return [fault for fault in faults if fault.time >= since]


class FaultWatch:
    """The records appended to ``path`` from now on and written at or after ``since``, read
    as the file grows: each :meth:`new` call returns those not returned before (a line still
    being written waits for its newline). A missing or unreadable file has none yet.

    ``nodes``: the job's nodes (asked when a record comes); a record naming another host is
    not returned: :attr:`said` gets one line for it (its host quoted) and :attr:`ignored` counts
    it. Lines that are not records are counted in :attr:`skipped`, said once."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        since: float,
        *,
        nodes: Callable[[], Collection[str]] | None = None,
    ) -> None:
        self.path = None if path is None else Path(path)
        self.since = since
        self.seen: list[Fault] = []
        self.said: list[str] = []
        self.ignored = 0
        self._nodes = nodes
        # an earlier launch's reports are its own
        self._tail = Tail(self.path, offset=_size(self.path))
        self._told_skipped = False
        self._told_hosts: set[str] = set()

    @property
    def skipped(self) -> int:
        return self._tail.skipped

    def new(self) -> list[Fault]:
        found = [_fault(rec) for rec in self._tail.new()]
        fresh = [f for f in found if f is not None and f.time >= self.since and self._ours(f)]
        if self._tail.skipped and not self._told_skipped:
            self._told_skipped = True
            self.said.append(
                f"skipped a line of the fault record {quote(str(self.path))} that is not a "
                "record (damaged, too long, or written by something else)"
            )
        self.seen += fresh
        return fresh

    def _ours(self, fault: Fault) -> bool:
        nodes = None if self._nodes is None else self._nodes()
        if not nodes or _short(fault.host) in {_short(n) for n in nodes}:
            return True
        self.ignored += 1
        if fault.host not in self._told_hosts and len(self._told_hosts) < 10:  # said once each
            self._told_hosts.add(fault.host)
            shown = ", ".join(sorted(nodes)[:5]) + (", ..." if len(nodes) > 5 else "")
            self.said.append(
                f"ignored a fault record naming {quote(fault.host)}, not a node of this job "
                f"({shown}): it does not end the step"
            )
        return False


def _short(host: str) -> str:
    """A node's name as SLURM lists it (``socket.gethostname()`` may be fully qualified)."""
    return host.split(".")[0]


def _size(path: Path | None) -> int:
    try:
        return 0 if path is None else os.stat(path).st_size
    except OSError:
        return 0


def parse_fault(line: str | bytes) -> Fault | None:
    """One record, or None when the line is not one (damaged, another format, out of bounds)."""
    rec = parse_record(line)
    return None if rec is None else _fault(rec)


def _fault(rec: dict[str, Any]) -> Fault | None:
    try:
        at = parse_time(rec["time"])
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
        return None
    silent, job = rec.get("silent_s"), rec.get("job_id")
    return Fault(
        at,
        _int(rec.get("rank")),
        str(rec.get("host") or ""),
        str(rec.get("what") or ""),
        _int(rec.get("reporter")),
        float(silent)
        if isinstance(silent, (int, float)) and not isinstance(silent, bool)
        else None,
        str(job) if isinstance(job, (str, int)) and not isinstance(job, bool) else None,
    )


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
