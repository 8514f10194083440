"""Logging set-up: rank 0 prints progress to stdout and appends everything to EXP_DIR/train.log;
other ranks only print warnings and errors, prefixed with their rank."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOGGER_NAMES = ("pyrecover_train", "slurmclock", "ddpkit", "ckptstore", "parquetlm")
log = logging.getLogger("pyrecover_train")


class _Handlers:
    stream: logging.Handler | None = None
    file: logging.Handler | None = None


_handlers = _Handlers()


def setup(rank: int) -> None:
    """Console logging for this process (idempotent). Seam: ddpkit's rank-0 logging filter."""
    if _handlers.stream is not None:
        return
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    prefix = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    _handlers.stream = handler
    for name in LOGGER_NAMES:
        lg = logging.getLogger(name)
        lg.setLevel(logging.INFO)
        lg.addHandler(handler)
        lg.propagate = False


def add_file(path: Path) -> None:
    """Also append to ``path`` (rank 0 only; called once the run is known to start)."""
    if _handlers.file is not None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    _handlers.file = handler
    for name in LOGGER_NAMES:
        logging.getLogger(name).addHandler(handler)


def exception_to_file(message: str) -> None:
    """The exception being handled, with its traceback, in train.log only: the console gets the
    one line the CLI prints, the file keeps what a bug report needs."""
    if _handlers.file is None:
        return
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, (), sys.exc_info())
    _handlers.file.handle(record)


def teardown() -> None:
    """Remove and close the handlers (tests run several trainings in one process)."""
    for handler in (_handlers.stream, _handlers.file):
        if handler is None:
            continue
        for name in LOGGER_NAMES:
            logging.getLogger(name).removeHandler(handler)
        handler.close()
    _handlers.stream = _handlers.file = None
