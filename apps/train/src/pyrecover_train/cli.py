"""``pyrecover-train [train] [FLAGS]``, ``pyrecover-train report EXP_DIR`` and
``pyrecover-train import-checkpoint FILE.pt [FLAGS]``.

Exit status of ``train``: 0 finished all --training-steps; 75 (EX_TEMPFAIL) stopped early for
time or by a signal, a checkpoint was saved and a requeue is wanted; 1 error; 2 usage error
(nothing written). ``python -m pyrecover_train`` is the same command.
"""

from __future__ import annotations

import logging
import signal
import sys

from .config import TrainConfig, UsageError, config_from_args

PROG = "pyrecover-train"
log = logging.getLogger("pyrecover_train")
IMPORT_USAGE = (
    f"usage: {PROG} import-checkpoint FILE.pt [FLAGS]: an original PyRecover torch.save "
    "checkpoint becomes the first checkpoint of --experiment_name (with the --model-size, "
    "--tokenizer, ... it was trained with); then resume with --resume-from-checkpoint latest"
)


DATA_ERROR_NOTE = (
    "no batch of it was trained on and the checkpoints are untouched: fix it, then resume with "
    "--resume-from-checkpoint latest"
)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] == "report":
        from . import report

        return report.main(args[1:])
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
    # SLURM's warning signal and its SIGTERM come on their own schedule: one may arrive after the
    # run stopped by itself and saved (the trainer's handlers are gone by then). It must not turn
    # a clean exit 75 into "killed by a signal", which the sbatch script would not requeue.
    # While training runs, the trainer's own handlers take them (they chain to these). Only as
    # the process's entry point (argv None): a caller in-process owns its own signals.
    if argv is None:
        _ignore_late_stop_signals()
    return _run(cfg, command)


def _run(cfg: TrainConfig, command: str) -> int:
    # torch is imported only for an actual run
    from ckptstore import CheckpointError
    from parquetlm import ParquetLMError

    from .trainer import OutOfMemory, TrainingDiverged, import_checkpoint, train

    try:
        return (import_checkpoint if command == "import-checkpoint" else train)(cfg).exit_code
    except UsageError as e:
        return _usage(e)
    except (TrainingDiverged, CheckpointError, OutOfMemory) as e:
        # Their messages say what happened and what to do; the traceback is in train.log.
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except ParquetLMError as e:  # e.g. a token cache damaged on disk, found mid-run
        print(f"{PROG}: error: data: {e} ({DATA_ERROR_NOTE})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted before training started; nothing was saved", file=sys.stderr)
        return 130
    except Exception as e:
        logging.getLogger("pyrecover_train").addHandler(logging.StreamHandler(sys.stderr))
        log.exception("%s: error: %s: %s", PROG, type(e).__name__, e)
        return 1


def _ignore_late_stop_signals() -> None:
    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _usage(e: UsageError) -> int:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
