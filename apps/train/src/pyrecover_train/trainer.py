"""The training run: set-up (build.py), resume (resume.py), then the loop of :meth:`Trainer.fit`
(session.py runs it in a process group with its signals and logs).

    per step: train step -> progress line -> evaluation (every --eval-every)
              -> finished background saves refine the save-time estimate
              -> slurmclock's TimeLoop: stop? save? (one agreement across ranks)
              -> the save it asks for: periodic (async with --async-checkpoint), or the final
                 one (blocking), or, after a stop for time, an extra one after more training
    exit 75 after a stop with steps left, 0 when --training-steps are done

A store that does not answer (ckptstore's StoreUnreachableError) does not end the run: periodic
saves wait for it (retried with a doubling pause, ckptstore's Outage), the final save is retried
while the time allows, then the run exits 74 with the last durable checkpoint intact.

The protocol -- when to stop, the final save, extra saves and their abandon (exit 75 at once,
the last durable save stands), the exit codes, the job timeline's marks -- is slurmclock's
:class:`~slurmclock.TimeLoop`, shared with the Lightning and Hugging Face callbacks. This module
only trains, evaluates, saves and reports. Exit status: 0 finished, 75 stopped early (requeue
wanted), 1 error, 2 usage error.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ckptstore
import ddpkit
import slurmclock

from . import build, logs
from .config import TrainConfig, UsageError
from .console import Console, HangupAware, LossWindow
from .dryrun import dry_run
from .metrics import VAL_LOSS
from .perf import peak_flops
from .profiling import StepProfiler
from .resume import Resume, first_line
from .save_schedule import SaveSchedule
from .startup import Startup
from .step import OutOfMemory, Stepper, memory_guard

__all__ = [
    "EXIT_ERROR",
    "EXIT_STORE_UNAVAILABLE",
    "OutOfMemory",
    "RunResult",
    "Trainer",
    "TrainingDiverged",
]

log = logging.getLogger("pyrecover_train")


# The job's exit codes are slurmclock's (its supervisor acts on them): 1 a crash, 74 (EX_IOERR)
# the store did not answer at the start or the final save; 0, 2 and 75 likewise.
EXIT_ERROR = slurmclock.EXIT_ERROR
EXIT_STORE_UNAVAILABLE = slurmclock.EXIT_STORE_UNAVAILABLE
# How long one wait on the store may last: this many measured saves, at least STORE_CALL_MIN_S;
# before a save is measured (the first contact, the resume), STORE_CALL_FIRST_S.
STORE_CALL_SAVES = 4.0
STORE_CALL_MIN_S = 10.0
STORE_CALL_FIRST_S = 30.0
STORE_CALL_LATE_S = 5.0  # what a call gets however late it is
STOP_KILL_WAIT_S = 30.0  # without a deadline: a stop's kill follows this late (SLURM's KillWait)


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


def _deadline_at_start(cfg: TrainConfig) -> slurmclock.Deadline:
    """One look at the deadline before the budget watches it (a failed look: none)."""
    try:
        return slurmclock.find_deadline(time_limit=cfg.time_limit, command_timeout=5.0)
    except Exception as e:  # the budget looks again and says what is wrong
        log.debug("no deadline at the start: %s", e)
        return slurmclock.Deadline(None, "unknown at the start")


def _exit_code_of(e: BaseException) -> int:
    """What the CLI exits with for ``e``: 74 an outage, 2 a store or plugin setting, else 1."""
    if isinstance(e, ckptstore.StoreUnreachableError):
        return EXIT_STORE_UNAVAILABLE
    if isinstance(e, (ckptstore.StoreConfigError, ckptstore.PluginError)):
        return slurmclock.EXIT_USAGE
    return EXIT_ERROR


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf: nothing more is saved, so good checkpoints are not replaced."""


