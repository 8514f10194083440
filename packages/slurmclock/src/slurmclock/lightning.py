"""A Lightning callback: stop before the SLURM deadline with a saved checkpoint, exit 75, resume.

``TimeAwareCallback`` (extra ``[lightning]``) brings slurmclock's time budget to any
``lightning.Trainer``::

    from slurmclock.lightning import TimeAwareCallback

    timer = TimeAwareCallback(dirpath="ckpts")
    trainer = L.Trainer(max_steps=10_000, callbacks=[timer])
    trainer.fit(model, datamodule, ckpt_path=timer.resume_path())  # None on the first run
    sys.exit(timer.exit_code)  # 75: stopped early with a checkpoint (requeue); 0: finished

At every optimizer step it drives slurmclock's :class:`~slurmclock.TimeLoop` -- the protocol
pyrecover-train follows too: rank 0 measures the step and asks the time budget whether the next
step plus a final save plus the exit still fit before the job's end (``PYRECOVER_END_TIME``,
SLURM's end time via squeue, ...), every rank adds its stop signals, and one agreement through the
strategy makes them stop at the same step. Then it saves one checkpoint from
``on_train_batch_end`` -- Lightning's own resumable point, with the loop counters and the state
of a resumable dataloader -- waits until it is durable and ends ``fit``, or, after a stop for
time, trains on and saves again while the final save's unused time allows (extra saves, below).
Stop signals (default SIGUSR2 and SIGTERM) only raise a flag that the next step boundary reads.

What it adds to Lightning's checkpoint so that a resume is bitwise equal to a run that never
stopped (on CPU, same world size): every rank's RNG states (torch, CUDA, numpy, Python), restored
when training restarts. For exactness the dataloader must be resumable (``state_dict`` /
``load_state_dict``, e.g. ``torchdata``'s ``StatefulDataLoader``; Lightning warns otherwise) and
sized (``__len__``: from an unsized loader Lightning prefetches a batch and saves the state after
it, so a resume would skip that batch; the callback warns).

The first allocation measures instead of guessing: with no save time known yet (none measured,
none in the checkpoint) it saves once right after the warm-up (``probe_saves``), and it guesses
the exit from the allocation's measured launch until the job's timeline has measured one.

**Extra saves.** The final save's tail bound keeps it safe, so it usually ends early; the rest is
spent training and saving again. An extra save still writing when the exit must begin (or when
a stop signal comes) is abandoned: a watchdog thread marks the job's timeline and ends the
process with 75 (``os._exit``: Lightning's save runs on the main thread, which cannot be
interrupted mid-write). The file stays whole: Lightning writes a checkpoint in one atomic step
(a temporary file moved into place; one object on S3), ckptstore's ``CkptStoreIO`` commits with a
manifest -- so the previous checkpoint stands. Strategies whose checkpoint is a folder of shards
written by every rank (FSDP's sharded state, DeepSpeed) are not written atomically: there the
callback makes no extra saves.

With ``SLURMEnvironment(auto_requeue=True)`` (Lightning's default under SLURM) the callback takes
over: Lightning's handler would save from inside the signal handler, mid-step, and requeue at once;
here the requeue signal (SIGUSR1) becomes one more stop flag, the save happens at the next step
boundary, and the requeue follows the exit status (75), like ``pyrecover-train`` -- or, with
``requeue=True``, from the callback itself once the checkpoint is durable.

Saves go through the trainer's ``CheckpointIO``; with ckptstore's ``CkptStoreIO`` they are verified,
atomic and asynchronous, and their durable times (``saves_completed()``) feed the budget.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from slurmclock.budget import TimeBudget
from slurmclock.deadline import Deadline, DeadlineWatcher
from slurmclock.job import in_slurm
from slurmclock.loop import EXIT_FINISHED, EXIT_STOPPED, Action, TimeAware
from slurmclock.requeue import RequeueResult, requeue
from slurmclock.signals import STOP_SIGNALS, signal_number

try:
    import lightning.pytorch as pl
    import torch
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "slurmclock.lightning needs Lightning >= 2.2 and torch: pip install "
        "'slurmclock[lightning]' (and torchdata for a resumable dataloader)"
    ) from e

__all__ = ["EXIT_FINISHED", "EXIT_STOPPED", "TimeAwareCallback"]


class TimeAwareCallback(TimeAware, Callback):
    """Stop in time with a durable checkpoint; ``exit_code`` 75 when steps are left, else 0.

    ``dirpath``/``filename``: where the stop checkpoint goes (default: the trainer's
    ``default_root_dir``); ``resume_path()`` finds it again. ``deadline``: a
    :class:`DeadlineWatcher` or :class:`Deadline` (default ``DeadlineWatcher()``: override, then
    ``PYRECOVER_END_TIME``, then SLURM). ``margin`` (None: slurmclock's measured exit + slack),
    ``initial_save_estimate`` (until a save is measured: see ``probe_saves``), ``warmup_steps``:
    as in :class:`TimeBudget`; or pass a ready ``budget``. The budget's measured figures travel
    in the checkpoint, so the next allocation starts from them. ``signals``: stop signals.
    ``every_n_steps``: also save periodically (when ``can_save()``), so a crash or a kill without
    warning loses at most that many steps. ``probe_saves``: with no save time known, save once
    after the warm-up to measure it. ``extra_saves``: after a stop for time, train on and save
    again while the final save's unused time allows (module docstring). ``save_on_train_end``:
    save when training finishes, so that running the job again finds it finished. ``requeue``:
    after an early stop, rank 0 runs ``scontrol requeue`` itself (instead of the batch script
    acting on exit 75).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        filename: str = "timeaware.ckpt",
        *,
        deadline: DeadlineWatcher | Deadline | None = None,
        margin: float | None = None,
        initial_save_estimate: float | None = None,
        warmup_steps: int = 2,
        signals: Iterable[str | int] = STOP_SIGNALS,
        every_n_steps: int | None = None,
        probe_saves: bool = True,
        extra_saves: bool = True,
        save_on_train_end: bool = True,
        requeue: bool = False,
        budget: TimeBudget | None = None,
    ) -> None:
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(
                f"every_n_steps must be an integer >= 1 or None, got {every_n_steps!r}"
            )
        if not filename or "/" in filename:
            raise ValueError(
                f"filename must be a plain file name like 'timeaware.ckpt': {filename!r}"
            )
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.filename = filename
        self.every_n_steps = every_n_steps
        self.save_on_train_end = save_on_train_end
        self.requeue = requeue
        self.loop = self.make_loop(
            budget,
            deadline=deadline,
            margin=margin,
            initial_save_estimate=initial_save_estimate,
            warmup_steps=warmup_steps,
            signals=signals,
            probe_saves=probe_saves,
            extra_saves=extra_saves,
        )
        self.requeue_result: RequeueResult | None = None
        self._requeue_signal: str | None = None  # Lightning's, taken over
        self._saved_step: int | None = None
        self._background_steps: set[int] = set()  # saves written while training went on
        self._seen_step: int | None = None
        self._rng_to_restore: list[dict[str, Any]] | None = None
        self._path: str | None = None

    # -- public -----------------------------------------------------------------------------

    def checkpoint_path(self, trainer: pl.Trainer | None = None) -> str:
        """Where the stop checkpoint is written."""
        if self.dirpath is not None:
            return os.path.join(self.dirpath, self.filename)
        if trainer is None:
            raise ValueError("pass the trainer (no dirpath given: it uses default_root_dir)")
        return os.path.join(str(trainer.default_root_dir), self.filename)

    def resume_path(self, trainer: pl.Trainer | None = None) -> str | None:
        """The checkpoint to pass as ``trainer.fit(..., ckpt_path=)``; None when there is none
        yet (a first run). Works with any ``CheckpointIO`` (a file, or ckptstore's directory)."""
        from lightning.fabric.utilities.cloud_io import get_filesystem

        path = self.checkpoint_path(trainer)
        return path if get_filesystem(path).exists(path) else None

    @property
    def state_key(self) -> str:
        return "slurmclock.TimeAwareCallback"

    # -- checkpoint content: every rank's RNG ------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # dump_checkpoint runs on every rank; only rank 0's copy is written, so gather here.
        return {
            "rng": _gather(_rng_states()),
            "stopped_early": self.stopped_early,
            "budget": self.budget.state_dict(),  # rank 0's: it owns the clock
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rng = state_dict.get("rng")
        self._rng_to_restore = list(rng) if rng else None
        self.budget.load_state_dict(state_dict.get("budget") or {})

    # -- hooks ------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._path = self.checkpoint_path(trainer)
        env = getattr(getattr(trainer, "_accelerator_connector", None), "cluster_environment", None)
        if isinstance(env, SLURMEnvironment) and env.auto_requeue:
            # Runs before Lightning registers its handlers: it then leaves the signal to us. Said
            # when the signal comes (without --signal it never does: nothing is taken over).
            env.auto_requeue = False
            if env.requeue_signal is not None:
                self.loop.add_signal(env.requeue_signal)
                self._requeue_signal = signal_number(env.requeue_signal).name

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning's own SIGTERM handler went in: ours replaces it while training runs.
        strategy = trainer.strategy
        self.loop.connect(
            leader=trainer.is_global_zero,
            agree=lambda *values: _agree(strategy, values),
            share=lambda obj: strategy.broadcast(obj, src=0),
        )
        self.loop.background_saves = _async_io(trainer)
        if self.loop.extra_saves and not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            rank_zero_info(
                f"slurmclock: no extra saves with {type(strategy).__name__}: its checkpoint is "
                "not written in one atomic step, so an abandoned one could be torn"
            )
            self.loop.extra_saves = False
        self.loop.begin()
        self._seen_step = trainer.global_step
        _warn_if_prefetched(trainer.train_dataloader)
        if self._rng_to_restore:
            rank = trainer.global_rank
            _set_rng_states(self._rng_to_restore[rank % len(self._rng_to_restore)])
            self._rng_to_restore = None

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        if step == self._seen_step or not self.loop.training:
            return  # accumulating gradients: not a step boundary
        self._seen_step = step
        self._collect_saves(trainer)
        due = bool(self.every_n_steps) and step % (self.every_n_steps or 1) == 0
        act = self.loop.after_step(step, save_due=due, last=_finished(trainer))
        if act.save == "final" and self.loop.stopped_early:
            self._say_stop(step, trainer)
        if act.save:
            self._save(trainer, act)
        if not self.loop.training:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if self.save_on_train_end and not self.stopped_early and self._saved_step != step:
            self._write(trainer, durable=True)  # ended otherwise (max_time, early stopping)
        _wait(trainer)
        if self.requeue and self.stopped_early and trainer.is_global_zero and in_slurm():
            # The handlers are still ours: the SIGTERM SLURM sends on requeue only raises a flag.
            self.requeue_result = requeue(timeline=self.budget.timeline)
            rank_zero_info(f"slurmclock: {self.requeue_result.message}")
        self.loop.end()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.loop.end()

    # -- saving -----------------------------------------------------------------------------

    def _say_stop(self, step: int, trainer: pl.Trainer) -> None:
        total = trainer.max_steps if trainer.max_steps > 0 else None
        rank_zero_info(self.loop.stop_message(step, total))
        if self._requeue_signal and self._requeue_signal in self.loop.reason:
            rank_zero_info(
                f"slurmclock: {self._requeue_signal} is Lightning's requeue signal, taken over: "
                "a checkpoint at this step boundary, then exit 75 (the batch script requeues)"
            )

    def _save(self, trainer: pl.Trainer, act: Action) -> None:
        """The save the loop asked for: periodic, or final/extra (durable before it goes on)."""
        with self.loop.saving(act):  # an extra save: abandoned if not durable in time
            if act.save != "final" or self.save_on_train_end or self.stopped_early:
                self._write(trainer, durable=act.durable)

    def _write(self, trainer: pl.Trainer, *, durable: bool) -> None:
        step = trainer.global_step
        assert self._path is not None
        if self._saved_step != step:
            start = time.monotonic()
            # A full checkpoint, said so: Lightning logs "`weights_only` was not set" otherwise
            # at every save (26 lines in a run with every_n_steps).
            trainer.save_checkpoint(self._path, weights_only=False)
            self._saved_step = step
            if not hasattr(trainer.strategy.checkpoint_io, "saves_completed"):
                # A plain CheckpointIO writes synchronously: this was the whole save.
                if trainer.is_global_zero:
                    self.loop.saved(step, time.monotonic() - start)
            elif not durable and _async_io(trainer):
                self._background_steps.add(step)  # persisted while the next steps run
        if durable:
            _wait(trainer)
            self._collect_saves(trainer)

    def _collect_saves(self, trainer: pl.Trainer) -> None:
        completed = getattr(trainer.strategy.checkpoint_io, "saves_completed", None)
        if completed is not None and trainer.is_global_zero:
            for stats in completed():
                background = stats.step in self._background_steps
                self._background_steps.discard(stats.step)
                self.loop.saved(stats.step, float(stats.total_s), background=background)


def _agree(strategy: Any, values: tuple[int, ...]) -> tuple[int, ...]:
    """Every rank's ``values``, element-wise maximum (one all-reduce through the strategy)."""
    if strategy.world_size == 1:
        return tuple(values)
    t = torch.tensor(values, dtype=torch.int64, device=strategy.root_device)
    return tuple(int(v) for v in strategy.reduce(t, reduce_op="max").tolist())


def _warn_if_prefetched(loaders: Any) -> None:
    """Lightning prefetches a batch from a loader without ``__len__`` and saves the loader's state
    after it: a resume would skip that batch. Say so once, with the fix."""
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
        stateful = hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")
        if stateful and not hasattr(type(loader), "__len__"):
            rank_zero_warn(
                f"slurmclock: {type(loader).__name__} is resumable but has no __len__: Lightning "
                "prefetches one batch from it and saves its state after that batch, so a resume "
                "skips one batch; give it a __len__ (batches per epoch) for an exact resume, e.g. "
                "parquetlm.torch.SizedLoader(loader, length)"
            )


def _async_io(trainer: pl.Trainer) -> bool:
    """Does the CheckpointIO persist in the background (ckptstore's CkptStoreIO by default)?"""
    io = trainer.strategy.checkpoint_io
    return hasattr(io, "saves_completed") and not getattr(io, "blocking", False)


def _finished(trainer: pl.Trainer) -> bool:
    if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
        return True
    epochs = trainer.max_epochs  # None or -1: no limit
    last_epoch = epochs is not None and epochs > 0 and trainer.current_epoch + 1 >= epochs
    return bool(last_epoch and trainer.is_last_batch)


def _wait(trainer: pl.Trainer) -> None:
    """Durability barrier of the CheckpointIO, when it has one (ckptstore's does)."""
    wait = getattr(trainer.strategy.checkpoint_io, "wait", None)
    if wait is not None and trainer.is_global_zero:
        wait()
    trainer.strategy.barrier("slurmclock-save")


def _rng_states() -> dict[str, Any]:
    """Lightning's RNG capture with numpy's key as a list: plain data loads with weights_only."""
    states = _collect_rng_states(include_cuda=True)
    if "numpy" in states:
        name, key, pos, has_gauss, gauss = states["numpy"]
        states["numpy"] = (name, [int(k) for k in key], int(pos), int(has_gauss), float(gauss))
    return states


def _gather(value: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
