"""JSONL metrics (one event per line, orjson) and the rank-0 progress line.

Every line carries ``event`` and ``time`` (epoch seconds) and ``run`` (one id per process start),
so one file holds a whole experiment across allocations and ``report`` can tell them apart.
Lines are appended one write each (:class:`AppendFile`): a SIGKILL loses at most the line being
written, a torn last line is skipped by :func:`read_events` and ended before the next line, and
a disk that fills up costs the lines it cannot take, not the run.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from slurmclock.untrusted import Records, read_records

RETRY_S = 30.0  # how often a file that could not be written is tried again
VAL_LOSS = "val_loss"
"""The validation loss's one name: the ``eval`` event's key, a checkpoint's metadata key (and
its ``metrics``), W&B's series and the metric ckptstore's ``keep_best`` ranks checkpoints by."""
READ_LIMIT = 256 * 1024 * 1024  # a report reads at most this much: a long run's newest events


class AppendFile:
    """A file the run appends whole lines to, which may fail under it: a full disk, a quota, a
    file system gone read-only. Training does not depend on it, so the run goes on without it:
    the first failure is said in one line (``say``), writes are tried again at most every
    ``retry_s`` seconds, and when one succeeds again that is said too, with the lines lost.

    Each line is one ``write`` to an ``O_APPEND`` descriptor, so lines stay whole when the
    process dies between two; a line cut short (by a kill, or a disk that filled in the middle
    of it) is ended before the next one, so it spoils no other line.
    """

    def __init__(
        self,
        path: Path,
        what: str,
        *,
        say: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        retry_s: float = RETRY_S,
    ) -> None:
        self.path, self.what, self._say = path, what, say
        self._clock, self._retry_s = clock, retry_s
        self._fd: int | None = None
        self._torn = False  # the file may end in a partial line: end it first
        self.failure: str | None = None  # why the last write failed (None: writing)
        self.lost = 0  # lines not written since it failed
        self._retry_at = 0.0
        try:
            self._open()
        except OSError as e:  # a full disk with no room for a new file, say
            self._failed(e)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(self._fd).st_size
        if size:  # a kill mid-line in an earlier run: its tail must not swallow our first line
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                self._torn = f.read(1) != b"\n"

    def write(self, line: bytes) -> bool:
        """Append ``line`` (ending in a newline); False when it could not be written."""
        if self.failure is not None and self._clock() < self._retry_at:
            self.lost += 1
            return False
        data = b"\n" + line if self._torn else line
        try:
            if self._fd is None:
                self._open()
            assert self._fd is not None
            written = os.write(self._fd, data)
            if written < len(data):  # the disk filled in the middle of the line
                self._torn = True
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            self._failed(e)
            self.lost += 1
            return False
        self._torn = False
        if self.failure is not None:
            self._say(
                f"the {self.what} {self.path} can be written again; {self.lost} line(s) were "
                f"lost meanwhile ({self.failure})"
            )
            self.failure, self.lost = None, 0
        return True

    def _failed(self, e: OSError) -> None:
        first = self.failure is None
        self.failure = e.strerror or str(e)
        self._torn = self._torn or self._fd is not None  # part of it may have been written
        self._retry_at = self._clock() + self._retry_s
        if first:
            self._say(
                f"cannot write the {self.what} {self.path}: {self.failure}; training goes on "
                f"without it (tried again every {self._retry_s:g} s)"
            )

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None


class MetricsLog:
    """Appends events to a JSONL file (:class:`AppendFile`: the run goes on without it if it
    cannot be written); a no-op writer on ranks other than 0 (``path=None``)."""

    def __init__(
        self,
        path: Path | None,
        *,
        clock: Callable[[], float] = time.time,
        say: Callable[[str], None] = print,
    ) -> None:
        self.path = path
        self.run = uuid.uuid4().hex[:12]
        self._clock = clock
        self.file: AppendFile | None = None
        if path is not None:
            self.file = AppendFile(path, "metrics file", say=say)

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": self._clock(), "run": self.run, **fields}
        if self.file is not None:
            self.file.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        return record

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: Path, *, limit: int = READ_LIMIT) -> Iterator[dict[str, Any]]:
    """Events in file order; a torn or foreign line (from a kill mid-write) is skipped. The file
    is read as untrusted input (slurmclock's reader: bounded lines, nothing but a regular file,
    its last ``limit`` bytes when larger)."""
    yield from events_of(read_records(path, limit=limit))


def events_of(found: Records) -> Iterator[dict[str, Any]]:
    """The events among what :func:`slurmclock.untrusted.read_records` found."""
    return (record for record in found.records if "event" in record)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "-"
    s = max(0, int(round(seconds)))
    days, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{days}d{h:02d}:{m:02d}:{s:02d}" if days else f"{h}:{m:02d}:{s:02d}"


def fmt_rate(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def progress_line(
    *,
    step: int,
    total: int,
    loss: float,
    lr: float,
    tokens_per_s: float,
    step_time: float,
    seconds_left: float | None,
    mfu: float | None = None,
) -> str:
    eta = (total - step) * step_time
    parts = [
        f"step {step}/{total}",
        f"loss {loss:.4f}",
        f"lr {lr:.2e}",
        f"{fmt_rate(tokens_per_s)} tok/s",
        f"{step_time * 1000:.0f} ms/step",
    ]
    if mfu is not None:
        parts.append(f"MFU {mfu * 100:.1f}%")
    parts.append(f"ETA {fmt_duration(eta)}")
    parts.append("no deadline" if seconds_left is None else f"left {fmt_duration(seconds_left)}")
    return " | ".join(parts)
