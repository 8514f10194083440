"""A Hugging Face ``transformers.Trainer`` callback: stop and save before the SLURM deadline.

``TimeAwareCallback`` (extra ``[hf]``)::

    from slurmclock.hf import TimeAwareCallback, last_checkpoint

    timer = TimeAwareCallback()
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[timer])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))  # None at first
    sys.exit(timer.exit_code)  # 75: stopped early with a checkpoint (requeue); 0: finished

After every optimizer step it drives slurmclock's :class:`~slurmclock.TimeLoop` -- the protocol
pyrecover-train follows too: rank 0 asks the time budget whether the next step plus a save plus
the exit still fit before the job's end, every rank adds its stop signals, and they agree (a MAX
all-reduce when ``torch.distributed`` is initialized). To stop it sets ``control.should_save``:
the Trainer writes its regular ``checkpoint-N`` (model, optimizer, scheduler, RNG states,
``trainer_state.json``) and returns -- or, after a stop for time, trains on and saves again while
the final save's unused time allows (extra saves). A periodic ``save_steps`` save starts only
when the budget says it ends in time. Stop signals (default SIGUSR2 and SIGTERM) only raise a
flag read at the next step. Saves are timed until ``on_save`` and feed the budget; rank 0 writes
the budget's measurements next to the checkpoint (``checkpoint-N/slurmclock_budget.json``, after
the Trainer's own files): the resumed run starts from the save times and exits the earlier
allocations measured. In the first allocation, with no save time known, one save right after the
warm-up measures it (``probe_saves``).

An extra save still being written when the exit must begin (or when a stop signal comes) is
abandoned: a watchdog thread marks the job's timeline and ends the process with 75. Its
``checkpoint-N`` folder then lacks ``trainer_state.json`` (the Trainer writes it last), so
:func:`last_checkpoint` skips it and the run resumes from the one before (``transformers``' own
``get_last_checkpoint`` would not skip it).

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

from slurmclock.budget import TimeBudget
from slurmclock.deadline import Deadline, DeadlineWatcher
from slurmclock.loop import EXIT_FINISHED, EXIT_STOPPED, TimeAware
from slurmclock.signals import STOP_SIGNALS
from slurmclock.untrusted import read_bytes

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
# What an exact resume needs beside the weights, by the names the Trainer saves it under
# (optimizer.pt/.bin, FSDP's optimizer_0/ folder, DeepSpeed's global_stepN/; rng_state*.pth).
_RESUME_STATE = {"optimizer": ("optimizer", "global_step"), "RNG": ("rng_state",)}


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest *complete* ``checkpoint-N`` under ``output_dir`` (None if there is none).

    Unlike ``transformers.trainer_utils.get_last_checkpoint``, a folder whose save was killed
    before or while ``trainer_state.json`` was written (the Trainer writes it last: missing,
    empty or cut off) is skipped with a warning naming it, instead of being resumed from
    (which fails or, worse, loads half a checkpoint); the newest complete one before it is
    taken.
    """
    try:
        names = os.listdir(output_dir)
    except FileNotFoundError:
        return None
    steps = sorted(
        ((int(m.group(1)), name) for name in names if (m := _CHECKPOINT_RE.match(name))),
        reverse=True,
    )
    skipped: list[str] = []
    for _, name in steps:
        path = os.path.join(output_dir, name)
        if not os.path.isdir(path):
            continue
        problem = _incomplete(path)
        if problem is None:
            if skipped:
                log.warning(
                    "slurmclock: resuming from %s, the newest complete checkpoint; skipped %s",
                    name,
                    "; ".join(skipped),
                )
            return path
        skipped.append(f"{name} ({problem}: the save was cut short)")
    if skipped:
        log.warning(
            "slurmclock: no complete checkpoint in %s; skipped %s", output_dir, "; ".join(skipped)
        )
    return None