class Trainer:
    """One process's share of a training run: set-up in ``__init__``, the loop in ``fit``."""

    def __init__(
        self,
        cfg: TrainConfig,
        dist: ddpkit.Dist,
        signals: slurmclock.StopFlag,
        *,
        clock: Callable[[], float] = time.time,
        startup: Startup | None = None,
    ) -> None:
        self.cfg, self.dist, self.device = cfg, dist, dist.device
        self.startup = Startup.now() if startup is None else startup
        self.interrupt = HangupAware(("INT", "HUP"))  # installed when the loop starts
        self.stop_flag = slurmclock.AnyFlag(signals, self.interrupt)
        self.console = Console(cfg, rank=dist.rank, world_size=dist.world_size)
        self._start_deadline = _deadline_at_start(cfg)  # bounds the store's first contact
        parts = build.parts(cfg, dist, phase=self.startup.mark, limits=self._store_limits())
        self.precision, self.data, self.model_cfg = parts.precision, parts.data, parts.model_cfg
        self.state, self.store = parts.state, parts.store
        self.stepper = Stepper(
            cfg, self.state, parts.train_model, self.precision, before_update=self.store.staged
        )
        try:  # may raise UsageError: nothing has been written yet
            self._resume(parts)
        except BaseException:
            parts.undo()  # nothing written: the lock released, the folders it made removed
            raise
        self.startup.mark("resume")
        self.start_step = self.state.step
        self.async_saves = build.async_saves(cfg, self.device)
        self.schedule = SaveSchedule(
            cfg, saved_step=self.state.step if self.resumed_from else None, clock=clock
        )
        self.loop = slurmclock.TimeLoop(  # rank 0 decides; one agreement per step
            self.budget,
            leader=dist.rank == 0,
            agree=dist.agree,
            share=dist.broadcast_object,
            extra_saves=cfg.extra_saves,
            background_saves=self.async_saves,
            on_abandon=self._abandoned,
            launch=self.startup.launch,  # measured after the first step (one squeue)
        )
        self.profiler = StepProfiler(cfg, self.device, dist.rank)
        self.outage = ckptstore.Outage()  # the store not answering: each rank alike
        self.last_loss: float | None = None
        self.last_val: float | None = None
        self.evaluated_at: int | None = None
        self.window: LossWindow  # losses since the last progress line: made when the loop starts

    def _store_limits(self) -> ckptstore.CallLimits:
        """Each wait on the store: a few measured saves at most (a stalled connection is
        dropped; the store's next answer gets a new one), never past the time left for the
        exit, and ended within seconds of a stop (once past a measured save's length)."""
        return ckptstore.CallLimits(
            call_s=self._store_call_s,
            time_left=self._store_time_left,
            stopping=lambda: len(self.stop_flag.arrivals),  # a second signal: now
            expected_s=self._store_expected_s,
        )

    def _store_expected_s(self) -> float:
        """What a healthy call may take (twice the median measured save): a stop does not
        end it sooner."""
        store = getattr(self, "store", None)
        median = store.save_timings.median_s if store is not None else None
        return 2 * median if median else 0.0

    def _store_call_s(self) -> float:
        budget = getattr(self, "budget", None)  # None while the store is opened and read
        save = budget.save_estimate if budget is not None else None
        return max(STORE_CALL_MIN_S, STORE_CALL_SAVES * save) if save else STORE_CALL_FIRST_S

    def _store_time_left(self) -> float | None:
        """Seconds until any wait on the store must end: the time left less the exit's (at
        the start, before the budget: the deadline less STORE_CALL_MIN_S for the exit), and
        never under STORE_CALL_LATE_S: past the deadline SLURM's KillWait is still to come
        and a commit is atomic, so a late try costs nothing and may save the steps."""
        budget = getattr(self, "budget", None)
        if budget is None:
            left = self._start_deadline.seconds_left()
            bound = None if left is None else left - STORE_CALL_MIN_S
        else:
            left = budget.seconds_left()
            bound = None if left is None else left - budget.needed_after_save()
        return None if bound is None else max(bound, STORE_CALL_LATE_S)

    def _resume(self, parts: build.Parts) -> None:
        """The checkpoint to resume from (if any) loaded, and the time budget with the figures
        the earlier allocations measured."""
        cfg = self.cfg
        resume = Resume(cfg, self.store, self.state, self.dist)
        self.resumed_from = resume.run(parts.start)
        self.budget = build.budget(cfg, self.state.model, self.stop_flag, resumed=resume.metadata)

    # -- the loop ---------------------------------------------------------------------------

    def fit(self) -> RunResult:
        cfg, s = self.cfg, self.state
        self._open_outputs()
        if cfg.dry_run:
            return self._dry_run()
        if s.step >= cfg.training_steps:
            log.info("already at step %d of %d: nothing to do", s.step, cfg.training_steps)
            return self._finish("already finished")
        self.interrupt.install()  # from here on Ctrl-C or a closed terminal: save and stop
        self.window = LossWindow(self.device, each=cfg.log_loss_to_csv)
        self.loop.begin()
        while self.loop.training:
            seconds = self._train_step()
            evaluated = self._evaluate_if_due()
            self._record_finished_saves()
            due, last = self.schedule.due(s.step, evaluated), s.step >= cfg.training_steps
            if self.outage.active:  # the store did not answer: tried again after a pause
                due = self.outage.due()
            act = self.loop.after_step(s.step, seconds=seconds, save_due=due, last=last)
            if act.save:
                self._save_as_asked(act)
        return self._finish(self._reason())

    def _train_step(self) -> float:
        """One optimizer step (with its progress line); returns its seconds."""
        cfg, s = self.cfg, self.state
        t0 = time.perf_counter()
        with self.profiler.around(s.step + 1), memory_guard(cfg, f"step {s.step + 1}"):
            self.window.add(self.stepper.train_step())
        s.step += 1
        if s.step == self.start_step + 1:
            self._first_step_done()
        if s.step % cfg.log_every == 0 or s.step == cfg.training_steps:
            self._progress(self.window.take())
        return time.perf_counter() - t0

    def _save_as_asked(self, act: slurmclock.Action) -> None:
        """The save the loop asked for. A final or extra one is durable before the loop goes on
        (with a background save still in flight: the final save must not wait for it later); a
        final one replaces a periodic save of the same step, which holds the same state."""
        step = self.state.step
        if act.durable:
            self._say_stop(act)
        with self.loop.saving(act):  # an extra save: abandoned if not durable in time
            t0 = time.perf_counter()
            try:
                if act.save != "final" or self.schedule.unsaved(step):
                    self.save(kind=str(act.save), blocking=act.durable or not self.async_saves)
                if act.durable:
                    self.store.wait()
            except ckptstore.StoreUnreachableError as e:
                self._store_down(act, e, time.perf_counter() - t0)
            if act.durable:
                self._record_finished_saves()

    def save(self, *, kind: str, blocking: bool) -> None:
        """One checkpoint of the state now (the store snapshots it; async: persists later)."""
        self._check_finite()
        t0 = time.perf_counter()
        payload, metadata = self._checkpoint()
        blocking = blocking or self.outage.active  # a try in an outage: known at once
        self.store.save(
            self.state.step, payload, metadata=metadata, blocking=blocking, overlap=True
        )  # async: the snapshot is taken beside the next forward and backward
        if (line := self.outage.saved(self.state.step)) and self.dist.rank == 0:
            log.warning("%s", line)
        blocking_s = time.perf_counter() - t0
        self.schedule.saved(self.state.step, blocking_s)
        extra: dict[str, Any] = {}
        if self.cfg.checkpoint_interval_seconds is not None:
            extra["interval_s"] = self.schedule.interval()  # until the next time-based save
        fields = {"kind": kind, "blocking_s": blocking_s, "async": not blocking, **extra}
        self.console.event("save", step=self.state.step, **fields)
        log.debug("step %d: %s save started (%.2f s blocking)", self.state.step, kind, blocking_s)
        if kind == "periodic":  # the others are recorded by their caller, once durable
            self._record_finished_saves()

    def _store_down(self, act: slurmclock.Action, error: BaseException, seconds: float) -> None:
        """A save the store did not take (it did not answer): a periodic one waits for the
        store while training goes on; the final one is tried again while the time allows;
        then (and for an extra save) exit 74, the last durable checkpoint intact."""
        line = self.outage.failed(self.state.step, error, seconds)
        if line and self.dist.rank == 0:
            log.warning("%s", line)
        if act.save == "final":
            self._retry_final()
        elif act.save != "periodic":
            raise ckptstore.StoreUnreachableError(self._gave_up()) from error

    def _retry_final(self) -> None:
        """The final save again, after the outage's pause, while a try still fits before the
        exit (rank 0 decides for every rank: each try is a collective)."""
        while True:
            pause = self.outage.final_pause(self._time_for_a_try()) if self.dist.rank == 0 else None
            pause = self.dist.broadcast_object(pause)
            if pause is None:
                raise ckptstore.StoreUnreachableError(self._gave_up())
            time.sleep(pause)
            t0 = time.perf_counter()
            try:
                self.save(kind="final", blocking=True)
                self.store.wait()
                return
            except ckptstore.StoreUnreachableError as e:
                self.outage.failed(self.state.step, e, time.perf_counter() - t0)

    def _time_for_a_try(self) -> float | None:
        """Seconds a final save may still take (None: no deadline and no stop): the loop's
        answer with a deadline; without one, until the kill a stop announces (none once asked
        twice), less the exit's share and a save's measured length."""
        with_deadline = self.loop.final_try_time()
        if with_deadline is not None:
            return with_deadline
        since = self.stop_flag.received_at  # no deadline, but a stop: its kill follows
        if since is None:
            return None
        if len(self.stop_flag.arrivals) > 1:
            return 0.0  # asked twice: no further try
        left = since + STOP_KILL_WAIT_S - time.time()
        return left - self.budget.needed_after_save() - (self.budget.save_estimate or 0.0)

    def _gave_up(self) -> str:
        durable = self.loop.durable_step
        if durable is None and self.resumed_from:
            durable = self.start_step
        return self.outage.gave_up(self.state.step, durable)

    def _say_stop(self, act: slurmclock.Action) -> None:
        """Before a final or extra save: why, and the losses since the last progress line."""
        step = self.state.step
        if act.save == "final":
            how = "stopping early" if self.loop.stopped_early else "finished"
            log.info("step %d: %s (%s)", step, how, self._reason())
        self.console.loss_rows(step, self.window.take()[3])

    def _reason(self) -> str:
        if self.loop.finished or self.loop.cause is None:
            return f"reached --training-steps {self.cfg.training_steps}"
        return self.loop.reason

    def _abandoned(self, message: str) -> None:
        """On the watchdog thread, just before the process exits 75: the stop event and the
        summary say which checkpoint stands."""
        if self.loop.durable_step is not None:
            self.state.step = self.loop.durable_step  # what the next allocation resumes from
        try:
            self._finish(f"{self.loop.reason}; {message}")
        finally:
            self.console.close()

    # -- steps, evaluation, saves -----------------------------------------------------------

    def _progress(self, window: tuple[float, int, float, list[float]]) -> None:
        loss, step = window[0], self.state.step
        self.last_loss = loss
        if not math.isfinite(loss) and self.state.scaler is None:  # fp16 skips inf steps
            raise TrainingDiverged(
                f"the loss is {loss} at step {step}: stopping without saving (the checkpoints "
                f"hold step {self.schedule.last_step} and earlier); resume from one with a lower "
                "--learning-rate or --grad-clip"
            )
        grad_norm = self.stepper.grad_norm
        self.console.progress(
            step,
            window,
            lr=float(self.state.scheduler.get_last_lr()[0]),
            grad_norm=None if grad_norm is None else float(grad_norm),
            seconds_left=self.budget.seconds_left() if self.dist.rank == 0 else None,
            data_position=self.state.loader.position,
        )

    def _evaluate_if_due(self) -> bool:
        cfg, step = self.cfg, self.state.step
        if not cfg.eval_every or self.data.val is None:
            return False
        if step % cfg.eval_every and step != cfg.training_steps:
            return False
        t0 = time.perf_counter()
        with memory_guard(cfg, f"the evaluation at step {step}"):
            mean = self.stepper.validation_loss(self.data.val)
        many = self.dist.world_size > 1
        val = float(self.dist.all_reduce(mean, op="mean")) if many else float(mean)
        self.last_val, self.evaluated_at = val, step
        self.console.evaluation(step, val, time.perf_counter() - t0)
        return True

    def _checkpoint(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(what a save writes, its JSON metadata). Every rank's RNG states go into one entry,
        so every rank saves the same content."""
        s, cfg = self.state, self.cfg
        rng = ddpkit.capture_rng(self.dist)  # a collective: {"rank0": ..., "rank1": ...}
        meta: dict[str, Any] = {
            "step": s.step,
            "model": self.model_cfg.to_dict(),
            "model_size": cfg.model_size,
            "args": cfg.to_dict(),
            "world_size": self.dist.world_size,
            "tokenizer": self.data.tokenizer.fingerprint(),
            "data_key": s.loader.key,
            "tokens_seen": s.loader.position * cfg.sequence_length,
            "metrics": {"loss": self.last_loss, VAL_LOSS: self.last_val},
            "time_budget": self.budget.state_dict(),  # the next allocation starts from these
        }
        if self.last_val is not None and self.evaluated_at == s.step:
            meta[VAL_LOSS] = self.last_val  # only when measured at this very step
        return s.checkpoint(rng), meta

    def _check_finite(self) -> None:
        """Never save NaN/inf weights over good checkpoints (keep_last would rotate them out)."""
        if not self.state.weights_finite(self.dist):
            raise TrainingDiverged(
                f"the weights are NaN/inf at step {self.state.step}: stopping without saving "
                f"(the checkpoints hold step {self.schedule.last_step} and earlier); resume from "
                "one with a lower --learning-rate or --grad-clip"
            )

    def _record_finished_saves(self) -> None:
        """Durable saves: into the metrics, and to the loop (the budget's save times, the job's
        timeline: the final save marks where the exit begins)."""
        for stats in self.store.saves_completed():
            self.console.event("saved", **stats.to_dict())
            if stats.target == "primary":
                self.loop.saved(stats.step, stats.total_s, background=stats.background)

    # -- start, end -------------------------------------------------------------------------

    def _first_step_done(self) -> None:
        """Start-up ends with the first step: said once, in the log and the metrics. Now that
        the optimizer has its moments, async saves get their snapshot buffer, allocated in the
        background (else the first async save allocates it: 19 s for a 1.5B model's 18 GB of
        pinned memory on an H100)."""
        self.startup.mark("first step")
        if self.dist.rank == 0:
            self.startup.locate()  # one squeue, rank 0 only
        self.console.startup(self.state.step, self.startup)
        if self.async_saves:
            self.store.reserve(self.state.checkpoint({}))

    def _open_outputs(self) -> None:
        """Metrics, log file and the start/resume events, only now that the run is known to
        start, so a refused start writes nothing."""
        cfg, s = self.cfg, self.state
        self.console.open(
            flops_per_token=self.model_cfg.flops_per_token(cfg.sequence_length),
            peak=peak_flops(self.device, cfg.peak_tflops),
        )
        self.console.start(
            step=s.step,
            budget=self.budget,
            model_config=self.model_cfg.to_dict(),
            params=sum(p.numel() for p in s.model.parameters()),
            data=self.data,
            device=str(self.device),
            resumed_from=self.resumed_from,
            saves=self.schedule.describe() + (", async" if self.async_saves else ""),
            startup=self.startup,
        )

    def _finish(self, reason: str) -> RunResult:
        """The stop event and the summary; the result the CLI exits with."""
        exit_code, loop = self.loop.exit_code, self.loop
        self.profiler.close()
        self.console.stop(
            step=self.state.step,
            reason=reason,
            cause=(loop.cause if loop.stopped_early else None) or "done",
            exit_code=exit_code,
            budget=self.budget,
            losses=(self.last_loss, self.last_val),
        )
        return RunResult(
            exit_code=int(exit_code),
            step=self.state.step,
            start_step=self.start_step,
            reason=reason,
            final_loss=self.last_loss,
            val_loss=self.last_val,
            exp_dir=self.cfg.exp_dir,
            metrics_path=self.cfg.metrics_path,
        )

    def _dry_run(self) -> RunResult:
        def take_step() -> None:
            self.stepper.train_step()
            self.state.step += 1

        dry_run(self.cfg, self.dist, self.state, take_step=take_step, checkpoint=self._checkpoint)
        self.state.step = self.start_step  # nothing of the dry run is kept
        return self._finish("dry run OK")

    def save_imported(self) -> RunResult:
        """``import-checkpoint``: the imported state as this experiment's first checkpoint."""
        if (latest := self.store.latest_step()) is not None:
            raise UsageError(
                f"{self.cfg.experiment_url} already holds checkpoints (latest step {latest}): "
                "import into a new --experiment_name (nothing was changed)"
            )
        self._open_outputs()
        self.save(kind="import", blocking=True)
        self.store.wait()
        self._record_finished_saves()
        log.info(
            "imported as %s/step-%08d: continue with pyrecover-train --resume-from-checkpoint "
            "latest [same flags]",
            self.cfg.experiment_url,
            self.state.step,
        )
        return self._finish("imported")

    def record_error(self, e: BaseException) -> None:
        """A stop event for a run that failed, so the report can tell it from a kill; the
        traceback goes to train.log (the console gets the CLI's one line)."""
        logs.exception_to_file(f"step {self.state.step}: {type(e).__name__}: {e}")
        try:
            self.console.event(
                "stop",
                step=self.state.step,
                reason=f"{type(e).__name__}: {first_line(e)}",
                cause="error",
                exit_code=_exit_code_of(e),
            )
        except Exception as again:  # the metrics file itself may be what failed
            log.debug("could not record the error: %s", again)

    def close(self) -> None:
        self.interrupt.restore()
        try:
            self.store.close()
        except Exception as e:  # closing must not hide the error being raised, if any
            log.debug("closing the checkpoint store: %s", e)
        self.console.close()
