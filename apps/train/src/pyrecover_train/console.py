"""Everything a run says, in one place: the banner, the progress line and the summary (log), the
metrics events (JSONL), Weights & Biases, and the original's loss CSV. Files are rank 0's: the
other ranks get a console whose writers are no-ops."""

from __future__ import annotations

import csv
import io
import logging
import os
import signal
import socket
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

import slurmclock

from . import logs, wandb_log
from .config import TrainConfig
from .data import Data
from .metrics import VAL_LOSS, AppendFile, MetricsLog, fmt_duration, progress_line
from .perf import mfu
from .startup import Startup

log = logging.getLogger("pyrecover_train")


class Console:
    """Output of one process. ``open()`` starts the files once the run is known to start, so a
    refused start writes nothing."""

    def __init__(self, cfg: TrainConfig, *, rank: int, world_size: int) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.metrics = MetricsLog(None)
        self.wandb: wandb_log.MetricsLogger | None = None
        self._csv: AppendFile | None = None
        self._flops_per_token = 0.0
        self._peak: float | None = None

    def open(self, *, flops_per_token: float, peak: float | None) -> None:
        cfg = self.cfg
        self._flops_per_token, self._peak = flops_per_token, peak
        # A dry run leaves nothing in the experiment (it may hold a run's checkpoints, metrics
        # and log): its lines go to the console only.
        if self.rank == 0 and not cfg.dry_run:
            logs.add_file(cfg.exp_dir / "train.log")  # first: the lines below may go there
            self.metrics = MetricsLog(cfg.metrics_path, say=logs.say_warning)
            if cfg.log_loss_to_csv:
                name = cfg.experiment_name.rsplit("/", 1)[-1]  # GROUP/NAME: its own folder
                self._csv = _open_csv(cfg.exp_dir / f"{name}_loss_log.csv")

    def event(self, name: str, **fields: Any) -> None:
        self.metrics.log(name, **fields)

    def start(
        self,
        *,
        step: int,
        budget: slurmclock.TimeBudget,
        model_config: dict[str, Any],
        params: int,
        data: Data,
        device: str,
        resumed_from: str | None,
        saves: str,
        startup: Startup,
    ) -> None:
        """The start (and resume) events, the banner, W&B, and notes on the original's flags."""
        cfg, d = self.cfg, budget.deadline()
        common = {
            "step": step,
            "world_size": self.world_size,
            "job_id": slurmclock.job_id(),
            "restart_count": slurmclock.restart_count(),
            "deadline": None if d is None else d.iso(),
            "deadline_source": None if d is None else d.source,
            "process_start": slurmclock.process_start_time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),  # with pid: report tells a live run from a killed one
        }
        self.metrics.log(
            "start",
            **common,
            args=cfg.to_dict(),
            model=model_config,
            params=params,
            data=data.describe(),
            device=device,
            dtype=cfg.model_dtype,
            tokens_per_step=cfg.tokens_per_step * self.world_size,
            budget=budget.snapshot(),  # what the stop rule starts from (resumed figures too)
        )
        if resumed_from:
            reason = f"resumed from {resumed_from}"
            if common["restart_count"]:
                reason += f", SLURM restart {common['restart_count']}"
            self.metrics.log("resume", **common, reason=reason, data_state=data.train.state_dict())
            log.info("%s", reason)
        self._banner(params=params, device=device, data=data, saves=saves, budget=budget)
        log.info("  start-up:    %s so far", startup.describe())
        if cfg.wandb:
            self.wandb = _wandb(cfg, self.rank, model_config)
        _say_original_flags(cfg)
        for line in cfg.warnings() if self.rank == 0 else ():
            logs.say_warning(line)  # flags that contradict each other but leave a sane run

    def _banner(
        self, *, params: int, device: str, data: Data, saves: str, budget: slurmclock.TimeBudget
    ) -> None:
        cfg = self.cfg
        log.info(
            "pyrecover-train: %s model (%.2fM params, %s, %s) on %s x%d; data %s (%s tokens, "
            "tokenizer %s)",
            cfg.model_size,
            params / 1e6,
            cfg.model_dtype,
            "compiled" if cfg.compile else "eager",
            device,
            self.world_size,
            data.dataset,
            f"{data.cache.num_tokens:,}",
            cfg.tokenizer,
        )
        log.info("  checkpoints: %s (%s, %s)", cfg.experiment_url, cfg.format, saves)
        if cfg.dry_run:
            log.info(
                "  dry run:     one save to a scratch experiment beside it, then removed; "
                "no metrics or log written (this console only)"
            )
        else:
            log.info("  metrics:     %s", cfg.metrics_path)
            log.info("  log:         %s", cfg.exp_dir / "train.log")
        left = budget.seconds_left()
        if left is not None:
            log.info("  time left:   %s (%s)", fmt_duration(left), budget.deadline())
        log.info("  stop rule:   %s", budget.describe_rule())

    def startup(self, step: int, startup: Startup) -> None:
        """Start-up ends with the first step: from the allocation's start, in parts."""
        self.metrics.log("startup", step=step, **startup.event())
        log.info("first step done %s", startup.describe())

    def progress(
        self, step: int, window: tuple[float, int, float, list[float]], **fields: Any
    ) -> None:
        """One progress line and ``step`` event for the steps since the last one; ``window`` is
        :meth:`LossWindow.take`'s (mean loss, steps, seconds, each step's loss)."""
        loss, steps, seconds, each = window
        step_time = seconds / max(steps, 1)
        per_rank = self.cfg.tokens_per_step / step_time
        util = mfu(per_rank, self._flops_per_token, self._peak)
        self.metrics.log(
            "step",
            step=step,
            loss=loss,
            lr=fields["lr"],
            grad_norm=fields["grad_norm"],
            steps=steps,
            step_time_s=step_time,
            tokens_per_s=per_rank * self.world_size,
            tokens_per_s_per_rank=per_rank,
            mfu=util,
            seconds_left=fields["seconds_left"],
            data_position=fields["data_position"],
        )
        if self.wandb is not None:
            self.wandb.log({"loss": loss, "lr": fields["lr"], "tokens_per_s": per_rank}, step=step)
        self.loss_rows(step, each)
        log.info(
            "%s",
            progress_line(
                step=step,
                total=self.cfg.training_steps,
                loss=loss,
                lr=fields["lr"],
                tokens_per_s=per_rank * self.world_size,
                step_time=step_time,
                seconds_left=fields["seconds_left"],
                mfu=util,
            ),
        )

    def loss_rows(self, step: int, each: list[float]) -> None:
        """``--log-loss-to-csv``: one row per step, the last at ``step``."""
        if self._csv is None or not each:
            return
        first = step - len(each) + 1
        self._csv.write(_csv_rows((first + i, x) for i, x in enumerate(each)))

    def evaluation(self, step: int, val_loss: float, seconds: float) -> None:
        self.metrics.log("eval", step=step, seconds=seconds, **{VAL_LOSS: val_loss})
        log.info("step %d: validation loss %.4f", step, val_loss)
        if self.wandb is not None:
            self.wandb.log({VAL_LOSS: val_loss}, step=step)

    def stop(
        self,
        *,
        step: int,
        reason: str,
        cause: str,
        exit_code: int,
        budget: slurmclock.TimeBudget,
        losses: tuple[float | None, float | None],
    ) -> None:
        """The ``stop`` event (how the run ended, the signals that came, the budget's figures)
        and the summary lines."""
        flag = budget.signals
        self.metrics.log(
            "stop",
            step=step,
            reason=reason,
            cause=cause,
            exit_code=exit_code,
            seconds_left=budget.seconds_left(),
            signal=None if flag is None else flag.received,  # the first; all, in arrival order:
            signals=[] if flag is None else [name for name, _ in flag.arrivals],
            budget=budget.snapshot(),
        )
        done = exit_code == slurmclock.EXIT_FINISHED
        self.summary(done=done, step=step, reason=reason, exit_code=exit_code, losses=losses)

    def summary(
        self,
        *,
        done: bool,
        step: int,
        reason: str,
        exit_code: int,
        losses: tuple[float | None, float | None],
    ) -> None:
        """The last lines: how it ended, and where everything is."""
        cfg, (loss, val) = self.cfg, losses
        losses_text = "" if loss is None else f", loss {loss:.4f}"
        if val is not None:
            losses_text += f", validation loss {val:.4f}"
        if reason == "imported":
            log.info("imported: step %d/%d into %s", step, cfg.training_steps, cfg.experiment_url)
        elif done:
            log.info("finished: step %d/%d (%s)%s", step, cfg.training_steps, reason, losses_text)
        else:
            # Not "requeue": after scancel or `slurmclock stop` (a SIGTERM, as a preemption's)
            # the job script does not requeue, and this process cannot tell which it was.
            log.info(
                "stopped at step %d/%d (%s); exit %d = saved, %d steps left: the next run with "
                "--resume-from-checkpoint latest goes on from here",
                step,
                cfg.training_steps,
                reason,
                exit_code,
                cfg.training_steps - step,
            )
        if cfg.dry_run:  # nothing of it stayed: no resume, no report
            log.info("  checkpoints: %s (untouched)", cfg.experiment_url)
        else:
            log.info("  checkpoints: %s", cfg.experiment_url)
            log.info("  resume:      pyrecover-train --resume-from-checkpoint latest [same flags]")
            log.info("  plot:        pyrecover-train report %s", cfg.exp_dir)
        for file in (self.metrics.file, self._csv):
            if file is not None and file.failure is not None:  # said when it began; again here
                log.warning(
                    "  not written: %d line(s) of the %s %s (%s)",
                    file.lost,
                    file.what,
                    file.path,
                    file.failure,
                )

    def close(self) -> None:
        self.metrics.close()
        if self._csv is not None:
            self._csv.close()
            self._csv = None
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as e:  # optional logging must never fail a finished run
                log.debug("--wandb: finish failed: %s", e)


