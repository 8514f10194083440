"""What the environment says about the SLURM job this process runs in.

A job id is turned into file names (the job's timeline) and command arguments (squeue, scontrol,
scancel), so every one goes through :func:`check_job_id` first: ``../../escape``, ``abc`` or
``--all`` never reach a path or a command. A value from the environment that cannot be used is
named in one warning (what, where from, what happens instead), once per process.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

__all__ = ["array_task", "check_job_id", "in_slurm", "job_id", "restart_count"]

log = logging.getLogger("slurmclock")

# SLURM job ids are uint32 (at most 10 digits); an array task is JOBID_TASK, a heterogeneous
# job's component JOBID+OFFSET.
_JOB_ID = re.compile(r"([0-9]{1,10})(?:(_|\+)([0-9]{1,10}))?")
_NUMBER = re.compile(r"[0-9]{1,10}")
JOB_ID_FORMS = "give digits (1234), 1234_7 for an array task or 1234+1 for a het job component"

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def check_job_id(value: object, what: str = "job id") -> str:
    """``value`` (text, or an int) as a SLURM job id (``1234``, ``1234_7``, ``1234+1``; outer
    spaces and leading zeros dropped), or a one-line ValueError naming ``what`` (e.g.
    ``"--job-id"``) and the accepted forms."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        value = str(value)
    text = value.strip() if isinstance(value, str) else None
    m = _JOB_ID.fullmatch(text) if text else None
    if m is None:
        shown = value[:60] if isinstance(value, str) else value
        raise ValueError(f"{what} {shown!r} is not a SLURM job id: {JOB_ID_FORMS}")
    first, sep, second = m.groups()
    return str(int(first)) + (f"{sep}{int(second)}" if sep else "")


def job_id_problem(env: Mapping[str, str] | None = None) -> str | None:
    """Why ``SLURM_JOB_ID`` cannot be used (one line), or None when it is fine or unset."""
    raw = _env(env).get("SLURM_JOB_ID", "")
    if not raw.strip():
        return None
    try:
        check_job_id(raw, "SLURM_JOB_ID")
    except ValueError as e:
        return str(e)
    return None


def job_id(env: Mapping[str, str] | None = None) -> str | None:
    """``SLURM_JOB_ID`` (the id ``scontrol``/``squeue`` take), or None outside a job.

    A value that is not a SLURM job id is named in one warning and treated as "not in a job"
    (no timeline file, no squeue). In an array job every task has its own ``SLURM_JOB_ID``;
    :func:`array_task` gives the ``ARRAYID_TASKID`` form users see in ``squeue``.
    """
    raw = _env(env).get("SLURM_JOB_ID", "")
    if not raw.strip():
        return None
    try:
        return check_job_id(raw, "SLURM_JOB_ID")
    except ValueError as e:
        _warn_once(f"{e}; treating this process as outside a SLURM job")
        return None


def array_task(env: Mapping[str, str] | None = None) -> str | None:
    """``"1234_7"`` from ``SLURM_ARRAY_JOB_ID``/``SLURM_ARRAY_TASK_ID``; None if not an array
    (or, with one warning, when they are not whole numbers)."""
    e = _env(env)
    array, task = e.get("SLURM_ARRAY_JOB_ID", "").strip(), e.get("SLURM_ARRAY_TASK_ID", "").strip()
    if not array and not task:
        return None
    if not (_NUMBER.fullmatch(array) and _NUMBER.fullmatch(task)):
        _warn_once(
            f"SLURM_ARRAY_JOB_ID={array[:30]!r} and SLURM_ARRAY_TASK_ID={task[:30]!r} are not "
            "both whole numbers; reporting no array task"
        )
        return None
    return f"{int(array)}_{int(task)}"


def in_slurm(env: Mapping[str, str] | None = None) -> bool:
    """True inside a SLURM job (``SLURM_JOB_ID`` set to a job id)."""
    return job_id(env) is not None


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How often SLURM requeued this job (``SLURM_RESTART_COUNT``); 0 when unset, or (with one
    warning) when it is not a whole number >= 0."""
    raw = _env(env).get("SLURM_RESTART_COUNT", "").strip()
    if not raw:
        return 0
    if not _NUMBER.fullmatch(raw):
        _warn_once(
            f"SLURM_RESTART_COUNT={raw[:30]!r} is not a whole number >= 0; counting this run as "
            "restart 0"
        )
        return 0
    return int(raw)
