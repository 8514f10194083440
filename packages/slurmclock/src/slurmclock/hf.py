"""A Hugging Face ``transformers.Trainer`` callback: stop and save before the SLURM deadline.

``TimeAwareCallback`` (extra ``[hf]``)::

    from slurmclock.hf import TimeAwareCallback, last_checkpoint

    timer = TimeAwareCallback()
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[timer])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))  # None at first
    sys.exit(timer.exit_code)  # 75: stopped early with a checkpoint (requeue); 0: finished

After every optimizer step it measures the step, asks :class:`slurmclock.TimeBudget` whether the
next step plus a save plus the margin still fit before the job's end, makes every rank agree (an
all-reduce when ``torch.distributed`` is initialized: any rank that must stop stops them all), and
if not, sets ``control.should_save`` and ``control.should_training_stop``: the Trainer writes its
regular ``checkpoint-N`` (model, optimizer, scheduler, RNG states, ``trainer_state.json``) and
returns. Stop signals (default SIGUSR2 and SIGTERM) only raise a flag read at the next step. The
save is timed (``on_save``) and feeds the budget, like periodic ``save_steps`` saves. Rank 0 writes
the budget's measurements next to the checkpoint (``checkpoint-N/slurmclock_budget.json``, after
the Trainer's own files): the resumed run starts from the save times and exits the earlier
allocations measured, not from the initial guesses.

Resume is the Trainer's own, from :func:`last_checkpoint`: ``train(resume_from_checkpoint=...)``
restores weights, optimizer, scheduler and RNG, and skips the batches of the current epoch already
seen (the sampler is re-seeded from ``args.seed``/``data_seed`` and the epoch, so the order is the
same). What is exact and what is not: the README, section "Hugging Face Trainer".
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slurmclock._trainers import (
    EXIT_FINISHED,
    EXIT_STOPPED,
    StopPolicy,
    TimeAware,
    stop_message,
)
from slurmclock.budget import TimeBudget
from slurmclock.deadline import Deadline, DeadlineWatcher

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "slurmclock.hf needs transformers >= 4.40: pip install 'slurmclock[hf]'"
    ) from e

__all__ = [
    "BUDGET_FILE",
    "EXIT_FINISHED",
    "EXIT_STOPPED",
    "TimeAwareCallback",
    "checkpoint_step",
    "last_checkpoint",
]

log = logging.getLogger("slurmclock")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# The Trainer writes trainer_state.json last: a checkpoint-N without it was cut short.
_WRITTEN_LAST = "trainer_state.json"
BUDGET_FILE = "slurmclock_budget.json"  # the budget's measurements, beside the Trainer's files


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest *complete* ``checkpoint-N`` under ``output_dir`` (None if there is none).

    Unlike ``transformers.trainer_utils.get_last_checkpoint``, a folder whose save was killed
    before ``trainer_state.json`` (the Trainer writes it last) is skipped with a warning
    instead of being resumed from (which fails or, worse, loads half a checkpoint).
    """
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return None
    steps = sorted(
        ((int(m.group(1)), name) for name in names if (m := _CHECKPOINT_RE.match(name))),
        reverse=True,
    )
    for _, name in steps:
        path = os.path.join(output_dir, name)
        if os.path.isfile(os.path.join(path, _WRITTEN_LAST)):
            return path
        if os.path.isdir(path):
            log.warning(
                "slurmclock: skipping %s: no %s (the save was cut short)", path, _WRITTEN_LAST
            )
    return None


def checkpoint_step(checkpoint: str | os.PathLike[str]) -> int:
    """The optimizer step a ``checkpoint-N`` folder holds (its ``trainer_state.json``).

    Resuming a run that already reached ``max_steps`` makes the Trainer take one more step
    (transformers 5.x); compare this with ``max_steps`` first and skip ``train()``.
    """
    with open(os.path.join(checkpoint, _WRITTEN_LAST), encoding="utf-8") as f:
        return int(json.load(f)["global_step"])


