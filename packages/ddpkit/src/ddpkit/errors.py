"""The ways ddpkit fails: bad configuration (before any network wait), a broken peer, and a stop
signal that ended the wait for the other ranks."""

from __future__ import annotations


class DistConfigError(ValueError):
    """The launcher's variables or the arguments are inconsistent; raised before any network wait.

    The message is one line that names the variable (or argument) and says how to fix it.
    """


class PeerError(RuntimeError):
    """A collective failed: another rank died, hung, or the rendezvous could not be reached.

    The message names this rank, the operation, the timeout, and -- when the heartbeats could
    tell -- which ranks stopped answering. The backend's own exception is chained as ``__cause__``.
    """


class InitInterrupted(RuntimeError):
    """``init()`` stopped waiting for the other ranks: a stop signal (SIGTERM, Ctrl-C) came, or
    the caller's ``abort()`` said so. Nothing was created; the message is one line naming the
    reason and which ranks had arrived. ``signum`` is the signal's number (None for ``abort()``):
    exit with ``128 + signum`` to look like the signal's own exit.
    """

    def __init__(self, message: str, *, signum: int | None = None) -> None:
        super().__init__(message)
        self.signum = signum


def first_line(e: BaseException) -> str:
    """The first non-blank line of an exception's message (backends add pages of context)."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
