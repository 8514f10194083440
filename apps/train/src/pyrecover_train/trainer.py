"""The training run, top to bottom.

    set-up: data -> model -> optimizer -> checkpoint store -> resume (or refuse to clobber)
    loop, per step:
        train step (grad accumulation)
        -> evaluation (every --eval-every)
        -> periodic save due?  (every --checkpoint-frequency steps / --checkpoint-interval-seconds,
                                only if the budget says it can finish before the deadline)
        -> ask the clock (TimeBudget.should_stop) and the stop-signal flag
        -> agree across ranks (one all-reduce of three small ints)
        -> stop: final blocking save, wait for background saves, exit 75 (or 0 when done)
           else: the periodic save, if due
    Exit status: 0 finished --training-steps, 75 stopped early (requeue wanted), 1 error,
    2 usage error.

The save decision is agreed together with the stop decision so that every rank takes part in the
same saves (a sharded save is collective) with one collective per step; a stop replaces a
periodic save due at the same step, since the final save covers it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import shutil
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ckptstore
import ddpkit
import slurmclock

from . import data as data_mod
from . import logs, rng, state
from .config import TrainConfig, UsageError
from .metrics import MetricsLog, fmt_duration, progress_line
from .model import GPT, ModelConfig, build_model, preset_config
from .perf import checkpoint_interval, mfu, peak_flops, warmup_cosine
from .precision import Precision, PrecisionError, resolve_precision

log = logging.getLogger("pyrecover_train")

EXIT_FINISHED = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped for time or by a signal; requeue and resume

STOP_NONE, STOP_TIME, STOP_SIGNAL = 0, 1, 2
# Assumed blocking cost of a save for --checkpoint-interval-seconds auto until one is measured.
AUTO_ASSUMED_SAVE_COST = 10.0
ASSUMED_SAVE_BANDWIDTH = 200e6  # bytes/s, for the first save-time estimate (then measured)


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
    # Loop timing after the first ``timing_warmup`` steps (benchmarks use it): steps, wall
    # seconds of the whole loop (saves, clock, logging included), seconds inside train_step.
    timed_steps: int = 0
    timed_seconds: float = 0.0
    timed_step_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf: nothing more is saved, so good checkpoints are not replaced."""


class _AnyFlag:
    """Several stop flags read as one (the budget takes one)."""

    def __init__(self, *flags: slurmclock.StopSignals) -> None:
        self.flags = flags

    @property
    def requested(self) -> bool:
        return any(f.requested for f in self.flags)

    @property
    def received(self) -> str | None:
        return next((f.received for f in self.flags if f.received), None)


def train(cfg: TrainConfig, *, timing_warmup: int = 2) -> RunResult:
    """Run training as configured; returns its result (the CLI exits with ``exit_code``).

    Raises :class:`UsageError` for bad input found during set-up (nothing written by then).
    """
    # Armed first: SLURM's warning signal may come while the corpus is still being prepared.
    signals = slurmclock.StopSignals(("USR2", "TERM")).install()
    try:
        info = _check_launcher(cfg)
        device = None if cfg.device == "auto" else cfg.device
        logs.setup(info.rank)
        with _join(cfg, device) as dist:
            run = Run(cfg, dist, signals, timing_warmup=timing_warmup)
            try:
                return run.main()
            except Exception as e:
                run.record_error(e)
                raise
            finally:
                run.close()
    finally:
        logs.teardown()
        signals.restore()


def _join(cfg: TrainConfig, device: str | None) -> ddpkit.Dist:
    try:
        return ddpkit.init(distributed=cfg.distributed, device=device)
    except ddpkit.DistConfigError as e:  # raised before any network wait: a usage problem
        raise UsageError(f"--device/--distributed: {e}") from None


def _check_launcher(cfg: TrainConfig) -> ddpkit.DistInfo:
    try:
        info = ddpkit.detect()
    except ValueError as e:  # DistConfigError: inconsistent launcher variables
        raise UsageError(str(e)) from None
    if cfg.distributed and info.launcher == "single":
        raise UsageError(
            "--distributed needs a launcher: run under `torchrun --nproc-per-node N "
            "pyrecover-train ...` or `srun` (no RANK/WORLD_SIZE or SLURM step variables found)"
        )
    if not cfg.distributed and info.world_size > 1:
        raise UsageError(
            f"launched as {info.world_size} processes by {info.launcher} but --distributed is "
            "not set: add --distributed (each process would otherwise train alone)"
        )
    return info


