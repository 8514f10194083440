"""When to save: "is a periodic save due?", with the state that needs.

The schedule owns the step of the last save, its time, and the measured blocking cost of every
save (for ``--checkpoint-interval-seconds auto``, Young/Daly). Whether a save may start before
the deadline is the time budget's (slurmclock's ``TimeLoop``): a save that cannot finish before
the kill is skipped there.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import slurmclock

from .config import TrainConfig
from .metrics import fmt_duration

# Assumed blocking cost of a save for --checkpoint-interval-seconds auto until one is measured.
AUTO_ASSUMED_SAVE_COST = 10.0


class SaveSchedule:
    """Periodic saves every ``--checkpoint-frequency`` steps, every ``--checkpoint-interval-
    seconds`` (fixed or auto), and at every evaluation with ``--keep-best``."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        saved_step: int | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.every_steps = cfg.checkpoint_frequency
        self.interval_setting = cfg.checkpoint_interval_seconds
        self.mtbf = cfg.mtbf
        self.save_at_eval = bool(cfg.keep_best)  # the best must have a measured val loss
        self.clock = clock
        self.last_step = saved_step  # the step a checkpoint holds (None: none yet)
        self.last_time = clock()
        self.costs: list[float] = []  # blocking seconds of each save of this process

    def due(self, step: int, evaluated: bool) -> bool:
        if self.every_steps and step % self.every_steps == 0:
            return True
        if self.save_at_eval and evaluated:
            return True
        interval = self.interval()
        return interval is not None and self.clock() - self.last_time >= interval

    def interval(self) -> float | None:
        """Seconds between time-based saves: fixed, Young/Daly (auto), or None (off)."""
        return slurmclock.checkpoint_interval(
            self.interval_setting, self.costs, AUTO_ASSUMED_SAVE_COST, self.mtbf
        )

    def saved(self, step: int, blocking_s: float) -> None:
        self.last_step, self.last_time = step, self.clock()
        self.costs.append(blocking_s)

    def unsaved(self, step: int) -> bool:
        """Does ``step`` still need a save (the final one)?"""
        return self.last_step != step

    def describe(self) -> str:
        """How often it saves, for the banner."""
        every = []
        if self.every_steps:
            every.append(f"every {self.every_steps} steps")
        if self.interval_setting == "auto":
            every.append(
                f"every ~{fmt_duration(self.interval())} (auto: Young/Daly with MTBF "
                f"{fmt_duration(self.mtbf)}, re-estimated from each measured save)"
            )
        elif self.interval_setting is not None:
            every.append(f"every {self.interval_setting} s")
        return " and ".join(every) or "at the end only"
