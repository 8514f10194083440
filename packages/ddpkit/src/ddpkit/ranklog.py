"""Rank-zero printing and logging without singletons: the rank comes from the standard places."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def current_rank(env: Mapping[str, str] | None = None) -> int:
    """The global rank: the process group's when one exists, else the launcher's variables."""
    try:
        import torch.distributed as tdist

        if tdist.is_available() and tdist.is_initialized():
            return int(tdist.get_rank())
    except ImportError:
        pass
    from ddpkit.env import _is_task_step, detect
    from ddpkit.errors import DistConfigError

    environ = os.environ if env is None else env
    try:
        return detect(environ).rank
    except DistConfigError:
        pass
    # Variables init() would refuse (say, no MASTER_ADDR yet): the rank alone may still be clear.
    text = environ.get("RANK") or (environ.get("SLURM_PROCID") if _is_task_step(environ) else None)
    try:
        return max(int(text or 0), 0)
    except ValueError:
        return 0  # better every rank logs than none; init() will say what is wrong


class RankZeroFilter(logging.Filter):
    """A logging filter that lets records through on rank 0 only.

    ``rank`` None looks it up at each record (so a filter installed before ``init()`` still
    works). Every record gets a ``rank`` attribute (use ``%(rank)s`` in formats); a record logged
    with ``extra={"all_ranks": True}`` passes on every rank (e.g. "rank 3 lost its GPU").

        handler.addFilter(RankZeroFilter())
    """

    def __init__(self, rank: int | None = None, name: str = "") -> None:
        super().__init__(name)
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank() if self.rank is None else self.rank
        record.rank = rank
        return rank == 0 or bool(getattr(record, "all_ranks", False))


def rank_zero_only(fn: Callable[P, R]) -> Callable[P, R | None]:
    """Decorator: run ``fn`` on rank 0, return None elsewhere (rank read at each call)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
        if current_rank() == 0:
            return fn(*args, **kwargs)
        return None

    return wrapper
