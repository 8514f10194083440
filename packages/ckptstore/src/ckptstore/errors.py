"""Exceptions and warnings. Every message names the checkpoint (URL, file) and says what to do
about it."""

from __future__ import annotations

import errno
import logging
import socket
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
    if unreachable(e):
        return unreachable_error(e, what)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointError(
            f"no space left writing {what} ({e.strerror}); nothing was committed and the previous "
            "checkpoint is intact: free space, lower keep_last, or point the store elsewhere"
        )
    return CheckpointError(f"I/O error writing {what}: {e}")


class StoreUnreachableError(CheckpointError, ConnectionError):
    """The storage did not answer: connection refused or reset, timed out, a name that does
    not resolve, a stale network file handle. The call that raised it committed nothing, and
    the same call may succeed once the store is back (a training run goes on and saves later;
    pyrecover-train exits 74 when it cannot start or end for it). Also an OSError, so code
    that handles storage failures as OSError keeps doing so. ``retry_after``: seconds the
    store asked to wait before the next try (HTTP Retry-After), or None."""

    retry_after: float | None = None


# What "the store did not answer" looks like below ckptstore, whatever the backend: errno
# values of the socket layer and of network file systems. What a backend's client library
# raises is that backend's to say (``FsspecStorage.classify``): this module names no vendor.
_UNREACHABLE_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EHOSTUNREACH,
    errno.EHOSTDOWN,
    errno.ENETUNREACH,
    errno.ENETDOWN,
    errno.ENOTCONN,
    errno.ESTALE,
}


class StoreConfigError(CheckpointError):
    """The store answered, and the answer means a setting is wrong: access denied (403), bad
    credentials, no such bucket, an endpoint whose name does not resolve at the start. A retry
    cannot help: pyrecover-train says so in one line and exits 2. Nothing was committed."""


def unreachable(e: BaseException | None) -> bool:
    """Whether ``e``, or an exception it was raised from, means the storage did not answer."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (ConnectionError, TimeoutError, socket.gaierror)):
            return True
        if isinstance(e, OSError) and e.errno in _UNREACHABLE_ERRNOS:
            return True
        e = e.__cause__ or e.__context__
    return False


def unreachable_error(
    e: BaseException, what: str, *, retry_after: float | None = None, answered: str = ""
) -> StoreUnreachableError:
    """``e`` (an outage) as one line about ``what``; a new error each time (``raise
    unreachable_error(e, ...) from e`` must not make ``e`` its own cause). ``answered``: what
    the store said when it did answer (``HTTP 503 SlowDown``); ``retry_after``: the pause it
    asked for."""
    if isinstance(e, StoreUnreachableError):
        err = StoreUnreachableError(str(e))
        retry_after = retry_after if retry_after is not None else e.retry_after
    else:
        said = f"answered {answered}" if answered else "did not answer"
        err = StoreUnreachableError(
            f"the store {said} at {what} ({type(e).__name__}: {_first(e)}); nothing was "
            "committed, what is committed is intact"
        )
    err.retry_after = retry_after
    err.__cause__ = e
    return err


def config_error(e: BaseException, what: str, fix: str) -> StoreConfigError:
    """``e`` (an answer that means a wrong setting) as one line: what, and ``fix``."""
    if isinstance(e, StoreConfigError):
        return e
    err = StoreConfigError(
        f"the store refused {what} ({type(e).__name__}: {_first(e)}): {fix}; a retry cannot "
        "help, nothing was committed"
    )
    err.__cause__ = e
    return err


def _first(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return text if len(text) <= 160 else text[:157] + "..."


def kind_of(e: BaseException | None) -> str:
    """``down`` (an outage: retry later), ``config`` (a wrong setting: never retried) or
    ``error`` (anything else)."""
    if isinstance(e, StoreConfigError):
        return "config"
    return "down" if unreachable(e) else "error"


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt, unreadable) or a mirror copy failed."""


def warn(msg: str) -> None:
    """To the ``ckptstore`` logger and as a CheckpointWarning (tests and callers can catch)."""
    log.warning(msg)
    warnings.warn(msg, CheckpointWarning, stacklevel=3)