def _incomplete(checkpoint: str) -> str | None:
    """Why ``checkpoint``'s ``trainer_state.json`` does not show a finished save, or None."""
    path = os.path.join(checkpoint, _WRITTEN_LAST)
    try:  # written by another process: a regular file, bounded, never a blocking read
        text, _, cut = read_bytes(path)
    except FileNotFoundError:
        return f"no {_WRITTEN_LAST}"
    except OSError as e:
        return f"{_WRITTEN_LAST} unreadable: {e.strerror or e}"
    if not text.strip():
        return f"{_WRITTEN_LAST} is empty"
    try:
        state = None if cut else json.loads(text)
    except (ValueError, RecursionError):
        state = None
    if state is None:
        return f"{_WRITTEN_LAST} is not whole JSON"
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return f"{_WRITTEN_LAST} has no global_step"
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
    exit + slack), ``initial_save_estimate`` (until a save is measured), ``warmup_steps``: as in
    :class:`TimeBudget`, or pass a ready ``budget``. ``signals``: stop signals. ``probe_saves``:
    with no save time known, save once after the warm-up to measure it. ``extra_saves``: after
    a stop for time, train on and save again while the final save's unused time allows.
    ``save_on_train_end``: also save at the last step, so that running the job again finds it
    finished instead of redoing the steps after the last checkpoint.
    """

    def __init__(
        self,
        *,
        deadline: DeadlineWatcher | Deadline | None = None,
        margin: float | None = None,
        initial_save_estimate: float | None = None,
        warmup_steps: int = 2,
        signals: Iterable[str | int] = STOP_SIGNALS,
        probe_saves: bool = True,
        extra_saves: bool = True,
        save_on_train_end: bool = True,
        budget: TimeBudget | None = None,
    ) -> None:
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
        self.save_on_train_end = save_on_train_end
        self._save_started: float | None = None
        self._saving: Any = None  # the loop's context of the save the Trainer makes next

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step > 0:  # resumed: the Trainer loaded checkpoint-N's state
            _load_budget(self.budget, _checkpoint_dir(args, state) / BUDGET_FILE)
        if state.is_world_process_zero:
            _say_if_not_exact(args, state)
        device = args.device
        self.loop.connect(
            leader=state.is_world_process_zero,
            agree=lambda *values: _agree(values, device),
            share=lambda obj: _share(obj, device),
        )
        self.loop.begin()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if not self.loop.training:
            return
        step, finished = state.global_step, 0 < state.max_steps <= state.global_step
        due = control.should_save  # the Trainer's own save_steps save
        act = self.loop.after_step(step, save_due=due, last=finished)
        if act.save == "final" and self.loop.stopped_early and state.is_world_process_zero:
            print(self.loop.stop_message(step, state.max_steps))
        at_end = act.save == "final" and self.loop.finished and not self.save_on_train_end
        control.should_save = due if at_end else act.save is not None
        if act.save is not None:
            self._saving = self.loop.saving(act)  # an extra save: abandoned if not in time
            self._saving.__enter__()
        if control.should_save:
            self._save_started = self.loop.budget.timer()
        else:
            self._close_save(control)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._save_started is not None and state.is_world_process_zero:
            # The Trainer writes synchronously: the save is done when on_save fires.
            seconds = self.loop.budget.timer() - self._save_started
            self.loop.saved(state.global_step, seconds)
        self._save_started = None
        if state.is_world_process_zero:
            _store_budget(self.budget, _checkpoint_dir(args, state))
        self._close_save(control)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.loop.paused()  # an evaluation is not a training step

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.loop.end()

    def _close_save(self, control: TrainerControl) -> None:
        """The save (if any) is done: the loop plans on or ends, and the Trainer follows."""
        if self._saving is not None:
            saving, self._saving = self._saving, None
            saving.__exit__(None, None, None)
        if not self.loop.training:
            control.should_training_stop = True


def _checkpoint_dir(args: TrainingArguments, state: TrainerState) -> Path:
    return Path(args.output_dir or "trainer_output") / f"checkpoint-{state.global_step}"


def _say_if_not_exact(args: TrainingArguments, state: TrainerState) -> None:
    """The Trainer resumes without a word from a checkpoint that holds the weights only
    (``save_only_model=True``): the optimizer's moments, the LR schedule and the RNG start
    over. Said once, at the start of each run that has or makes such checkpoints."""
    folder = _checkpoint_dir(args, state)
    if state.global_step > 0 and folder.is_dir():  # else resumed from elsewhere: unknown
        names = os.listdir(folder)
        missing = [
            part
            for part, prefixes in _RESUME_STATE.items()
            if not any(n.startswith(prefixes) for n in names)
        ]
        if missing:
            log.warning(
                "slurmclock: %s holds no %s state (saved with save_only_model=True?): this "
                "resume is not exact (they start over); set save_only_model=False for exact "
                "resumes",
                folder,
                "/".join(missing),
            )
            return
    if args.save_only_model:
        log.warning(
            "slurmclock: save_only_model=True: the checkpoints a stop saves hold the weights "
            "only, so the resume will not be exact (optimizer, LR schedule and RNG start over); "
            "set save_only_model=False for exact resumes"
        )


def _store_budget(budget: TimeBudget, folder: Path) -> None:
    """The budget's state beside the checkpoint, atomically; a save that did not write the
    folder (a hyperparameter search's run folder) or a failing disk only costs the estimates."""
    if not folder.is_dir():
        return
    problem = budget.save_state_file(folder / BUDGET_FILE)
    if problem is not None:
        log.warning("slurmclock: %s", problem)


def _load_budget(budget: TimeBudget, path: Path) -> None:
    """A missing or unreadable file (a checkpoint from before, or from another callback) means
    starting from the initial estimates, said once (the file is read as untrusted input)."""
    problem = budget.load_state_file(path)
    if problem is not None:
        log.warning("slurmclock: %s: starting from the initial estimates", problem)


def _agree(values: tuple[int, ...], device: Any) -> tuple[int, ...]:
    """Every rank's ``values``, element-wise maximum (one all-reduce on the training device)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tuple(values)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(int(v) for v in t.tolist())


def _share(obj: Any, device: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]
