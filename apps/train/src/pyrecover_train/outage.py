"""A save the store did not take (ckptstore's StoreUnreachableError): a periodic one waits for
the store while training goes on (ckptstore's :class:`~ckptstore.Outage` says when to try
again); the final one is retried while a try still fits before the exit; then (and for an extra
save) the run exits 74 with the last durable checkpoint intact."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import ckptstore
import ddpkit
import slurmclock

log = logging.getLogger("pyrecover_train")

STOP_KILL_WAIT_S = 30.0  # without a deadline: a stop's kill follows this late (SLURM's KillWait)


class StoreOutage:
    """What follows a save the store did not take. ``save_final``: the final save, durable on
    return; ``resumed_step``: the checkpoint the run resumed from (None: a fresh start)."""

    def __init__(
        self,
        dist: ddpkit.Dist,
        loop: slurmclock.TimeLoop,
        stop_flag: slurmclock.AnyFlag,
        save_final: Callable[[], None],
        resumed_step: int | None,
    ) -> None:
        self.outage = ckptstore.Outage()  # the store not answering: each rank alike
        self.dist, self.loop, self.stop_flag = dist, loop, stop_flag
        self.save_final, self.resumed_step = save_final, resumed_step

    def failed(self, save: str, step: int, error: BaseException, seconds: float) -> None:
        """The ``save`` (the loop's kind) at ``step`` failed: a periodic one waits for the
        store; the final one is tried again while the time allows; then (and for an extra
        save) StoreUnreachableError, which the CLI exits 74 for."""
        line = self.outage.failed(step, error, seconds)
        if line and self.dist.is_main:
            log.warning("%s", line)
        if save == "final":
            self.retry_final(step)
        elif save != "periodic":
            raise ckptstore.StoreUnreachableError(self.gave_up(step)) from error

    def retry_final(self, step: int) -> None:
        """The final save again, after the outage's pause, while a try still fits before the
        exit (rank 0 decides for every rank: each try is a collective)."""
        while True:
            pause = self.outage.final_pause(self.time_for_a_try()) if self.dist.is_main else None
            pause = self.dist.broadcast_object(pause)
            if pause is None:
                raise ckptstore.StoreUnreachableError(self.gave_up(step))
            time.sleep(pause)
            t0 = time.perf_counter()
            try:
                self.save_final()
                return
            except ckptstore.StoreUnreachableError as e:
                self.outage.failed(step, e, time.perf_counter() - t0)

    def time_for_a_try(self) -> float | None:
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
        budget = self.loop.budget
        return left - budget.needed_after_save() - (budget.save_estimate or 0.0)

    def gave_up(self, step: int) -> str:
        """The one line the run ends with: the step not saved, the checkpoint that stands."""
        durable = self.loop.durable_step
        if durable is None:
            durable = self.resumed_step
        return self.outage.gave_up(step, durable)
