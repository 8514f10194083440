"""What the environment says about the SLURM job this process runs in."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

__all__ = ["array_task", "in_slurm", "job_id", "restart_count"]

log = logging.getLogger("slurmclock")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def job_id(env: Mapping[str, str] | None = None) -> str | None:
    """``SLURM_JOB_ID`` (the id ``scontrol``/``squeue`` take), or None outside a job.

    In an array job every task has its own ``SLURM_JOB_ID``; :func:`array_task` gives the
    ``ARRAYID_TASKID`` form users see in ``squeue``.
    """
    value = _env(env).get("SLURM_JOB_ID", "").strip()
    return value or None


def array_task(env: Mapping[str, str] | None = None) -> str | None:
    """``"1234_7"`` from ``SLURM_ARRAY_JOB_ID``/``SLURM_ARRAY_TASK_ID``; None if not an array."""
    e = _env(env)
    array, task = e.get("SLURM_ARRAY_JOB_ID", "").strip(), e.get("SLURM_ARRAY_TASK_ID", "").strip()
    return f"{array}_{task}" if array and task else None


def in_slurm(env: Mapping[str, str] | None = None) -> bool:
    """True inside a SLURM job (``SLURM_JOB_ID`` set)."""
    return job_id(env) is not None


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How often SLURM requeued this job (``SLURM_RESTART_COUNT``); 0 when unset or malformed."""
    raw = _env(env).get("SLURM_RESTART_COUNT", "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        log.warning("SLURM_RESTART_COUNT=%r is not an integer; using 0", raw)
        return 0
    if value < 0:
        log.warning("SLURM_RESTART_COUNT=%r is negative; using 0", raw)
        return 0
    return value
