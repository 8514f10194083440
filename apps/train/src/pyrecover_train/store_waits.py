"""How long each wait on the checkpoint store may last (ckptstore's ``CallLimits``), from the
time left and the measured saves: the store is opened before the time budget exists, so the
first contact is bounded by one look at the deadline; the budget and the store are handed in
once they are made."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import ckptstore
import slurmclock

from .config import TrainConfig

log = logging.getLogger("pyrecover_train")

# How long one wait on the store may last: this many measured saves, at least STORE_CALL_MIN_S;
# before a save is measured (the first contact, the resume), STORE_CALL_FIRST_S.
STORE_CALL_SAVES = 4.0
STORE_CALL_MIN_S = 10.0
STORE_CALL_FIRST_S = 30.0
STORE_CALL_LATE_S = 5.0  # what a call gets however late it is

# How long one collective may take (ddpkit's process-group timeout): a quarter of the time left
# at the start, at most ddpkit's own 180 s, at least DIST_TIMEOUT_MIN_S (a slow first collective
# -- rank 0 preparing the data, a save -- is no hang). PYRECOVER_DIST_TIMEOUT overrides it.
DIST_TIMEOUT_SHARE = 0.25
DIST_TIMEOUT_MIN_S = 60.0
DIST_TIMEOUT_MAX_S = 180.0


def deadline_at_start(cfg: TrainConfig) -> slurmclock.Deadline:
    """One look at the deadline before the budget watches it (a failed look: none)."""
    try:
        return slurmclock.find_deadline(time_limit=cfg.time_limit, command_timeout=5.0)
    except Exception as e:  # the budget looks again and says what is wrong
        log.debug("no deadline at the start: %s", e)
        return slurmclock.Deadline(None, "unknown at the start")


def dist_timeout(
    deadline: slurmclock.Deadline, env: Mapping[str, str] | None = None
) -> float | None:
    """Seconds a collective may take, from the time left at the start; None (ddpkit's own:
    ``PYRECOVER_DIST_TIMEOUT``, else 180 s) when that variable is set or no deadline is known.
    A collective that hangs near the end is given up on with time left for the exit."""
    e = os.environ if env is None else env
    left = deadline.seconds_left()
    if e.get("PYRECOVER_DIST_TIMEOUT", "").strip() or left is None:
        return None
    return min(DIST_TIMEOUT_MAX_S, max(DIST_TIMEOUT_MIN_S, DIST_TIMEOUT_SHARE * left))


class StoreWaits:
    """The bounds of every wait on the store; ``budget`` and ``store`` are None until made."""

    def __init__(
        self,
        cfg: TrainConfig,
        stop_flag: slurmclock.StopFlag,
        deadline: slurmclock.Deadline | None = None,
    ) -> None:
        self.stop_flag = stop_flag
        # bounds the store's first contact (the session's look, else one of its own)
        self.start_deadline = deadline_at_start(cfg) if deadline is None else deadline
        self.budget: slurmclock.TimeBudget | None = None  # None while the store is opened, read
        self.store: ckptstore.CheckpointStore | None = None

    def limits(self) -> ckptstore.CallLimits:
        """Each wait on the store: a few measured saves at most (a stalled connection is
        dropped; the store's next answer gets a new one), never past the time left for the
        exit, and ended within seconds of a stop (once past a measured save's length)."""
        return ckptstore.CallLimits(
            call_s=self.call_s,
            time_left=self.time_left,
            stopping=lambda: len(self.stop_flag.arrivals),  # a second signal: now
            expected_s=self.expected_s,
        )

    def expected_s(self) -> float:
        """What a healthy call may take (twice the median measured save): a stop does not
        end it sooner."""
        median = self.store.save_timings.median_s if self.store is not None else None
        return 2 * median if median else 0.0

    def call_s(self) -> float:
        save = self.budget.save_estimate if self.budget is not None else None
        return max(STORE_CALL_MIN_S, STORE_CALL_SAVES * save) if save else STORE_CALL_FIRST_S

    def time_left(self) -> float | None:
        """Seconds until any wait on the store must end: the time left less the exit's (at
        the start, before the budget: the deadline less STORE_CALL_MIN_S for the exit), and
        never under STORE_CALL_LATE_S: past the deadline SLURM's KillWait is still to come
        and a commit is atomic, so a late try costs nothing and may save the steps."""
        budget = self.budget
        if budget is None:
            left = self.start_deadline.seconds_left()
            bound = None if left is None else left - STORE_CALL_MIN_S
        else:
            left = budget.seconds_left()
            bound = None if left is None else left - budget.needed_after_save()
        return None if bound is None else max(bound, STORE_CALL_LATE_S)
