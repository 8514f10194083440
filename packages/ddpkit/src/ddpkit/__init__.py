"""Process-group setup for torchrun, srun or a single process, and rank helpers."""

__version__ = "0.1.0"
