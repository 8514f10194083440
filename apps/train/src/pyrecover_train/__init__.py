"""pyrecover-train: the time-aware, self-requeueing GPT trainer for SLURM clusters."""

__version__ = "0.1.0"
