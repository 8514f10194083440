"""Files another process writes, read as untrusted input: bounded, never blocking, never raising.

The job's timeline, ddpkit's fault record, a loop's budget state and the app's metrics are
written by other processes -- other ranks, other runs, other versions, a full disk, a person
with an editor. A reader of such a file must not die on one bad line (every trainer and the
supervisor read the timeline at start) and must not wait on it (a FIFO, ``/dev/zero``). So
every reader in slurmclock reads through this module:

* **Only regular files.** The path is ``stat``-ed first (symlinks followed; a loop is an
  error): a FIFO, a device, a socket or a directory is refused without being opened for
  reading. The file is then opened with ``O_NONBLOCK`` and checked again with ``fstat`` (it
  may have been swapped in between): an open never waits.
* **Bounded size.** At most :data:`MAX_BYTES` are read; a larger file is read from its tail
  (the newest lines), from its first whole line.
* **Bounded lines.** A line longer than :data:`MAX_LINE` bytes, nested deeper than
  :data:`MAX_DEPTH`, with an integer of more than :data:`MAX_DIGITS` digits, a float that is
  not finite or beyond :data:`MAX_NUMBER`, ``NaN``/``Infinity``, or that is not one JSON
  object is skipped and counted (:attr:`Records.skipped`): never a RecursionError, an
  OverflowError or a 4300-digit ``int()``.
* **Quoted values.** :func:`quote` makes a value from such a file safe for a log line: control
  characters (newline, ESC of an ANSI sequence) escaped, at most :data:`QUOTE_LIMIT` characters.
  A host name with a newline cannot forge a line in the job log.

:func:`read_records` reads a whole file, :class:`Tail` reads one as it grows (the fault record,
while the step runs). Both return what they skipped; their callers say it once.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_BYTES",
    "MAX_DEPTH",
    "MAX_DIGITS",
    "MAX_LINE",
    "MAX_NUMBER",
    "NotRegularFile",
    "Records",
    "Tail",
    "open_regular",
    "parse_record",
    "quote",
    "read_bytes",
    "read_records",
    "safe_text",
]

MAX_BYTES = 8 * 1024 * 1024  # read at most this much of a file: its tail when larger
MAX_LINE = 64 * 1024  # a longer line is skipped (a timeline line is ~200 bytes)
MAX_DEPTH = 16  # nesting of arrays and objects (a record is 1-2 deep)
MAX_DIGITS = 30  # digits of an integer (an epoch in ns has 19)
MAX_NUMBER = 1e18  # magnitude of a float (seconds since 1970 are ~1.8e9)
QUOTE_LIMIT = 200  # characters of a value shown in a log line


class NotRegularFile(OSError):
    """The path is not a regular file (a FIFO, a device, a directory...): not read."""


@dataclass(slots=True)
class Records:
    """What a read found: the ``records`` (JSON objects, in file order) and their ``lines``
    (numbers), the ``skipped`` line
    numbers (of the part read), ``tail`` (the file was larger than the bound: only its last
    ``MAX_BYTES`` were read) and ``error`` (why the file could not be read at all; None when it
    was, or did not exist)."""

    records: list[dict[str, Any]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # each record's line number
    skipped: list[int] = field(default_factory=list)
    tail: bool = False
    error: str | None = None
    limit: int = MAX_BYTES

    def describe_skipped(self, what: str) -> str:
        """One line naming the skipped lines of ``what`` ('' when none were)."""
        if not self.skipped:
            return ""
        shown = ", ".join(map(str, self.skipped[:5])) + (", ..." if len(self.skipped) > 5 else "")
        n = len(self.skipped)
        part = f" of its last {self.limit // 1024} KiB" if self.tail else ""
        return (
            f"skipped {n} line{'s' if n > 1 else ''} ({shown}){part} of {what} that are not "
            "records (damaged, too long, too deep, or written by something else)"
        )


def open_regular(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of ``path``, which must be a regular file: stat first (nothing
    else is opened), then opened without blocking and checked again. OSError otherwise
    (:class:`NotRegularFile`, FileNotFoundError, ELOOP for a symlink loop...)."""
    _check_regular(os.stat(path).st_mode, path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        _check_regular(os.fstat(fd).st_mode, path)
    except OSError:
        os.close(fd)
        raise
    return fd


def _check_regular(mode: int, path: str | os.PathLike[str]) -> None:
    if stat.S_ISDIR(mode):  # said as the system says it
        raise NotRegularFile(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not stat.S_ISREG(mode):
        kind = _kind(mode)
        raise NotRegularFile(errno.EINVAL, f"not a regular file ({kind}): not read", str(path))


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a file"


def read_bytes(
    path: str | os.PathLike[str], *, offset: int = 0, limit: int = MAX_BYTES
) -> tuple[bytes, int, bool]:
    """(the bytes of ``path`` from ``offset``, the offset after them, cut): at most ``limit``
    bytes; when more are there, the last ``limit`` (``cut`` True: the caller starts at its first
    whole line). OSError as :func:`open_regular`."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size < offset:  # truncated or replaced: read it again from the start
            offset = 0
        cut = size - offset > limit
        start = size - limit if cut else offset
        os.lseek(fd, start, os.SEEK_SET)
        chunks, want = [], min(limit, max(0, size - start))
        while want > 0:  # a regular file: each read returns at once
            chunk = os.read(fd, want)
            if not chunk:
                break
            chunks.append(chunk)
            want -= len(chunk)
        data = b"".join(chunks)
        return data, start + len(data), cut
    finally:
        os.close(fd)


def read_records(path: str | os.PathLike[str] | None, *, limit: int = MAX_BYTES) -> Records:
    """Every JSON object line of ``path`` (see the module docstring for the bounds). A missing
    file (or None) has none; one that cannot be read has :attr:`Records.error`. Never raises on
    the file's contents or kind."""
    out = Records(limit=limit)
    if path is None:
        return out
    try:
        data, _, out.tail = read_bytes(path, limit=limit)
    except FileNotFoundError:
        return out
    except OSError as e:
        out.error = e.strerror or str(e)
        return out
    lines = data.split(b"\n")
    if out.tail and len(lines) > 1:
        lines = lines[1:]  # the first one is a part of a line
    for number, line in enumerate(lines, 1):
        record = parse_record(line)
        if record is not None:
            out.records.append(record)
            out.lines.append(number)
        elif line.strip():
            out.skipped.append(number)
    return out


class Tail:
    """Reads the JSON object lines appended to ``path`` from ``offset`` on, as the file grows:
    each :meth:`new` returns the lines not returned before (a line still being written waits
    for its newline; one longer than :data:`MAX_LINE` is skipped). Never raises, never blocks;
    :attr:`skipped` counts the lines that were not records, :attr:`error` the last reason the
    file could not be read."""

    def __init__(self, path: str | os.PathLike[str] | None, *, offset: int = 0) -> None:
        self.path = path
        self.offset = offset
        self.skipped = 0
        self.error: str | None = None
        self._partial = b""

    def new(self) -> list[dict[str, Any]]:
        if self.path is None:
            return []
        try:
            data, self.offset, cut = read_bytes(self.path, offset=self.offset)
        except FileNotFoundError:
            return []
        except OSError as e:
            self.error = e.strerror or str(e)
            return []
        if cut:
            self._partial, self.skipped = b"", self.skipped + 1  # lost lines count as one
        *lines, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > MAX_LINE:  # a line that never ends: dropped, counted once
            self._partial, self.skipped = b"", self.skipped + 1
        found = []
        for line in lines:
            record = parse_record(line)
            if record is not None:
                found.append(record)
            elif line.strip():
                self.skipped += 1
        return found


def parse_record(line: bytes | str) -> dict[str, Any] | None:
    """One JSON object within the bounds, or None (too long, too deep, a number out of range,
    not an object, not JSON)."""
    if len(line) > MAX_LINE:
        return None
    text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    if not text.strip() or _too_deep(text):
        return None
    try:
        value = json.loads(
            text,
            parse_int=_int,
            parse_float=_float,
            parse_constant=_constant,
        )
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _too_deep(text: str) -> bool:
    """Nesting beyond :data:`MAX_DEPTH` (brackets inside strings counted too: a safe excess)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return False
    depth = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif ch in "]}":
            depth = max(0, depth - 1)
    return False


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_DIGITS * 2:
        raise ValueError("a number too long")
    value = float(text)
    if not math.isfinite(value) or abs(value) > MAX_NUMBER:
        raise ValueError(f"a number out of range: {text[:20]}")
    return value


def _constant(text: str) -> float:
    raise ValueError(f"{text} is not a number a record holds")


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``value`` as text safe in a log line: a string in quotes with control characters
    escaped (newline, carriage return, ESC), cut at ``limit`` characters; other values as their
    ``repr``, cut the same way."""
    text = value if isinstance(value, str) else repr(value)
    cut = len(text) > limit
    text = text[:limit]
    safe = "".join(_escape(ch) for ch in text) + ("..." if cut else "")
    return f"'{safe}'" if isinstance(value, str) else safe


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch == "'":
        return "\\'"
    if ch == "\\":
        return "\\\\"
    if code < 0x20 or code == 0x7F or 0x80 <= code < 0xA0 or ch in "\u2028\u2029":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch, f"\\x{code:02x}")
    return ch


def safe_text(value: object, limit: int = QUOTE_LIMIT) -> str:
    """Like :func:`quote` without the quotes: for a value shown inside a sentence (a node
    name) where quotes would read oddly; still one line, no escape sequence."""
    text = value if isinstance(value, str) else repr(value)
    cut = len(text) > limit
    out = "".join(_escape(ch) if ch not in "'\\" else ch for ch in text[:limit])
    return out + ("..." if cut else "")