def _open_csv(path: Path) -> AppendFile:
    """The original's ``--log-loss-to-csv`` file (``Step,Loss``), appended to on a resume."""
    new = not path.exists() or path.stat().st_size == 0
    f = AppendFile(path, "loss CSV", say=logs.say_warning)
    if new:
        f.write(_csv_rows([("Step", "Loss")]))
    return f


def _csv_rows(rows: Iterable[tuple[Any, Any]]) -> bytes:
    text = io.StringIO(newline="")
    csv.writer(text).writerows(rows)
    return text.getvalue().encode()


def _wandb(
    cfg: TrainConfig, rank: int, model_config: dict[str, Any]
) -> wandb_log.WandbLogger | None:
    """Rank 0's W&B run; the id is derived from the experiment so a requeued job continues it."""
    try:
        logger = wandb_log.WandbLogger(
            project="pyrecover",
            name=cfg.experiment_name,
            config={"args": cfg.to_dict(), "model": model_config},
            run_id=f"{cfg.experiment_name}-{zlib.crc32(cfg.store_url.encode()):08x}",
            rank=rank,
        )
    except Exception as e:  # optional logging must never stop training
        log.warning("--wandb: not logging to Weights & Biases (%s)", e)
        return None
    if not logger.active:
        if rank == 0 and not logger.reported:  # a failure it logged itself: not twice
            log.warning("--wandb: not logging to Weights & Biases: %s", logger.reason)
        return None
    return logger


