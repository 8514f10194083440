"""``pyrecover-train [train] [FLAGS]``, ``pyrecover-train report EXP_DIR`` and
``pyrecover-train import-checkpoint SOURCE [FLAGS]``.

Exit status of ``train``: 0 finished all --training-steps; 75 (EX_TEMPFAIL) stopped early for
time or by a signal, a checkpoint was saved and a requeue is wanted; 74 (EX_IOERR) the checkpoint
store did not answer, at the start or at the final save (nothing durable was lost: start again
once it is back); 1 error; 2 usage error (nothing written); every command: 141 quietly when the
reader of stdout left early (``| head -1``), as SIGPIPE gives. ``python -m pyrecover_train`` is
the same command.

Only the standard library and slurmclock (stdlib only) are imported before :func:`main` runs:
the stop signals' flag-only handlers are armed first thing, then torch is imported (seconds). A
SIGUSR2 (SLURM's warning) or SIGTERM that arrives while torch is still being imported would
otherwise kill the process (their default action) instead of being read by the time budget.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

import slurmclock

from .startup import Startup

if TYPE_CHECKING:
    from .config import TrainConfig

PROG = "pyrecover-train"
log = logging.getLogger("pyrecover_train")
IMPORT_USAGE = (
    f"usage: {PROG} import-checkpoint SOURCE [FLAGS]: a torch.save file (an original PyRecover "
    "ckpt_N.pt too), a dcp.save folder, a safetensors file, a Lightning .ckpt or a Hugging Face "
    "Trainer checkpoint-N folder becomes the first checkpoint of --experiment_name (with the "
    "--model-size, --tokenizer, ... it was trained with); then resume with "
    "--resume-from-checkpoint latest"
)
INTERRUPTED = "interrupted before training started; nothing was saved"


PEER_NOTE = (
    "the checkpoints are untouched; the traceback is in train.log: resume with "
    "--resume-from-checkpoint latest (slurmclock supervise requeues the job by itself)"
)
STORE_NOTE = "exit 74: nothing durable was lost; run it again once the store answers"
DATA_ERROR_NOTE = (
    "no batch of it was trained on and the checkpoints are untouched: fix it, then resume with "
    "--resume-from-checkpoint latest"
)


def main(argv: list[str] | None = None) -> int:
    # As the process's entry point (argv None) this process owns its signals: arm the flag
    # before anything heavy is imported. A caller in-process owns its own signals.
    entry = argv is None
    signals = _arm_stop_signals() if entry else None
    startup = Startup.at_process_start() if entry else Startup.now()
    try:
        code = _main(sys.argv[1:] if argv is None else list(argv), signals, startup)
        _flush_stdout()  # a closed pipe shows here, not as a message at interpreter exit
    except BrokenPipeError:  # `report ... | head -1`: the reader left early; quiet, as SIGPIPE
        _stdout_to_devnull()  # nothing left to flush
        code = 141
    except KeyboardInterrupt:  # Ctrl-C while torch is imported, before the run took it over
        print(f"{PROG}: {INTERRUPTED}", file=sys.stderr)
        code = 130
    finally:
        if signals is not None:
            # SLURM's warning and its SIGTERM come on their own schedule: one may arrive after
            # the run stopped by itself and saved. It must not turn a clean exit 75 into "killed
            # by a signal", which the sbatch script would not requeue: ignored from here on.
            signals.restore()
    if entry:  # without the interpreter's teardown of torch: 1 s idle, 15 s on a loaded node
        slurmclock.end_process(code)
    return code


def _main(args: list[str], signals: slurmclock.StopSignals | None, startup: Startup) -> int:
    if args and args[0] == "report":
        from . import report

        return report.main(args[1:])
    from .config import UsageError, config_from_args  # imports torch (the model presets)

    command = "train"
    if args and args[0] in ("train", "import-checkpoint"):
        command, args = args[0], args[1:]
    if command == "import-checkpoint":
        if not args or args[0].startswith("-"):
            print(IMPORT_USAGE, file=sys.stderr if args[:1] != ["--help"] else sys.stdout)
            return 0 if args[:1] == ["--help"] else 2
        args = [*args[1:], "--resume-from-checkpoint", args[0]]
    try:
        cfg = config_from_args(args)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return int(e.code or 0)
    except UsageError as e:
        return _usage(e)
    return _run(cfg, command, signals, startup)


def _run(
    cfg: TrainConfig, command: str, signals: slurmclock.StopSignals | None, startup: Startup
) -> int:
    import ddpkit
    from ckptstore import (
        CheckpointError,
        PluginError,
        StoreConfigError,
        StoreUnreachableError,
        check_plugins,
    )
    from parquetlm import ParquetLMError

    from .config import UsageError
    from .corpus import CorpusMissingError
    from .session import import_checkpoint, train
    from .trainer import EXIT_STORE_UNAVAILABLE, OutOfMemory, TrainingDiverged

    startup.mark("imports")
    try:
        check_plugins()  # a broken format or storage plugin: one line, before any training
        run = import_checkpoint if command == "import-checkpoint" else train
        return run(cfg, signals=signals, startup=startup).exit_code
    except (UsageError, CorpusMissingError) as e:  # no default corpus: its install line
        return _usage(e)
    except (StoreConfigError, PluginError) as e:  # a setting: a retry cannot help
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except StoreUnreachableError as e:  # not the run's fault: the same start works later
        print(f"{PROG}: error: {e} ({STORE_NOTE})", file=sys.stderr)
        return EXIT_STORE_UNAVAILABLE
    except (TrainingDiverged, CheckpointError, OutOfMemory) as e:
        # Their messages say what happened and what to do; the traceback is in train.log.
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except ddpkit.PeerError as e:  # another rank died or stalled: the job is retried
        print(f"{PROG}: error: {e} ({PEER_NOTE})", file=sys.stderr)
        return ddpkit.EXIT_PEER_LOST
    except ParquetLMError as e:  # e.g. a token cache damaged on disk, found mid-run
        print(f"{PROG}: error: data: {e} ({DATA_ERROR_NOTE})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: {INTERRUPTED}", file=sys.stderr)
        return 130
    except Exception as e:
        logging.getLogger("pyrecover_train").addHandler(logging.StreamHandler(sys.stderr))
        log.exception("%s: error: %s: %s", PROG, type(e).__name__, e)
        return 1


def _flush_stdout() -> None:
    """Raises BrokenPipeError when the reader left; stdout written to a full disk loses its
    tail, but not the exit status of what ran (a saved run's 75 must stay 75)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError:
        _stdout_to_devnull()


def _stdout_to_devnull() -> None:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _arm_stop_signals() -> slurmclock.StopSignals:
    """Flag-only handlers for SIGUSR2 and SIGTERM, over SIG_IGN (what stays once they are
    restored). The trainer reads this flag: a signal that came during start-up is not lost."""
    for name in slurmclock.STOP_SIGNALS:  # SLURM's warning (information for the budget), stop now
        signal.signal(slurmclock.signal_number(name), signal.SIG_IGN)
    return slurmclock.StopSignals(slurmclock.STOP_SIGNALS).install()


def _usage(e: Exception) -> int:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
