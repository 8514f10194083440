"""Logging set-up: rank 0 prints progress to stdout and appends everything to EXP_DIR/train.log;
other ranks only print warnings and errors, prefixed with their rank (ddpkit's policy). Python
``warnings`` (a token cache rebuilt, a library's deprecation) become one log line each, there
too, instead of Python's two lines with a source line."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from pathlib import Path

import ddpkit
from ckptstore import CheckpointWarning

LOGGER_NAMES = ("pyrecover_train", "slurmclock", "ddpkit", "ckptstore", "parquetlm")
log = logging.getLogger("pyrecover_train")


class _Installed:
    logging: ddpkit.RankLogging | None = None
    warnings: warnings.catch_warnings[None] | None = None


_installed = _Installed()


def setup(rank: int) -> None:
    """Console logging for this process (idempotent)."""
    if _installed.logging is None:
        _installed.logging = ddpkit.setup_logging(*LOGGER_NAMES, rank=rank)
        _installed.warnings = warnings.catch_warnings()
        _installed.warnings.__enter__()
        warnings.showwarning = lambda message, *_, **__: log.warning("warning: %s", message)
        # ckptstore logs each CheckpointWarning itself (a skipped checkpoint): once is enough.
        warnings.simplefilter("ignore", CheckpointWarning)


def add_file(path: Path) -> None:
    """Also append to ``path`` (rank 0 only; called once the run is known to start). A file
    that cannot be opened (a full disk) is said in one line, and the run goes on without it."""
    if _installed.logging is None:
        return
    try:
        _installed.logging.add_file(path)
    except OSError as e:
        say_warning(
            f"cannot write the log file {path}: {e.strerror or e}; training goes on "
            "without it (the console has every line)"
        )


def exception_to_file(message: str) -> None:
    """The exception being handled, with its traceback, in train.log only: the console gets the
    one line the CLI prints, the file keeps what a bug report needs."""
    handler = None if _installed.logging is None else _installed.logging.file
    if handler is None:
        return
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, (), sys.exc_info())
    handler.handle(record)


def say_warning(message: str) -> None:
    """A warning about the user's input (rank 0): one line on stderr, where rank 0's progress
    on stdout does not bury it, and the same line in train.log."""
    with contextlib.suppress(OSError):  # stderr on a full disk too: train.log may still take it
        print(f"pyrecover-train: warning: {message}", file=sys.stderr, flush=True)
    handler = None if _installed.logging is None else _installed.logging.file
    if handler is not None:
        handler.handle(log.makeRecord(log.name, logging.WARNING, __file__, 0, message, (), None))


def teardown() -> None:
    """Remove and close the handlers (tests run several trainings in one process)."""
    if _installed.logging is not None:
        _installed.logging.close()
    if _installed.warnings is not None:
        _installed.warnings.__exit__(None, None, None)
    _installed.logging, _installed.warnings = None, None
