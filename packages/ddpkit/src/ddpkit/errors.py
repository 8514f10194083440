"""The two ways ddpkit fails: bad configuration (before any network wait) and a broken peer."""

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