class LossWindow:
    """Losses since the last progress line, kept on the device: reading a GPU loss every step
    would synchronise, and stall the step queue. With ``each`` it also keeps every step's loss
    (for the loss CSV), read in the same one synchronisation."""

    def __init__(self, device: torch.device, *, each: bool = False) -> None:
        self.total = torch.zeros((), device=device)
        self.steps = 0
        self.start = time.perf_counter()
        self.each: list[torch.Tensor] | None = [] if each else None

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss
        self.steps += 1
        if self.each is not None:
            self.each.append(loss)

    def take(self) -> tuple[float, int, float, list[float]]:
        """(mean loss, steps, seconds, each step's loss) of the window; starts a new one."""
        each = [] if not self.each else torch.stack(self.each).tolist()
        out = (self.total.item() / max(self.steps, 1), self.steps, time.perf_counter() - self.start)
        self.total.zero_()
        self.steps, self.start = 0, time.perf_counter()
        if self.each is not None:
            self.each = []
        return (*out, each)


def _say_original_flags(cfg: TrainConfig) -> None:
    """The original PyRecover's flags whose job is done here by design: said, never silent."""
    notes = {
        "timeaware_checkpointing": "always on here (stop with a final save before the deadline)",
        "verify_checkpoints": "always on here (every checkpoint file is checksummed and verified)",
        "use_flash_attention": "the attention is torch SDPA, which picks FlashAttention kernels "
        "on CUDA (bf16/fp16) by itself",
    }
    for name, note in notes.items():
        if getattr(cfg, name) not in (None, False):
            log.info("--%s: %s", name.replace("_", "-"), note)


class HangupAware(slurmclock.StopSignals):
    """Ctrl-C and SIGHUP (the terminal or ssh session went away) stop with a final save, as
    SIGTERM does (before, a hangup killed the run and lost every step since the last save).
    After a hangup every write to the terminal fails (EIO, a logging error per line): stdout and
    stderr that are terminals go to /dev/null (train.log and the metrics keep everything)."""

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGHUP:
            _detach_from_terminal()
        super()._handle(signum, frame)


def _detach_from_terminal() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            if os.isatty(fd):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)
