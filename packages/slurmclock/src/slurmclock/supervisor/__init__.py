"""The batch job's supervisor: ``slurmclock supervise -- srun ... train ...``.

It runs the training step, forwards SLURM's signals, and when the step ends decides what comes
next: start it again in this allocation, requeue the job, or end (see :mod:`.supervise`).

Modules: :mod:`.config` (:class:`SuperviseConfig`), :mod:`.supervise` (:class:`Supervisor`, the
I/O), :mod:`.verdict` (what a step's end means and what comes next), :mod:`.history` (the
timeline's failure streak, the measured cost of a restart), :mod:`.faults` (ddpkit's fault
record, read while the step runs), :mod:`.launch` (one launch of the step; ending one stuck on a
lost node), :mod:`.lostnodes` (probing reported nodes; what a requeued job asks for),
:mod:`.placement` (the step's nodes: spares, the nodes left). The decisions are pure functions;
everything SLURM is reached through the :class:`~slurmclock.job.Scheduler` the supervisor is
given.
"""

from slurmclock.supervisor.config import SuperviseConfig
from slurmclock.supervisor.supervise import Supervisor

__all__ = ["SuperviseConfig", "Supervisor"]
