"""JSONL metrics (one event per line, orjson) and the rank-0 progress line.

Every line carries ``event`` and ``time`` (epoch seconds) and ``run`` (one id per process start),
so one file holds a whole experiment across allocations and ``report`` can tell them apart.
Lines are appended and flushed one by one: a SIGKILL loses at most the line being written, and a
torn last line is skipped by :func:`read_events`.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import orjson


class MetricsLog:
    """Appends events to a JSONL file; a no-op writer on ranks other than 0 (``path=None``)."""

    def __init__(self, path: Path | None, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.run = uuid.uuid4().hex[:12]
        self._clock = clock
        self._file: IO[bytes] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "ab")  # noqa: SIM115 - held open for the whole run

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": self._clock(), "run": self.run, **fields}
        if self._file is not None:
            # One write per line keeps lines whole when the process dies between events.
            self._file.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            self._file.flush()
        return record

    def close(self) -> None:
        if self._file is not None:
            try:
                os.fsync(self._file.fileno())
            except OSError:
                pass
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """Events in file order; a torn or foreign line (from a kill mid-write) is skipped."""
    with open(path, "rb") as f:
        for line in f:
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(record, dict) and "event" in record:
                yield record


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