class TimeAwareCallback(TimeAware, TrainerCallback):
    """Stop in time with a saved checkpoint; ``exit_code`` 75 when steps are left, else 0.

    ``deadline``: a :class:`DeadlineWatcher` or :class:`Deadline` (default ``DeadlineWatcher()``:
    override, then ``PYRECOVER_END_TIME``, then SLURM). ``margin`` (None: slurmclock's measured
    exit + slack), ``initial_save_estimate``,
    ``warmup_steps``: as in :class:`TimeBudget`, or pass a ready ``budget``. ``signals``: stop
    signals. ``save_on_train_end``: also save at the last step, so that running the job again
    finds it finished instead of redoing the steps after the last checkpoint.
    """

    def __init__(
        self,
        *,
        deadline: DeadlineWatcher | Deadline | None = None,
        margin: float | None = None,
        initial_save_estimate: float = 60.0,
        warmup_steps: int = 2,
        signals: Iterable[str | int] = ("USR2", "TERM"),
        save_on_train_end: bool = True,
        budget: TimeBudget | None = None,
    ) -> None:
        self.policy = StopPolicy(
            budget=budget,
            deadline=deadline,
            margin=margin,
            initial_save_estimate=initial_save_estimate,
            warmup_steps=warmup_steps,
            signals=signals,
        )
        self.save_on_train_end = save_on_train_end
        self.stopped_early = False
        self._save_started: float | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.stopped_early = False
        if state.global_step > 0:  # resumed: the Trainer loaded checkpoint-N's state
            _load_budget(self.budget, _checkpoint_dir(args, state) / BUDGET_FILE)
        self.policy.begin()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        decision = self.policy.after_step(watch_clock=state.is_world_process_zero)
        stop = _any_rank(bool(decision), args)
        finished = state.max_steps > 0 and state.global_step >= state.max_steps
        if stop and not finished:
            if state.is_world_process_zero:
                print(stop_message(state.global_step, state.max_steps, decision or None, "a peer"))
            self.stopped_early = True
            control.should_save = True
            control.should_training_stop = True
        elif finished and self.save_on_train_end:
            control.should_save = True
        if control.should_save:
            self._save_started = self.policy.now()

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._save_started is not None:
            # The Trainer writes synchronously: the save is done when on_save fires.
            self.policy.time_save(self.policy.now() - self._save_started)
            self._save_started = None
        if state.is_world_process_zero:
            _store_budget(self.budget, _checkpoint_dir(args, state))
        if self.stopped_early:
            self.policy.final_save_done()
        self.policy.paused()

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.policy.paused()  # an evaluation is not a training step

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.policy.end()


def _checkpoint_dir(args: TrainingArguments, state: TrainerState) -> Path:
    return Path(args.output_dir or "trainer_output") / f"checkpoint-{state.global_step}"


def _store_budget(budget: TimeBudget, folder: Path) -> None:
    """The budget's state beside the checkpoint, atomically; a save that did not write the
    folder (a hyperparameter search's run folder) or a failing disk only costs the estimates."""
    if not folder.is_dir():
        return
    tmp = folder / f".{BUDGET_FILE}.tmp"
    try:
        tmp.write_text(json.dumps(budget.state_dict()), encoding="utf-8")
        os.replace(tmp, folder / BUDGET_FILE)
    except OSError as e:
        log.warning("slurmclock: could not write %s: %s", folder / BUDGET_FILE, e)


def _load_budget(budget: TimeBudget, path: Path) -> None:
    """A missing or unreadable file (a checkpoint from before, or from another callback) means
    starting from the initial estimates, said once."""
    try:
        budget.load_state_dict(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.warning("slurmclock: ignoring %s (%s): starting from the initial estimates", path, e)


def _any_rank(flag: bool, args: TrainingArguments) -> bool:
    """True on every rank when it is true on any (MAX all-reduce on the training device)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], device=args.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
