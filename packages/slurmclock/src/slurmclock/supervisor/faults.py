"""ddpkit's fault record, read by the supervisor: which rank, on which node, was dead or frozen.

The step's ranks append one JSON object per line to ``$DDPKIT_FAULT_FILE`` (``{"time", "rank",
"host", "what", "reporter", "silent_s", "job_id"}``: DESIGN.md, "Contracts"), which ``slurmclock
supervise`` sets beside the job's timeline. :func:`read_faults` reads a run's records once the
step is over; :class:`FaultWatch` reads them as they come, while the step runs, so that a dead
or frozen node is named within a poll of its report and the stuck step is ended at once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from slurmclock.durations import parse_time

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
        return f"{who} on node {self.host or '?'} was {self.what or 'lost'}{by}"


def read_faults(path: str | os.PathLike[str] | None, since: float) -> list[Fault]:
    """The fault file's readable lines written at or after ``since`` (one line per report).
    ``time`` is epoch seconds; ISO-8601 text (what ddpkit wrote before) is read too."""
    if path is None:
        return []
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    faults = [fault for line in text.splitlines() if (fault := parse_fault(line)) is not None]
    return [fault for fault in faults if fault.time >= since]


class FaultWatch:
    """The records appended to ``path`` from now on and written at or after ``since``, read
    as the file grows: each :meth:`new` call returns those not returned before (a line still
    being written waits for its newline). A missing or unreadable file has none yet."""

    def __init__(self, path: str | os.PathLike[str] | None, since: float) -> None:
        self.path = None if path is None else Path(path)
        self.since = since
        self.seen: list[Fault] = []
        self._offset = _size(self.path)  # an earlier launch's reports are its own
        self._partial = b""

    def new(self) -> list[Fault]:
        if self.path is None:
            return []
        try:
            if self.path.stat().st_size <= self._offset:
                return []
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return []
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        found = [parse_fault(line.decode(errors="replace")) for line in lines]
        fresh = [f for f in found if f is not None and f.time >= self.since]
        self.seen += fresh
        return fresh


def _size(path: Path | None) -> int:
    try:
        return 0 if path is None else path.stat().st_size
    except OSError:
        return 0


def parse_fault(line: str) -> Fault | None:
    """One record, or None when the line is not one (damaged, another format)."""
    try:
        rec = json.loads(line)
        at = parse_time(rec["time"])
    except (ValueError, KeyError, TypeError, AttributeError):
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
