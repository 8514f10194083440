"""The training run: set-up (build.py), resume (resume.py), then the loop of :meth:`Trainer.fit`
(session.py runs it in a process group with its signals and logs).

    per step: train step -> progress line -> evaluation (every --eval-every)
              -> finished background saves refine the save-time estimate
              -> agree across ranks: stop? (time budget, stop signal) save? (schedule, budget)
              -> stop: final blocking save, wait for background saves, exit 75 (0 when done)
                 else: the periodic save, if due
    after a stop for time: extra saves (train on, save again) while the budget plans one; an
    extra save not durable when the exit must begin is abandoned: the process exits 75 at once
    and the final save stands (abandon.py)

Exit status: 0 finished --training-steps, 75 stopped early (requeue wanted), 1 error, 2 usage
error. The save decision is agreed together with the stop decision so that every rank takes part
in the same saves (a sharded save is collective) with one collective per step; a stop replaces a
periodic save due at the same step, since the final save covers it.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ddpkit
import slurmclock

from . import build, logs
from .abandon import AbandonAt
from .config import TrainConfig, UsageError
from .console import Console, LossWindow
from .dryrun import dry_run
from .perf import peak_flops
from .profiling import StepProfiler
from .resume import Resume, first_line
from .schedule import SaveSchedule
from .startup import Startup
from .state import local
from .step import OutOfMemory, Stepper, memory_guard

__all__ = [
    "EXIT_ERROR",
    "EXIT_FINISHED",
    "EXIT_STOPPED",
    "EXIT_USAGE",
    "ExitCode",
    "OutOfMemory",
    "RunResult",
    "StopCause",
    "Trainer",
    "TrainingDiverged",
]

log = logging.getLogger("pyrecover_train")


class ExitCode(enum.IntEnum):
    FINISHED = 0
    ERROR = 1
    USAGE = 2
    STOPPED = 75  # EX_TEMPFAIL: stopped for time or by a signal; requeue and resume


EXIT_FINISHED, EXIT_ERROR = ExitCode.FINISHED, ExitCode.ERROR
EXIT_USAGE, EXIT_STOPPED = ExitCode.USAGE, ExitCode.STOPPED


class StopCause(enum.IntEnum):
    """Why the loop ends; ordered so that the ranks' maximum is the one to act on."""

    NONE = 0  # the steps are done (or the loop goes on)
    TIME = 1
    SIGNAL = 2

    @property
    def event(self) -> str:
        return {0: "done", 1: "time", 2: "signal"}[self.value]


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


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf: nothing more is saved, so good checkpoints are not replaced."""


class Trainer:
    """One process's share of a training run: set-up in ``__init__``, the loop in ``fit``."""

    def __init__(
        self,
        cfg: TrainConfig,
        dist: ddpkit.Dist,
        signals: slurmclock.StopSignals,
        *,
        clock: Callable[[], float] = time.time,
        startup: Startup | None = None,
    ) -> None:
        self.cfg, self.dist, self.device = cfg, dist, dist.device
        self.startup = Startup.now() if startup is None else startup
        self.interrupt = slurmclock.StopSignals(("INT",))  # installed when the loop starts
        self.stop_flag = slurmclock.AnyFlag(signals, self.interrupt)
        self.console = Console(cfg, rank=dist.rank, world_size=dist.world_size)
        parts = build.parts(cfg, dist, phase=self.startup.mark)
        self.precision, self.data, self.model_cfg = parts.precision, parts.data, parts.model_cfg
        self.state, self.store = parts.state, parts.store
        self.stepper = Stepper(cfg, self.state, parts.train_model, self.precision)
        try:  # may raise UsageError: nothing has been written yet
            resume = Resume(
                cfg,
                self.store,
                self.state,
                dist,
                model_cfg=self.model_cfg,
                tokenizer=self.data.tokenizer.fingerprint(),
            )
            self.resumed_from = resume.run(parts.original)
            self.budget = build.budget(
                cfg, self.state.model, self.stop_flag, resumed=resume.metadata
            )
        except BaseException:
            parts.abandon()  # nothing written: the lock released, the folders it made removed
            raise
        self.startup.mark("resume")
        self.start_step = self.state.step
        self.async_saves = build.async_saves(cfg, self.device)
        self.schedule = SaveSchedule(
            cfg,
            self.budget,
            saved_step=self.state.step if self.resumed_from else None,
            background=self.async_saves,
            clock=clock,
        )
        self.profiler = StepProfiler(cfg, self.device, dist.rank)
        self.last_loss: float | None = None
        self.last_val: float | None = None
        self.evaluated_at: int | None = None
        self.stop_reason = ""
        self.window: LossWindow  # losses since the last progress line: made when the loop starts

    # -- the loop ---------------------------------------------------------------------------

    def fit(self) -> RunResult:
        cfg, s = self.cfg, self.state
        self._open_outputs()
        if cfg.dry_run:
            return self._dry_run()
        if s.step >= cfg.training_steps:
            log.info("already at step %d of %d: nothing to do", s.step, cfg.training_steps)
            return self._finish(ExitCode.FINISHED, "already finished", StopCause.NONE)
        self.interrupt.install()  # from here on Ctrl-C means "save and stop"
        self.window = LossWindow(self.device, each=cfg.log_loss_to_csv)
        while True:
            self._train_step()
            evaluated = self._evaluate_if_due()
            self._record_finished_saves()
            cause, save_now = self._agree(evaluated)
            if cause != StopCause.NONE or s.step >= cfg.training_steps:
                break
            if save_now:
                self.save(kind="periodic", blocking=not self.async_saves)
        return self._stop(cause)

    def _train_step(self) -> None:
        cfg, s = self.cfg, self.state
        t0 = time.perf_counter()
        with self.profiler.around(s.step + 1), memory_guard(cfg, f"step {s.step + 1}"):
            self.window.add(self.stepper.train_step())
        s.step += 1
        if s.step == self.start_step + 1:
            self._first_step_done()
        if s.step % cfg.log_every == 0 or s.step == cfg.training_steps:
            self._progress(self.window.take())
        self.budget.record_step(time.perf_counter() - t0)

    def save(self, *, kind: str, blocking: bool) -> None:
        """One checkpoint of the state now (the store snapshots it; async: persists later)."""
        self._check_finite()
        t0 = time.perf_counter()
        payload, metadata = self._checkpoint()
        self.store.save(self.state.step, payload, metadata=metadata, blocking=blocking)
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

    def _agree(self, evaluated: bool) -> tuple[StopCause, bool]:
        """(stop cause, save now?) agreed by all ranks in one tiny all-reduce (the maximum
        of each: any rank's stop or save wins)."""
        decision = self.budget.should_stop()
        cause = StopCause.NONE
        if decision.stop:  # a warning signal only moves the deadline: a stop for time
            cause = StopCause.SIGNAL if decision.cause == "signal" else StopCause.TIME
        due = self.schedule.due(self.state.step, evaluated)
        cannot = due and not self.schedule.may_start()
        code, due_i, cannot_i = self.dist.agree(int(cause), int(due), int(cannot))
        cause, due, cannot = StopCause(code), bool(due_i), bool(cannot_i)
        if cause != StopCause.NONE:
            self.stop_reason = decision.reason if decision.stop else "another rank asked to stop"
        elif due and cannot:
            why = self.schedule.may_start().reason
            log.info("step %d: periodic save skipped: %s", self.state.step, why)
        return cause, bool(due and not cannot)

    def _stop(self, cause: StopCause) -> RunResult:
        cfg, step = self.cfg, self.state.step
        done = step >= cfg.training_steps
        reason = f"reached --training-steps {cfg.training_steps}" if done else None
        reason = reason or self.stop_reason or "stop requested"
        log.info("step %d: %s (%s)", step, "finished" if done else "stopping early", reason)
        self.console.loss_rows(step, self.window.take()[3])  # since the last progress line
        if self.schedule.unsaved(step):
            self.save(kind="final", blocking=True)
        self.store.wait()  # a background save still in flight must be durable before we exit
        self._record_finished_saves(final_step=step)
        if cause == StopCause.TIME and not done and cfg.extra_saves:
            self._extra_saves(reason)
            done = self.state.step >= cfg.training_steps
            reason = f"reached --training-steps {cfg.training_steps}" if done else reason
        exit_code = ExitCode.FINISHED if done else ExitCode.STOPPED
        return self._finish(exit_code, reason, StopCause.NONE if done else cause)

    def _extra_saves(self, reason: str) -> None:
        """The final save's bound keeps it safe, so it usually ends early: spend the rest on
        training and another save while the budget plans one (rank 0's plan, for every rank).
        A save still running when the exit must begin is abandoned: the process exits at once
        (an abandoned save is as harmless as a SIGKILL mid-save) and the last durable one
        stands. A stop signal ends the extra training, and an extra save, at once."""
        s, cfg = self.state, self.cfg
        while s.step < cfg.training_steps:
            plan = self.dist.broadcast_object(self.budget.extra_save())
            if plan is None:
                return
            log.info("step %d: %s", s.step, plan.reason)
            start, signalled = s.step, False
            while s.step < cfg.training_steps:
                fits = plan.step_fits(time.time(), self.budget.step_estimate or 0.0)
                signal = self.budget.stop_signal() is not None
                stop, signalled_i = self.dist.agree(int(not fits or signal), int(signal))
                if stop:
                    signalled = bool(signalled_i)
                    break
                self._train_step()
            self.console.loss_rows(s.step, self.window.take()[3])
            if s.step == start or signalled:  # a stop signal: the exit, now
                return
            with AbandonAt(  # every save before it is durable: step `start` is the checkpoint
                plan.abandon_at,
                code=int(ExitCode.STOPPED),
                on_abandon=functools.partial(self._abandoned, reason=reason, saved=start),
                interrupted=self.budget.stop_signal,
            ):
                self.save(kind="extra", blocking=True)
                self.store.wait()
            self._record_finished_saves(extra_step=s.step)

    def _abandoned(self, why: str, reason: str, *, saved: int) -> None:
        """On the watchdog thread, just before the process exits 75: say so, everywhere."""
        step = self.state.step
        what = f"extra save of step {step} abandoned ({why}): step {saved} is the checkpoint"
        log.warning("%s", what)
        self.budget.extra_abandoned(step)
        self.state.step = saved  # what the next allocation resumes from
        try:
            self._finish(ExitCode.STOPPED, f"{reason}; {what}", StopCause.TIME)
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
            seconds_left=self.budget.seconds_left(),
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
            "metrics": {"loss": self.last_loss, "val_loss": self.last_val},
            "time_budget": self.budget.state_dict(),  # the next allocation starts from these
        }
        if self.last_val is not None and self.evaluated_at == s.step:
            meta["val_loss"] = self.last_val  # only when measured at this very step
        return s.checkpoint(rng), meta

    def _check_finite(self) -> None:
        """Never save NaN/inf weights over good checkpoints (keep_last would rotate them out).
        One reduction per tensor and one sync; cheap next to the save it guards. Sharded: each
        rank checks its shards and the ranks agree."""
        sums = torch.stack([local(p.detach()).sum() for p in self.state.model.parameters()])
        finite = bool(torch.isfinite(sums).all())
        if self.state.sharded:
            finite = self.dist.all_ranks(finite)
        if not finite:
            raise TrainingDiverged(
                f"the weights are NaN/inf at step {self.state.step}: stopping without saving "
                f"(the checkpoints hold step {self.schedule.last_step} and earlier); resume from "
                "one with a lower --learning-rate or --grad-clip"
            )

    def _record_finished_saves(
        self, *, final_step: int | None = None, extra_step: int | None = None
    ) -> None:
        """Durable saves refine the budget's save estimate. The final one (of ``final_step``,
        recorded once every save is durable) also marks ``saved`` in the job's timeline: what
        follows it until the requeue is this allocation's exit, measured for the next one. An
        extra one (of ``extra_step``) moves that mark and is not a save-time sample."""
        for stats in self.store.saves_completed():
            self.console.event("saved", **stats.to_dict())
            if stats.target == "primary" and stats.step == extra_step:
                self.budget.extra_saved(stats.total_s)  # the exit begins; not a save sample
            elif stats.target == "primary":
                # Until durable: the final save must be complete before the kill. A save written
                # while training went on is slower than the final one: the budget keeps it apart.
                self.budget.record_save(
                    stats.total_s,
                    final=stats.step == final_step,
                    background=stats.background,
                    step=stats.step,
                )

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

    def _finish(self, exit_code: ExitCode, reason: str, cause: StopCause) -> RunResult:
        self.profiler.close()
        self.console.event(
            "stop",
            step=self.state.step,
            reason=reason,
            cause=cause.event,
            exit_code=int(exit_code),
            seconds_left=self.budget.seconds_left(),
            signal=self.stop_flag.received,  # the first; all of them in arrival order:
            signals=[name for name, _ in self.stop_flag.arrivals],
            budget=self.budget.snapshot(),
        )
        self.console.summary(
            done=exit_code == ExitCode.FINISHED,
            step=self.state.step,
            reason=reason,
            exit_code=int(exit_code),
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
        return self._finish(ExitCode.FINISHED, "dry run OK", StopCause.NONE)

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
        return self._finish(ExitCode.FINISHED, "imported", StopCause.NONE)

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
                exit_code=int(ExitCode.ERROR),
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
