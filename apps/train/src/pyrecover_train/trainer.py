"""The training run: set-up (build.py), resume (resume.py), then the loop of :meth:`Trainer.fit`
(session.py runs it in a process group with its signals and logs).

    per step: train step -> progress line -> evaluation (every --eval-every)
              -> finished background saves refine the save-time estimate
              -> slurmclock's TimeLoop: stop? save? (one agreement across ranks)
              -> the save it asks for: periodic (async with --async-checkpoint), or the final
                 one (blocking), or, after a stop for time, an extra one after more training
    exit 75 after a stop with steps left, 0 when --training-steps are done

A store that does not answer does not end the run (outage.py): periodic saves wait for it, the
final save is retried while the time allows, then the run exits 74, the last checkpoint intact.
Every wait on the store is bounded by the time left (store_waits.py).

The protocol -- when to stop, the final save, extra saves and their abandon (exit 75 at once,
the last durable save stands), the exit codes, the job timeline's marks -- is slurmclock's
:class:`~slurmclock.TimeLoop`, shared with the Lightning and Hugging Face callbacks. This module
only trains, evaluates, saves and reports. Exit status (outcome.py): 0 finished, 75 stopped
early (requeue wanted), 1 error, 2 usage error, 74 the store did not answer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import ckptstore
import ddpkit
import slurmclock

from . import build, outcome
from .config import TrainConfig, UsageError
from .console import Console, HangupAware, LossWindow
from .dryrun import dry_run
from .metrics import VAL_LOSS
from .outage import StoreOutage
from .outcome import EXIT_ERROR, EXIT_STORE_UNAVAILABLE, RunResult, TrainingDiverged
from .perf import peak_flops
from .profiling import StepProfiler
from .resume import Resume
from .save_schedule import SaveSchedule
from .startup import Startup
from .step import OutOfMemory, Stepper, memory_guard
from .store_waits import StoreWaits

__all__ = [
    "EXIT_ERROR",
    "EXIT_STORE_UNAVAILABLE",
    "OutOfMemory",
    "RunResult",
    "Trainer",
    "TrainingDiverged",
]

log = logging.getLogger("pyrecover_train")


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
        deadline: slurmclock.Deadline | None = None,  # the session's look at the start
    ) -> None:
        self.cfg, self.dist, self.device = cfg, dist, dist.device
        self.startup = Startup.now() if startup is None else startup
        self.interrupt = HangupAware(("INT", "HUP"))  # installed when the loop starts
        self.stop_flag = slurmclock.AnyFlag(signals, self.interrupt)
        self.console = Console(cfg, rank=dist.rank, world_size=dist.world_size)
        self.waits = StoreWaits(cfg, self.stop_flag, deadline)  # every wait on the store bounded
        parts = build.parts(cfg, dist, phase=self.startup.mark, limits=self.waits.limits())
        self.precision, self.data, self.model_cfg = parts.precision, parts.data, parts.model_cfg
        self.state, self.store = parts.state, parts.store
        self.waits.store = self.store
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
        saved = self.start_step if self.resumed_from else None  # the checkpoint resumed from
        self.async_saves = build.async_saves(cfg, self.device)
        self.schedule = SaveSchedule(cfg, saved_step=saved, clock=clock)
        self.loop = self._time_loop()
        self.profiler = StepProfiler(cfg, self.device, dist.rank)
        self.store_outage = StoreOutage(dist, self.loop, self.stop_flag, self._final_save, saved)
        self.outage = self.store_outage.outage  # the store not answering: each rank alike
        self.last_loss: float | None = None
        self.last_val: float | None = None
        self.evaluated_at: int | None = None
        self.window: LossWindow  # losses since the last progress line: made when the loop starts

    def _time_loop(self) -> slurmclock.TimeLoop:
        """slurmclock's protocol: when to stop, the final and extra saves, the exit codes."""
        cfg, dist = self.cfg, self.dist
        return slurmclock.TimeLoop(  # rank 0 decides; one agreement per step
            self.budget,
            leader=dist.is_main,
            agree=dist.agree,
            share=dist.broadcast_object,
            extra_saves=cfg.extra_saves,
            background_saves=self.async_saves,
            on_abandon=self._abandoned,
            launch=self.startup.launch,  # measured after the first step (one squeue)
        )

    def _resume(self, parts: build.Parts) -> None:
        """The checkpoint to resume from (if any) loaded, and the time budget with the figures
        the earlier allocations measured."""
        cfg = self.cfg
        resume = Resume(cfg, self.store, self.state, self.dist)
        self.resumed_from = resume.run(parts.start)
        self.budget = build.budget(cfg, self.state.model, self.stop_flag, resumed=resume.metadata)
        self.waits.budget = self.budget

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
                self.store_outage.failed(str(act.save), step, e, time.perf_counter() - t0)
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
        if (line := self.outage.saved(self.state.step)) and self.dist.is_main:
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

    def _final_save(self) -> None:
        """A retry of the final save after the store did not answer: durable on return."""
        self.save(kind="final", blocking=True)
        self.store.wait()

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
            raise TrainingDiverged.at(f"the loss is {loss}", step, self.schedule.last_step)
        grad_norm = self.stepper.grad_norm
        self.console.progress(
            step,
            window,
            lr=float(self.state.scheduler.get_last_lr()[0]),
            grad_norm=None if grad_norm is None else float(grad_norm),
            seconds_left=self.budget.seconds_left() if self.dist.is_main else None,
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
            step, last = self.state.step, self.schedule.last_step
            raise TrainingDiverged.at("the weights are NaN/inf", step, last)

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
        if self.dist.is_main:
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
        """A stop event for a run that failed (outcome.py); the traceback goes to train.log."""
        outcome.record_error(self.console, self.state.step, e)

    def close(self) -> None:
        self.interrupt.restore()
        try:
            self.store.close()
        except Exception as e:  # closing must not hide the error being raised, if any
            log.debug("closing the checkpoint store: %s", e)
        self.console.close()
