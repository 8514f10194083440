"""One run of the trainer in a process: the stop signals armed first, the process group
joined (a stop signal ends the wait for the other ranks), logs, and the :class:`Trainer` closed
whatever happens."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

import ddpkit
import slurmclock

from . import build, logs
from .config import TrainConfig
from .startup import Startup
from .store_waits import deadline_at_start, dist_timeout
from .trainer import RunResult, Trainer

__all__ = ["import_checkpoint", "train"]


def train(
    cfg: TrainConfig,
    *,
    signals: slurmclock.StopSignals | None = None,
    startup: Startup | None = None,
) -> RunResult:
    """Run training as configured; returns its result (the CLI exits with ``exit_code``).

    ``signals``: the stop flag for SIGUSR2/SIGTERM, already installed (the command line arms it
    before importing torch); None installs one for the call. ``startup``: the start-up marks so
    far (None: counted from this call). Raises :class:`UsageError` for bad input found during
    set-up (nothing written by then).
    """
    return _session(cfg, lambda t: t.fit(), signals, startup)


def import_checkpoint(
    cfg: TrainConfig,
    *,
    signals: slurmclock.StopSignals | None = None,
    startup: Startup | None = None,
) -> RunResult:
    """Start from ``cfg.resume_from_checkpoint`` (another tool's checkpoint, :mod:`.foreign`)
    and save it as this experiment's checkpoint at its step, without training."""
    return _session(cfg, lambda t: t.save_imported(), signals, startup)


def _session(
    cfg: TrainConfig,
    body: Callable[[Trainer], RunResult],
    signals: slurmclock.StopSignals | None,
    startup: Startup | None,
) -> RunResult:
    # Armed first: SLURM's warning signal may come while the corpus is still being prepared.
    own = signals is None
    flag = slurmclock.StopSignals(slurmclock.STOP_SIGNALS).install() if signals is None else signals
    stop = stop_flag(flag, cfg)
    startup = Startup.now() if startup is None else startup
    try:
        info = build.check_launcher(cfg)
        logs.setup(info.rank)
        deadline = deadline_at_start(cfg)  # bounds each collective and the store's first contact
        try:  # a stop signal ends the wait for the other ranks at once
            dist = build.join(cfg, abort=_stop_requested(stop), timeout=dist_timeout(deadline))
        except ddpkit.InitInterrupted as e:
            return _interrupted(e, stop)
        with dist:
            startup.mark("setup")
            trainer = Trainer(cfg, dist, stop, startup=startup, deadline=deadline)
            try:
                return body(trainer)
            except Exception as e:
                trainer.record_error(e)
                raw = dist.distributed and not isinstance(e, ddpkit.PeerError)
                if raw and ddpkit.is_peer_failure(e):
                    # e.g. DDP's all-reduce in backward() when a peer died (watchdog off):
                    # one line naming the silent rank, not the backend's traceback
                    raise dist.peer_error("training", e) from e
                raise
            finally:
                trainer.close()
    finally:
        logs.teardown()
        if own:
            flag.restore()


def stop_flag(signals: slurmclock.StopSignals, cfg: TrainConfig) -> slurmclock.StopFlag:
    """Every source of "stop" as one flag, which the wait at the rendezvous and the trainer's
    loop both read. A new source (a file to watch, a cloud's preemption notice: any
    :class:`slurmclock.StopFlag`, set up from ``cfg``) is one more argument here."""
    return slurmclock.AnyFlag(signals)


def _stop_requested(flag: slurmclock.StopFlag) -> Callable[[], bool]:
    """For the wait at the rendezvous: a stop signal ends it; SLURM's warning only when its lead
    is unknown (with PYRECOVER_SIGNAL_LEAD it is information for the time budget)."""
    meaning = slurmclock.SignalMeaning.from_env()
    return lambda: meaning.stop_now(flag) is not None


def _interrupted(e: ddpkit.InitInterrupted, signals: slurmclock.StopFlag) -> RunResult:
    """A stop signal came while waiting for the other ranks: one line, exit 128 + signal
    (as if the signal had ended the process; nothing was written)."""
    signum = e.signum
    if signum is None and signals.received:  # abort(): our own flag saw the signal
        signum = int(getattr(signal, signals.received, signal.SIGTERM))
    signum = signum or int(signal.SIGTERM)
    print(f"pyrecover-train: {e}", file=sys.stderr, flush=True)
    return RunResult(exit_code=128 + signum, step=0, start_step=0, reason=str(e))
