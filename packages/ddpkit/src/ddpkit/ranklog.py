"""Rank-zero printing and logging without singletons: the rank comes from the standard places."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import ParamSpec, TypeVar

FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
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
    with ``extra={"all_ranks": True}`` passes on every rank (e.g. "rank 3 lost its GPU"), and so
    does every record at or above ``others_level`` when it is given (say, warnings).

        handler.addFilter(RankZeroFilter())
    """

    def __init__(
        self, rank: int | None = None, name: str = "", *, others_level: int | None = None
    ) -> None:
        super().__init__(name)
        self.rank = rank
        self.others_level = others_level

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank() if self.rank is None else self.rank
        record.rank = rank
        if rank == 0 or getattr(record, "all_ranks", False):
            return True
        return self.others_level is not None and record.levelno >= self.others_level


class _Nowhere(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)


class _Console(logging.StreamHandler):
    """The console handler. When its reader left (``python train.py | head``), or stdout is a
    file on a full disk, it says so in one line on stderr and drops what follows, not a "---
    Logging error ---" traceback per record; the log file and the job go on."""

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError) or self.stream is sys.stderr:
            super().handleError(record)
            return
        self.stream = _Nowhere()  # not setStream(): it would flush the closed pipe again
        why = (
            "was closed by its reader"
            if isinstance(error, BrokenPipeError)
            else f"cannot be written: {error.strerror or error}"
        )
        with contextlib.suppress(OSError):
            print(f"ddpkit: stdout {why}; console logging stops", file=sys.stderr)


class _File(logging.FileHandler):
    """The log file. When it cannot be written (a full disk, a quota, a file system gone
    read-only) it says so in one line on stderr and drops what follows, not a "--- Logging
    error ---" traceback per record; the console and the job go on."""

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError) or self.stream is None:
            super().handleError(record)
            return
        failed, self.stream = self.stream, _Nowhere()  # type: ignore[assignment]
        with contextlib.suppress(OSError):  # its buffer cannot be flushed: dropped
            failed.close()
        with contextlib.suppress(OSError):
            print(
                f"ddpkit: cannot write the log file {self.baseFilename}: "
                f"{error.strerror or error}; logging to it stops (the console goes on)",
                file=sys.stderr,
                flush=True,
            )


class RankLogging:
    """What :func:`setup_logging` installed; :meth:`close` takes it away again."""

    def __init__(self, loggers: list[logging.Logger], console: logging.Handler, rank: int) -> None:
        self.loggers, self.console, self.rank = loggers, console, rank
        self.file: logging.Handler | None = None

    def add_file(self, path: str | os.PathLike[str], fmt: str = FILE_FORMAT) -> None:
        """Also append every record to ``path`` -- on rank 0 only (other ranks: no-op)."""
        if self.rank != 0 or self.file is not None:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file = _File(path, encoding="utf-8")
        self.file.setFormatter(logging.Formatter(fmt))
        self._attach(self.file)

    def _attach(self, handler: logging.Handler) -> None:
        handler._ddpkit_rank_logging = True  # type: ignore[attr-defined]
        for lg in self.loggers:
            lg.addHandler(handler)

    def close(self) -> None:
        """Remove and close the handlers (several runs in one process, tests)."""
        for handler in (self.console, self.file):
            if handler is None:
                continue
            for lg in self.loggers:
                lg.removeHandler(handler)
            handler.close()
        self.file = None

    def __enter__(self) -> RankLogging:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def setup_logging(
    *names: str,
    level: int = logging.INFO,
    others_level: int = logging.WARNING,
    fmt: str = "%(message)s",
    rank: int | None = None,
) -> RankLogging:
    """Console logging for a job in one call: rank 0 prints ``level`` and up to stdout; every
    other rank prints only ``others_level`` and up (and ``extra={"all_ranks": True}`` records)
    to stderr, prefixed ``[rank N]``.

    ``names``: the loggers to set up (default: the root logger); they stop propagating, so
    nothing prints twice. Calling it again replaces what an earlier call installed.
    ``rank`` None reads it from torch.distributed or the launcher's variables.
    """
    rank = current_rank() if rank is None else rank
    loggers = [logging.getLogger(n) for n in names] or [logging.getLogger()]
    for lg in loggers:
        for old in [h for h in lg.handlers if getattr(h, "_ddpkit_rank_logging", False)]:
            lg.removeHandler(old)
            old.close()
        lg.setLevel(min(level, others_level))
        if names:
            lg.propagate = False
    console = _Console(sys.stdout if rank == 0 else sys.stderr)
    console.setFormatter(logging.Formatter(fmt if rank == 0 else f"[rank {rank}] {fmt}"))
    console.setLevel(level)
    console.addFilter(RankZeroFilter(rank, others_level=others_level))
    out = RankLogging(loggers, console, rank)
    out._attach(console)
    return out


def rank_zero_only(fn: Callable[P, R]) -> Callable[P, R | None]:
    """Decorator: run ``fn`` on rank 0, return None elsewhere (rank read at each call)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
        if current_rank() == 0:
            return fn(*args, **kwargs)
        return None

    return wrapper
