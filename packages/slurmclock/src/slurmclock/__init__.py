"""SLURM job deadline, time budget, stop signals and self-requeue (stdlib only)."""

__version__ = "0.1.0"
