"""Exceptions and warnings. Every message names the checkpoint (URL, file) and says what to do
about it."""

from __future__ import annotations

import errno
import logging
import warnings

log = logging.getLogger("ckptstore")


class CheckpointError(Exception):
    """Base class: anything ckptstore refuses or fails to do."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match its manifest (missing, truncated, bit-flipped), or its
    manifest or payload is not a valid ckptstore file (including pickles, which are refused)."""


class NoCheckpointError(CheckpointError):
    """Nothing loadable: no committed checkpoint, or every candidate failed verification."""


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint is intact but does not fit: unknown format or version, missing keys,
    shape or dtype mismatches with the state it is loaded into."""


class MirrorError(CheckpointError):
    """Copying a committed checkpoint to the mirror URL failed (the primary copy is fine)."""


class LockedError(CheckpointError):
    """Another process is this experiment's writer (it holds the one-writer lock). The message
    names the holder (host, pid, SLURM job, since when) and what to do; ``holder`` has it as
    data (a ``LockInfo``, or None when the lock file could not be read)."""

    def __init__(self, message: str, holder: object = None) -> None:
        super().__init__(message)
        self.holder = holder


def disk_error(e: OSError, what: str) -> CheckpointError:
    """A write failure as one line that says whether anything was lost and what to do."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointError(
            f"no space left writing {what} ({e.strerror}); nothing was committed and the previous "
            "checkpoint is intact: free space, lower keep_last, or point the store elsewhere"
        )
    return CheckpointError(f"I/O error writing {what}: {e}")


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt, unreadable) or a mirror copy failed."""


def warn(msg: str) -> None:
    """To the ``ckptstore`` logger and as a CheckpointWarning (tests and callers can catch)."""
    log.warning(msg)
    warnings.warn(msg, CheckpointWarning, stacklevel=3)