class Run:
    """One process's share of a training run: set-up in ``__init__``, the loop in ``main``."""

    def __init__(
        self,
        cfg: TrainConfig,
        dist: ddpkit.Dist,
        signals: slurmclock.StopSignals,
        *,
        timing_warmup: int = 2,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg, self.dist, self.clock = cfg, dist, clock
        self.device: torch.device = dist.device
        self.timing_warmup = timing_warmup
        self.interrupt = slurmclock.StopSignals(("INT",))
        self.stop_flag = _AnyFlag(signals, self.interrupt)
        self.metrics = MetricsLog(None)
        self._check_output_dirs()
        self._set_determinism()
        self.precision = self._precision()
        self.data = self._data()
        self.model_cfg = self._model_config()
        self.model, self.train_model = self._model()
        self.optimizer = self._optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            warmup_cosine(
                warmup=cfg.warmup_steps,
                total=cfg.training_steps,
                min_ratio=cfg.effective_min_lr / cfg.learning_rate,
            ),
        )
        self.scaler = self.precision.scaler(self.device)
        self.store = self._store()
        self.step = 0
        self.resumed_from: str | None = None
        try:
            self._resume()  # may raise UsageError: nothing has been written yet
        except BaseException:
            self.store.close()
            raise
        self.start_step = self.step
        self.last_saved_step: int | None = self.step if self.resumed_from else None
        self.last_save_time = clock()
        self.save_costs: list[float] = []
        self.budget = self._budget()
        self.peak = peak_flops(self.device, cfg.peak_tflops)
        self.tokens_per_step = cfg.batch_size * cfg.sequence_length * cfg.grad_accum
        self.last_loss: float | None = None
        self.last_val: float | None = None
        self.wandb: Any = None

    # -- set-up -----------------------------------------------------------------------------

    def _check_output_dirs(self) -> None:
        """Local folders the run will write to: a file in the way, or a read-only parent, is a
        usage error now (one line, before any work) rather than a traceback at the first write."""
        cfg = self.cfg
        if cfg.store_is_local:
            flag = "--checkpoint-url" if cfg.checkpoint_url else "--checkpoint-dir"
            _check_writable_dir(cfg.exp_dir, flag)
        _check_writable_dir(cfg.metrics_path.parent, "--metrics")

    def _set_determinism(self) -> None:
        ddpkit.seed_everything(self.cfg.seed, self.dist.rank)
        if self.device.type == "cpu":
            # The bitwise-resume guarantee: same inputs, same kernels, same bits.
            torch.use_deterministic_algorithms(True, warn_only=True)
        else:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    def _precision(self) -> Precision:
        try:
            return resolve_precision(self.cfg.model_dtype, self.device)
        except PrecisionError as e:
            raise UsageError(str(e)) from None

    def _data(self) -> data_mod.Data:
        cfg, dist = self.cfg, self.dist
        # One process per node builds the shared caches; the others then find them ready.
        with _first(dist.info.local_rank == 0, dist):
            source, tokenizer, cache, dataset = data_mod.prepare(cfg)
        train_loader, val_loader = data_mod.loaders(
            cfg, cache, rank=dist.rank, world_size=dist.world_size
        )
        return data_mod.Data(source, tokenizer, cache, train_loader, val_loader, dataset)

    def _model_config(self) -> ModelConfig:
        try:
            return preset_config(
                self.cfg.model_size,
                vocab_size=self.data.tokenizer.vocab_size,
                max_seq_len=self.cfg.sequence_length,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None

    def _model(self) -> tuple[GPT, nn.Module]:
        model = build_model(self.model_cfg, seed=self.cfg.seed, device=self.device)
        model.to(self.precision.param_dtype)
        train_model: nn.Module = ddpkit.wrap_ddp(model, self.dist)
        if self.cfg.compile:
            train_model = self._compile(train_model)
        return model, train_model

    def _compile(self, module: nn.Module) -> nn.Module:
        if self.device.type == "cpu" and not any(
            shutil.which(c) for c in ("g++", "c++", "clang++")
        ):
            log.warning("--compile: no C++ compiler found for the CPU backend; running eagerly")
            return module
        try:
            return torch.compile(module)  # type: ignore[return-value]
        except RuntimeError as e:  # e.g. an unsupported Python version
            log.warning("--compile: torch.compile is not available here (%s); running eagerly", e)
            return module

    def _optimizer(self) -> torch.optim.Optimizer:
        cfg = self.cfg
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        groups = [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},  # norms: decaying them only hurts
        ]
        kwargs: dict[str, Any] = {"lr": cfg.learning_rate, "betas": (0.9, 0.95), "eps": 1e-8}
        if cfg.fused_optimizer:
            try:
                return torch.optim.AdamW(groups, fused=True, **kwargs)
            except (RuntimeError, ValueError) as e:
                log.warning(
                    "--fused-optimizer: fused AdamW unsupported here (%s); using foreach", e
                )
        return torch.optim.AdamW(groups, **kwargs)

    def _store(self) -> ckptstore.CheckpointStore:
        cfg = self.cfg
        try:
            return ckptstore.CheckpointStore(
                cfg.store_url,
                format=cfg.format,
                keep_last=cfg.keep_last,
                keep_best=cfg.keep_best,
                best_metric="val_loss",
                best_mode="min",
                mirror=cfg.checkpoint_mirror,
                storage_options=cfg.storage_options,
                mirror_storage_options=cfg.storage_options,
                experiment=cfg.experiment_name,
            )
        except (ValueError, ImportError) as e:
            raise UsageError(f"--checkpoint-dir/--checkpoint-url: {e}") from None

    def _budget(self) -> slurmclock.TimeBudget:
        cfg = self.cfg
        try:
            watcher = slurmclock.DeadlineWatcher(time_limit=cfg.time_limit)
        except ValueError as e:
            raise UsageError(f"--time-limit: {e}") from None
        state_bytes = state.count_bytes(self.model.state_dict()) * 3  # weights + 2 Adam moments
        kwargs: dict[str, Any] = {
            "signals": self.stop_flag,
            "initial_save_estimate": 1.0 + state_bytes / ASSUMED_SAVE_BANDWIDTH,
            "warmup_steps": 2 + (1 if cfg.compile else 0),
        }
        if cfg.stop_margin is not None:
            kwargs["margin"] = cfg.stop_margin
        return slurmclock.TimeBudget(watcher, **kwargs)

    # -- checkpoint state -------------------------------------------------------------------

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """Everything a bitwise resume needs (see :mod:`pyrecover_train.state`).

        Objects go in as themselves: the store calls their ``state_dict()`` on save and their
        ``load_state_dict()`` on load, so an optimizer needs no state before its first step.
        ``self.model`` is the bare module (no DDP / torch.compile wrapper), so its keys carry
        no "module." / "_orig_mod." prefix.
        """
        all_rng = self.dist.all_gather_object(rng.capture(self.device))
        return {
            "model": self.model,
            "optim": self.optimizer,
            "sched": self.scheduler,
            "scaler": self.scaler if self.scaler is not None else {},
            "data": self.data.train,
            "rng": {rng.rank_key(r): s for r, s in enumerate(all_rng)},
            "step": step,
        }

    def checkpoint_metadata(self, step: int) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "step": step,
            "model": self.model_cfg.to_dict(),
            "model_size": self.cfg.model_size,
            "args": self.cfg.to_dict(),
            "world_size": self.dist.world_size,
            "tokenizer": self.data.tokenizer.fingerprint(),
            "data_key": self.data.train.key,
            "tokens_seen": self.data.train.position * self.cfg.sequence_length,
            "metrics": {"loss": self.last_loss, "val_loss": self.last_val},
        }
        if self.last_val is not None and self._evaluated_at == step:
            meta["val_loss"] = self.last_val  # only when measured at this very step
        return meta

    _evaluated_at: int | None = None

    # -- resume -----------------------------------------------------------------------------

    def _resume(self) -> None:
        target = self.cfg.resume_from_checkpoint
        latest = self._latest_step()
        if target is None:
            if latest is not None:
                raise UsageError(
                    f"{self._store_where()} already holds checkpoints (latest step {latest}): "
                    "pass --resume-from-checkpoint latest to continue, or pick another "
                    "--experiment_name / --checkpoint-dir (nothing was changed)"
                )
            return
        if target == "latest":
            if latest is None:
                log.info("--resume-from-checkpoint latest: no checkpoint yet, starting at step 0")
                return
            self._load("latest")
            return
        self._load(self._resolve_target(target))

    def _latest_step(self) -> int | None:
        try:
            return self.store.latest_step()
        except Exception as e:  # no credentials, no bucket, no permission: fix and retry
            raise UsageError(
                f"cannot read the checkpoint location {self._store_where()}: "
                f"{type(e).__name__}: {_first_line(e)}"
            ) from None

    def _store_where(self) -> str:
        return f"{self.cfg.store_url.rstrip('/')}/{self.cfg.experiment_name}"

    def _resolve_target(self, target: str) -> int | str:
        if target.isdigit():
            return int(target)
        path = Path(target)
        if "://" not in target and not path.exists():
            raise UsageError(
                f"--resume-from-checkpoint {target}: no such checkpoint (give 'latest', a step "
                "number, or an existing checkpoint directory)"
            )
        return target

    def _load(self, which: int | str) -> None:
        self._check_compatible(self._peek(which))
        template: dict[str, Any] = {
            "model": self.model,
            "optim": self.optimizer,
            "sched": self.scheduler,
            "scaler": self.scaler if self.scaler is not None else {},
            "data": self.data.train,
            "rng": {},
            "step": -1,
        }
        try:
            # Restores model, optimizer, scheduler, scaler and loader in place; "rng" and
            # "step" come back as values.
            manifest = self.store.load(template, which)
        except ckptstore.CheckpointError as e:
            raise UsageError(f"--resume-from-checkpoint: {_first_line(e)}") from None
        self.step = int(template["step"])
        self._restore_rng(template["rng"], manifest.world_size)
        self._reapply_flags()
        self.resumed_from = f"step {self.step} ({manifest.url or which})"

    def _reapply_flags(self) -> None:
        """The optimizer and schedule come back with the checkpoint's learning rate and weight
        decay; this run's flags win (e.g. a lower --learning-rate after a divergence). With the
        same flags the values are the same floats, so a resume stays bitwise exact."""
        sched, cfg = self.scheduler, self.cfg
        old = list(sched.base_lrs)
        sched.base_lrs = [cfg.learning_rate for _ in old]
        factor = sched.lr_lambdas[0](sched.last_epoch)
        for group, decay in zip(self.optimizer.param_groups, (cfg.weight_decay, 0.0), strict=True):
            group["lr"] = cfg.learning_rate * factor  # what LambdaLR.step() computes
            group["weight_decay"] = decay
        sched._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if old != sched.base_lrs:
            log.info("--learning-rate %g replaces the checkpoint's %g", cfg.learning_rate, old[0])

    def _peek(self, which: int | str) -> dict[str, Any]:
        """The checkpoint's metadata, read before anything is loaded."""
        try:
            return dict(self.store.manifest(which).metadata)
        except ckptstore.CheckpointError as e:
            raise UsageError(f"--resume-from-checkpoint: {_first_line(e)}") from None
        except FileNotFoundError:
            raise UsageError(
                f"--resume-from-checkpoint {which}: no manifest.json there (not a committed "
                "checkpoint)"
            ) from None

    def _check_compatible(self, meta: dict[str, Any]) -> None:
        saved = meta.get("model")
        if isinstance(saved, dict):
            diffs = self.model_cfg.differences(saved)
            if diffs:
                raise UsageError(
                    "the checkpoint is of another model shape ("
                    + "; ".join(diffs)
                    + "): resume with the same --model-size/--tokenizer or start a new "
                    "--experiment_name"
                )
        tokenizer = meta.get("tokenizer")
        if tokenizer and tokenizer != self.data.tokenizer.fingerprint():
            raise UsageError(
                "the checkpoint was trained with another tokenizer: pass the same --tokenizer "
                "and --dataset as the run that wrote it"
            )

    def _restore_rng(self, saved: dict[str, Any], saved_world: int) -> None:
        key = rng.rank_key(self.dist.rank)
        if saved_world == self.dist.world_size and key in saved:
            rng.restore(saved[key], self.device)
            return
        seed = rng.reseed(self.cfg.seed, self.step, self.dist.rank, self.device)
        log.info(
            "world size changed (%d in the checkpoint, %d now): RNGs re-seeded from "
            "(seed %d, step %d, rank %d) -> %d; data continues at global position %d",
            saved_world,
            self.dist.world_size,
            self.cfg.seed,
            self.step,
            self.dist.rank,
            seed,
            self.data.train.position,
        )

    # -- the loop ---------------------------------------------------------------------------

    def main(self) -> RunResult:
        cfg = self.cfg
        self._open_outputs()
        if cfg.dry_run:
            return self._dry_run()
        if self.step >= cfg.training_steps:
            log.info("already at step %d of %d: nothing to do", self.step, cfg.training_steps)
            return self._finish(EXIT_FINISHED, "already finished", STOP_NONE)
        self.interrupt.install()  # from here on Ctrl-C means "save and stop"
        timer = _LoopTimer(first=self.start_step + self.timing_warmup)
        window = _LossWindow(self.device)
        while True:
            t0 = time.perf_counter()
            window.add(self.train_step())
            self.step += 1
            timer.stepped(self.step, time.perf_counter() - t0)
            if self.step % cfg.log_every == 0 or self.step == cfg.training_steps:
                self._log_step(*window.take())
            self.budget.record_step(time.perf_counter() - t0)
            evaluated = self._maybe_eval()
            self._drain_saves()  # finished background saves refine the save-time estimate
            code, save_due = self._decide(evaluated)
            if code != STOP_NONE or self.step >= cfg.training_steps:
                break
            if save_due:
                self.save(kind="periodic", blocking=not cfg.async_checkpoint)
        self.timer = timer.finish()
        return self._stop(code)

    timer: _LoopTimer | None = None

    def train_step(self) -> torch.Tensor:
        """One optimizer step over ``grad_accum`` micro-batches; returns the mean loss (on device,
        not synchronised: reading it every step would stall a GPU)."""
        cfg, model = self.cfg, self.train_model
        total = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            x, y = self._batch()
            last = micro == cfg.grad_accum - 1
            # DDP: all-reduce gradients only on the last micro-batch.
            no_sync = getattr(model, "no_sync", None)
            sync = contextlib.nullcontext() if last or no_sync is None else no_sync()
            with sync:
                with self.precision.autocast(self.device):
                    logits = model(x)
                loss = _loss(logits, y) / cfg.grad_accum
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total += loss.detach()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if cfg.grad_clip > 0:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    grad_norm: torch.Tensor | None = None

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = torch.from_numpy(self.data.train.next_batch())
        if self.device.type == "cuda":
            batch = batch.pin_memory().to(self.device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]

    def _decide(self, evaluated: bool) -> tuple[int, bool]:
        """(stop code, save now?) agreed by all ranks in one all-reduce."""
        decision = self.budget.should_stop()
        code = STOP_NONE
        if decision.stop:
            code = STOP_SIGNAL if self.stop_flag.requested else STOP_TIME
        due = self._save_due(evaluated)
        cannot = due and not self.budget.can_save()
        if self.dist.world_size > 1:
            agreed = self.dist.all_reduce(
                torch.tensor([code, int(due), int(cannot)], device=self.device), op="max"
            )
            code, agreed_due, agreed_cannot = (int(v) for v in agreed.tolist())
            due, cannot = bool(agreed_due), bool(agreed_cannot)
        if code != STOP_NONE:
            self._stop_reason = decision.reason if decision.stop else "another rank asked to stop"
        elif due and cannot:
            log.info("step %d: periodic save skipped: %s", self.step, self.budget.can_save().reason)
        return code, bool(due and not cannot)

    _stop_reason = ""

    def _save_due(self, evaluated: bool) -> bool:
        cfg = self.cfg
        if cfg.checkpoint_frequency and self.step % cfg.checkpoint_frequency == 0:
            return True
        if cfg.keep_best and evaluated:
            return True  # the best checkpoint must be one whose validation loss was measured
        interval = self.save_interval()
        return interval is not None and self.clock() - self.last_save_time >= interval

    def save_interval(self) -> float | None:
        """Seconds between time-based saves: fixed, Young/Daly (auto), or None (off)."""
        return checkpoint_interval(
            self.cfg.checkpoint_interval_seconds,
            self.save_costs,
            AUTO_ASSUMED_SAVE_COST,
            self.cfg.mtbf,
        )

    # -- evaluation -------------------------------------------------------------------------

    def _maybe_eval(self) -> bool:
        cfg = self.cfg
        if not cfg.eval_every or self.data.val is None:
            return False
        if self.step % cfg.eval_every and self.step != cfg.training_steps:
            return False
        self.evaluate()
        return True

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first ``--eval-batches`` held-out batches (all ranks)."""
        assert self.data.val is not None
        t0 = time.perf_counter()
        self.train_model.eval()
        total, n = torch.zeros((), device=self.device, dtype=torch.float64), 0
        for batch_np in self.data.val.eval_batches(self.cfg.eval_batches):
            batch = torch.from_numpy(batch_np).to(self.device)
            with self.precision.autocast(self.device):
                logits = self.model(batch[:, :-1])
            total += _loss(logits, batch[:, 1:]).double()
            n += 1
        self.train_model.train()
        mean = total / max(n, 1)
        val = (
            float(self.dist.all_reduce(mean, op="mean"))
            if self.dist.world_size > 1
            else float(mean)
        )
        self.last_val, self._evaluated_at = val, self.step
        self.metrics.log("eval", step=self.step, val_loss=val, seconds=time.perf_counter() - t0)
        log.info("step %d: validation loss %.4f", self.step, val)
        if self.wandb is not None:
            self.wandb.log({"val_loss": val}, step=self.step)
        return val

    # -- saving -----------------------------------------------------------------------------

    def save(self, *, kind: str, blocking: bool) -> None:
        self._check_finite()
        t0 = time.perf_counter()
        handle = self.store.save(
            self.step,
            self.checkpoint_state(self.step),
            metadata=self.checkpoint_metadata(self.step),
            blocking=blocking,
        )
        blocking_s = time.perf_counter() - t0
        self.last_saved_step, self.last_save_time = self.step, self.clock()
        self.save_costs.append(blocking_s)
        extra: dict[str, Any] = {}
        if self.cfg.checkpoint_interval_seconds is not None:
            extra["interval_s"] = self.save_interval()  # until the next time-based save
        self.metrics.log(
            "save",
            step=self.step,
            kind=kind,
            blocking_s=blocking_s,
            **{"async": not blocking},
            **extra,
        )
        log.debug("step %d: %s save started (%.2f s blocking)", self.step, kind, blocking_s)
        del handle
        self._drain_saves()

    def _check_finite(self) -> None:
        """Never save NaN/inf weights over good checkpoints (keep_last would rotate them out).

        One reduction per tensor and one sync; cheap next to the save it guards.
        """
        sums = torch.stack([p.detach().sum() for p in self.model.parameters()])
        if not bool(torch.isfinite(sums).all()):
            raise TrainingDiverged(
                f"the weights are NaN/inf at step {self.step}: stopping without saving (the "
                f"checkpoints hold step {self.last_saved_step} and earlier); resume from one "
                "with a lower --learning-rate or --grad-clip"
            )

    def _drain_saves(self) -> None:
        for stats in self.store.saves_completed():
            record = stats.to_dict()
            self.metrics.log("saved", **record)
            if stats.target == "primary":
                # Until durable: the final save must be complete before the kill.
                self.budget.record_save(stats.total_s)

    # -- stopping ---------------------------------------------------------------------------

    def _stop(self, code: int) -> RunResult:
        cfg = self.cfg
        done = self.step >= cfg.training_steps
        if done:
            reason = f"reached --training-steps {cfg.training_steps}"
        else:
            reason = self._stop_reason or "stop requested"
        what = "finished" if done else "stopping early"
        log.info("step %d: %s (%s)", self.step, what, reason)
        if self.last_saved_step != self.step:
            self.save(kind="final", blocking=True)
        self.store.wait()  # a background save still in flight must be durable before we exit
        self._drain_saves()
        exit_code = EXIT_FINISHED if done else EXIT_STOPPED
        return self._finish(exit_code, reason, STOP_NONE if done else code)

    def _finish(self, exit_code: int, reason: str, code: int) -> RunResult:
        kind = {STOP_NONE: "done", STOP_TIME: "time", STOP_SIGNAL: "signal"}[code]
        self.metrics.log(
            "stop",
            step=self.step,
            reason=reason,
            cause=kind,
            exit_code=exit_code,
            seconds_left=self.budget.seconds_left(),
            signal=self.stop_flag.received,
            budget=self.budget.snapshot(),
        )
        self._summary(exit_code, reason)
        return RunResult(
            exit_code=exit_code,
            step=self.step,
            start_step=self.start_step,
            reason=reason,
            final_loss=self.last_loss,
            val_loss=self.last_val,
            exp_dir=self.cfg.exp_dir,
            metrics_path=self.cfg.metrics_path,
            timed_steps=self.timer.steps if self.timer else 0,
            timed_seconds=self.timer.seconds if self.timer else 0.0,
            timed_step_seconds=self.timer.step_seconds if self.timer else 0.0,
        )

    # -- output -----------------------------------------------------------------------------

    def _open_outputs(self) -> None:
        """Metrics, log file and the start/resume events (rank 0); only now that the run is
        known to start, so a refused start writes nothing."""
        cfg = self.cfg
        if self.dist.rank == 0:
            self.metrics = MetricsLog(cfg.metrics_path)
            logs.add_file(cfg.exp_dir / "train.log")
        d = self.budget.deadline()
        common = {
            "step": self.step,
            "world_size": self.dist.world_size,
            "job_id": slurmclock.job_id(),
            "restart_count": slurmclock.restart_count(),
            "deadline": None if d is None else d.iso(),
            "deadline_source": None if d is None else d.source,
            "process_start": slurmclock.process_start_time(),
        }
        self.metrics.log(
            "start",
            **common,
            args=cfg.to_dict(),
            model=self.model_cfg.to_dict(),
            params=sum(p.numel() for p in self.model.parameters()),
            data=self.data.describe(),
            device=str(self.device),
            dtype=cfg.model_dtype,
            tokens_per_step=self.tokens_per_step * self.dist.world_size,
        )
        if self.resumed_from:
            reason = f"resumed from {self.resumed_from}"
            if common["restart_count"]:
                reason += f", SLURM restart {common['restart_count']}"
            self.metrics.log(
                "resume", **common, reason=reason, data_state=self.data.train.state_dict()
            )
            log.info("%s", reason)
        self._banner()
        if cfg.wandb:
            self.wandb = _wandb(cfg, self.dist, self.model_cfg)

    def _banner(self) -> None:
        cfg, d = self.cfg, self.data
        n = sum(p.numel() for p in self.model.parameters())
        log.info(
            "pyrecover-train: %s model (%.2fM params, %s, %s) on %s x%d; data %s (%s tokens, "
            "tokenizer %s)",
            cfg.model_size,
            n / 1e6,
            cfg.model_dtype,
            "compiled" if cfg.compile else "eager",
            self.device,
            self.dist.world_size,
            d.dataset,
            f"{d.cache.num_tokens:,}",
            cfg.tokenizer,
        )
        every = []
        if cfg.checkpoint_frequency:
            every.append(f"every {cfg.checkpoint_frequency} steps")
        if cfg.checkpoint_interval_seconds == "auto":
            every.append(
                f"every ~{fmt_duration(self.save_interval())} (auto: Young/Daly with MTBF "
                f"{fmt_duration(cfg.mtbf)}, re-estimated from each measured save)"
            )
        elif cfg.checkpoint_interval_seconds is not None:
            every.append(f"every {cfg.checkpoint_interval_seconds} s")
        log.info(
            "  checkpoints: %s (%s, %s%s)",
            self._store_where(),
            cfg.format,
            " and ".join(every) or "at the end only",
            ", async" if cfg.async_checkpoint else "",
        )
        log.info("  metrics:     %s", cfg.metrics_path)
        log.info("  log:         %s", cfg.exp_dir / "train.log")
        left = self.budget.seconds_left()
        if left is not None:
            log.info("  time left:   %s (%s)", fmt_duration(left), self.budget.deadline())

    def _log_step(self, loss: float, steps: int, seconds: float) -> None:
        self.last_loss = loss
        if not math.isfinite(loss) and self.scaler is None:  # fp16 skips inf steps by design
            raise TrainingDiverged(
                f"the loss is {loss} at step {self.step}: stopping without saving (the "
                f"checkpoints hold step {self.last_saved_step} and earlier); resume from one "
                "with a lower --learning-rate or --grad-clip"
            )
        step_time = seconds / max(steps, 1)
        tokens_per_s_rank = self.tokens_per_step / step_time
        flops = self.model_cfg.flops_per_token(self.cfg.sequence_length)
        util = mfu(tokens_per_s_rank, flops, self.peak)
        lr = float(self.scheduler.get_last_lr()[0])
        left = self.budget.seconds_left()
        self.metrics.log(
            "step",
            step=self.step,
            loss=loss,
            lr=lr,
            grad_norm=None if self.grad_norm is None else float(self.grad_norm),
            steps=steps,
            step_time_s=step_time,
            tokens_per_s=tokens_per_s_rank * self.dist.world_size,
            tokens_per_s_per_rank=tokens_per_s_rank,
            mfu=util,
            seconds_left=left,
            data_position=self.data.train.position,
        )
        if self.wandb is not None:
            self.wandb.log(
                {"loss": loss, "lr": lr, "tokens_per_s": tokens_per_s_rank}, step=self.step
            )
        log.info(
            "%s",
            progress_line(
                step=self.step,
                total=self.cfg.training_steps,
                loss=loss,
                lr=lr,
                tokens_per_s=tokens_per_s_rank * self.dist.world_size,
                step_time=step_time,
                seconds_left=left,
                mfu=util,
            ),
        )

    def _summary(self, exit_code: int, reason: str) -> None:
        cfg = self.cfg
        losses = ""
        if self.last_loss is not None:
            losses = f", loss {self.last_loss:.4f}"
        if self.last_val is not None:
            losses += f", validation loss {self.last_val:.4f}"
        if exit_code == EXIT_FINISHED:
            log.info("finished: step %d/%d (%s)%s", self.step, cfg.training_steps, reason, losses)
        else:
            log.info(
                "stopped at step %d/%d (%s); exit %d = requeue and resume",
                self.step,
                cfg.training_steps,
                reason,
                exit_code,
            )
        log.info("  checkpoints: %s", self._store_where())
        log.info("  resume:      pyrecover-train --resume-from-checkpoint latest [same flags]")
        log.info("  plot:        pyrecover-train report %s", cfg.exp_dir)

    # -- dry run ----------------------------------------------------------------------------

    def _dry_run(self) -> RunResult:
        """One step, one save to a scratch experiment, one verified load and comparison."""
        t0 = time.perf_counter()
        self.train_step()
        self.step += 1
        step_s = time.perf_counter() - t0
        # A fresh scratch folder of its own (rank 0 names it for all ranks): never one that
        # exists already, which may be the user's (an experiment may be called "x.dry-run").
        name = self.dist.all_gather_object(
            f"{self.cfg.experiment_name[:100]}.dry-run-{secrets.token_hex(4)}"
        )[0]
        exists = self.dist.all_gather_object(
            self.dist.rank == 0 and _scratch_exists(self.cfg, name)
        )[0]
        if exists:  # all ranks agree, so none waits for the others
            raise RuntimeError(f"dry run: scratch folder {name} exists already; run it again")
        scratch = ckptstore.CheckpointStore(
            self.cfg.store_url,
            format=self.cfg.format,
            storage_options=self.cfg.storage_options,
            experiment=name,
        )
        ok = False
        try:
            t1 = time.perf_counter()
            scratch.save(
                self.step,
                self.checkpoint_state(self.step),
                metadata=self.checkpoint_metadata(self.step),
            )
            scratch.wait()
            save_s = time.perf_counter() - t1
            report = scratch.verify(self.step)
            if not report.ok:
                raise RuntimeError(f"dry run: the checkpoint does not verify: {report.summary()}")
            _, loaded = scratch.read(self.step)
            live = {
                "model": self.model.state_dict(),
                "optim": self.optimizer.state_dict(),
                "data": self.data.train.state_dict(),
            }
            diffs = state.tensors_equal(live, {k: loaded[k] for k in live})
            if diffs:
                raise RuntimeError(
                    f"dry run: what was loaded differs from what was saved at {diffs[:5]}"
                )
            ok = True
            self.dist.barrier()  # every rank has read it back before rank 0 removes it
        finally:
            if not ok or self.dist.rank == 0:
                _remove_experiment(scratch, self.cfg, name)
            else:
                with contextlib.suppress(Exception):
                    scratch.close()
        log.info(
            "dry run OK: 1 step %.2f s; save %.2f s (%.1f MB), verified, read back equal "
            "(scratch experiment removed)",
            step_s,
            save_s,
            report.bytes_checked / 1e6,
        )
        self.step = self.start_step  # nothing of the dry run is kept
        return self._finish(EXIT_FINISHED, "dry run OK", STOP_NONE)

    def record_error(self, e: BaseException) -> None:
        """A stop event for a run that failed, so the report can tell it from a kill; the
        traceback goes to train.log (the console gets the CLI's one line)."""
        logs.exception_to_file(f"step {self.step}: {type(e).__name__}: {e}")
        with contextlib.suppress(Exception):
            self.metrics.log(
                "stop",
                step=self.step,
                reason=f"{type(e).__name__}: {_first_line(e)}",
                cause="error",
                exit_code=EXIT_ERROR,
            )

    def close(self) -> None:
        self.interrupt.restore()
        with contextlib.suppress(Exception):
            self.store.close()
        self.metrics.close()
        if self.wandb is not None:
            with contextlib.suppress(Exception):
                self.wandb.finish()


# -- helpers --------------------------------------------------------------------------------------


class _LossWindow:
    """Losses since the last progress line, kept on the device: reading a GPU loss every step
    would synchronise, and stall the step queue."""

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros((), device=device)
        self.steps = 0
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss
        self.steps += 1

    def take(self) -> tuple[float, int, float]:
        """(mean loss, steps, seconds) of the window, and start a new one."""
        out = (self.total.item() / max(self.steps, 1), self.steps, time.perf_counter() - self.start)
        self.total.zero_()
        self.steps, self.start = 0, time.perf_counter()
        return out


class _LoopTimer:
    """Wall time of the loop after step ``first`` versus time spent in train_step: the loop's own
    overhead (clock, agreement, logging, saves) without the machine's noise between runs."""

    def __init__(self, *, first: int) -> None:
        self.first = first
        self.started: float | None = None
        self.steps = 0
        self.seconds = 0.0
        self.step_seconds = 0.0

    def stepped(self, step: int, seconds: float) -> None:
        if step == self.first:
            self.started = time.perf_counter()
        elif self.started is not None:
            self.steps += 1
            self.step_seconds += seconds

    def finish(self) -> _LoopTimer:
        if self.started is not None:
            self.seconds = time.perf_counter() - self.started
        return self


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Cross-entropy in fp32 at least: bf16 logits lose the small probabilities.
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@contextlib.contextmanager
def _first(leader: bool, dist: ddpkit.Dist) -> Iterator[None]:
    """The leader runs the body first, then the others (e.g. building a shared cache once)."""
    if not leader:
        dist.barrier()
    try:
        yield
    finally:
        if leader:
            dist.barrier()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _check_writable_dir(path: Path, flag: str) -> None:
    """``path`` is, or can be created as, a folder this process can write into."""
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            return
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: {existing} is not writable by this user")


def _scratch_path(cfg: TrainConfig, name: str) -> tuple[Any, str]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(cfg.store_url, **(cfg.storage_options or {}))
    return fs, f"{root.rstrip('/')}/{name}"


def _scratch_exists(cfg: TrainConfig, name: str) -> bool:
    fs, path = _scratch_path(cfg, name)
    return bool(fs.exists(path))


def _remove_experiment(store: ckptstore.CheckpointStore, cfg: TrainConfig, name: str) -> None:
    """Delete the dry run's scratch experiment (only that folder, which the dry run created)."""
    with contextlib.suppress(Exception):
        store.close()
    try:
        fs, path = _scratch_path(cfg, name)
        if fs.exists(path):
            fs.rm(path, recursive=True)
    except Exception as e:  # leaving a scratch folder behind is not worth failing for
        log.warning("dry run: could not remove the scratch checkpoint folder: %s", e)


def _wandb(cfg: TrainConfig, dist: ddpkit.Dist, model_cfg: ModelConfig) -> Any:
    """Rank 0's W&B run; the id is derived from the experiment so a requeued job continues it."""
    try:
        logger = ddpkit.WandbLogger(
            project="pyrecover",
            name=cfg.experiment_name,
            config={"args": cfg.to_dict(), "model": model_cfg.to_dict()},
            run_id=f"{cfg.experiment_name}-{zlib.crc32(cfg.store_url.encode()):08x}",
            rank=dist.rank,
        )
    except Exception as e:  # optional logging must never stop training
        log.warning("--wandb: not logging to Weights & Biases (%s)", e)
        return None
    if not logger.active:
        if dist.rank == 0:
            log.warning("--wandb: not logging to Weights & Biases: %s", logger.reason)
        return None
    return logger
