"""Which scheduler: the one place that makes the default :class:`~slurmclock.job.Scheduler`.

Every module that talks to the scheduler takes ``scheduler=`` (tests pass a fake one) and, when
given none, asks :func:`default_scheduler`: the scheduler whose job this process runs in (by the
variables it set, :func:`slurmclock.job.variables`), SLURM outside any job. A second scheduler
is its class (its commands, what they print) in :data:`SCHEDULERS` and its variables in
:data:`slurmclock.job.VARIABLES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from slurmclock.commands import Runner
from slurmclock.job import Scheduler, variables
from slurmclock.slurm import Slurm

__all__ = ["SCHEDULERS", "default_scheduler"]

SCHEDULERS: dict[str, Callable[[Runner | None], Scheduler]] = {"slurm": Slurm}
"""Every scheduler slurmclock can talk to, by the name of its variables' table."""


def default_scheduler(
    runner: Runner | None = None, *, env: Mapping[str, str] | None = None
) -> Scheduler:
    """The scheduler of the job this process runs in (``env``: its environment, default
    ``os.environ``), running its commands through ``runner`` (default: subprocesses)."""
    return SCHEDULERS[variables(env).scheduler](runner)
