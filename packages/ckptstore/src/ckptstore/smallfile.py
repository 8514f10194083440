"""Small files another process wrote -- a manifest, the writer lock, the ``latest`` pointer --
read as untrusted input on a local disk: a regular file only (``stat`` first, opened
``O_NONBLOCK`` and checked again with ``fstat``, so a FIFO or a device is refused without a
wait; a folder is ``IsADirectoryError``, as ``open`` says it), at most
:data:`MAX_SMALL_BYTES`. What breaks these rules is an :class:`UnreadableFileError` (a
:class:`~ckptstore.errors.CorruptCheckpointError`: the caller says which file and what to do),
never a hang or a read of gigabytes. A missing file is still ``FileNotFoundError``: absent is
not broken."""

from __future__ import annotations

import errno
import os
import stat

from .errors import CorruptCheckpointError

__all__ = ["MAX_SMALL_BYTES", "UnreadableFileError", "read_small_file"]

# A manifest of many files with chunked checksums stays far below this; a lock or a pointer is
# a few hundred bytes. More is not a file ckptstore wrote.
MAX_SMALL_BYTES = 64 * 1024 * 1024
_CHUNK = 1024 * 1024


class UnreadableFileError(CorruptCheckpointError):
    """A small file that is not a regular file, or larger than ckptstore ever writes."""


def read_small_file(path: str, limit: int = MAX_SMALL_BYTES) -> bytes:
    """The bytes of ``path``: a regular file of at most ``limit`` bytes."""
    _check(path, os.stat(path), limit)  # a FIFO is refused before any open
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _check(path, os.fstat(fd), limit)  # the file opened, whatever was swapped in
        chunks, total = [], 0
        while chunk := os.read(fd, _CHUNK):
            total += len(chunk)
            if total > limit:  # it grew since the fstat
                raise UnreadableFileError(_too_big(path, total, limit))
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _check(path: str, st: os.stat_result, limit: int) -> None:
    if stat.S_ISDIR(st.st_mode):  # as open() says it: callers name a folder in their words
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not stat.S_ISREG(st.st_mode):
        what = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file"
        if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            what = "a device"
        raise UnreadableFileError(
            f"{path} is {what}, not a file ckptstore wrote: not read; remove it (or the link to it)"
        )
    if st.st_size > limit:
        raise UnreadableFileError(_too_big(path, st.st_size, limit))


def _too_big(path: str, size: int, limit: int) -> str:
    return (
        f"{path} holds {size} bytes, more than the {limit} ckptstore ever writes there: not "
        "read; remove it"
    )
