"""How a run ends: its result (the exit status the CLI exits with) and, for a run that failed,
the stop event that lets the report tell it from a kill."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import ckptstore
import slurmclock

from . import logs
from .console import Console
from .resume import first_line

log = logging.getLogger("pyrecover_train")

# The job's exit codes are slurmclock's (its supervisor acts on them): 1 a crash, 74 (EX_IOERR)
# the store did not answer at the start or the final save; 0, 2 and 75 likewise.
EXIT_ERROR = slurmclock.EXIT_ERROR
EXIT_STORE_UNAVAILABLE = slurmclock.EXIT_STORE_UNAVAILABLE


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf: nothing more is saved, so good checkpoints are not replaced."""

    @classmethod
    def at(cls, what: str, step: int, last_saved: int | None) -> TrainingDiverged:
        """``what`` went wrong at ``step``: the one line says which checkpoints stand."""
        return cls(
            f"{what} at step {step}: stopping without saving (the checkpoints hold step "
            f"{last_saved} and earlier); resume from one with a lower --learning-rate or "
            "--grad-clip"
        )


@dataclass(slots=True)
class RunResult:
    """What a run did; ``exit_code`` is the process's exit status."""

    exit_code: int
    step: int
    start_step: int
    reason: str
    final_loss: float | None = None
    val_loss: float | None = None
    exp_dir: Path | None = None
    metrics_path: Path | None = None


def exit_code_of(e: BaseException) -> int:
    """What the CLI exits with for ``e``: 74 an outage, 2 a store or plugin setting, else 1."""
    if isinstance(e, ckptstore.StoreUnreachableError):
        return EXIT_STORE_UNAVAILABLE
    if isinstance(e, (ckptstore.StoreConfigError, ckptstore.PluginError)):
        return slurmclock.EXIT_USAGE
    return EXIT_ERROR


def record_error(console: Console, step: int, e: BaseException) -> None:
    """A stop event for a run that failed, so the report can tell it from a kill; the
    traceback goes to train.log (the console gets the CLI's one line)."""
    logs.exception_to_file(f"step {step}: {type(e).__name__}: {e}")
    try:
        console.event(
            "stop",
            step=step,
            reason=f"{type(e).__name__}: {first_line(e)}",
            cause="error",
            exit_code=exit_code_of(e),
        )
    except Exception as again:  # the metrics file itself may be what failed
        log.debug("could not record the error: %s", again)
