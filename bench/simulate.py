"""Time-budget simulator: which stop rule keeps the most training, and how often to checkpoint.

Part 1 -- time limits. One SLURM allocation of length L (10 minutes to 24 hours) is simulated step
by step: start-up (launch, imports, CUDA, data, model, the checkpoint's load: measured on one H100
for the 1.5B profile, see SCENARIOS), a slow compile-heavy first step and a few slow warm-up
steps, then lognormal step times; a periodic save every ~30 minutes, as pyrecover-train's
``--async-checkpoint`` default makes it (on CUDA in the background: it blocks for the snapshot
and is durable later; blocking for FSDP-sharded state); the final save blocks, after a save still
in flight; after it the job still has to exit and requeue itself (process exit, srun teardown,
`scontrol requeue`: lognormal, per profile), before L if it can. Each stop rule
decides when to stop and write the final checkpoint:

* ``slurmclock``   -- the REAL ``slurmclock.TimeBudget`` with its default settings (fake clock),
                      as the shipped trainer and sbatch script set it up: first save guess 1 s +
                      state bytes / 200 MB/s, 3 warm-up steps (--compile), the script's
                      ``--signal=B:USR2@300`` delivered 300-330 s before the end with
                      PYRECOVER_SIGNAL_LEAD=300, and the budget state (steps, saves of each kind,
                      exits) that the earlier allocations stored in the checkpoint (default: a
                      steady state, every window full; ``--history N``: N earlier allocations);
                      asked after every step, ``can_save(background=...)`` before every periodic
                      save, each save recorded as blocking or background, and after the final
                      save its extra saves (``extra_save()``: train on, save again, abandon a
                      save not durable when the exit must begin), as pyrecover-train does;
* ``no-extra-saves`` -- slurmclock as pyrecover-train --no-extra-saves runs it (the same without
                      extra saves: what they add);
* ``pyrecover-v0`` -- the original PyRecover rule: before each step, stop when the time left
                      < 6 x max step + 2 x max save (running maxima, so the compile step counts);
                      same first guesses as slurmclock;
* ``submitit``     -- stop at min(0.8 x L, L - 10 min), then save (the rule as given in issue 9);
* ``lightning-90s``-- a signal 90 s before the end (Lightning's SLURM default), then save;
* ``oracle``       -- knows every future duration: stops at the last step whose final save and
                      exit still end before L. No rule that saves once at its stop can do
                      better: the ceiling of each cell (extra saves, with their own draws, may
                      pass it in a lucky trial).

A rule whose final save does not finish before the kill loses everything since its last
committed save (the steps of an abandoned extra save count as lost work too: the next job redoes
them). Reported per rule: goodput = time spent in steps that were persisted / L, lost
work (steps computed but not persisted, redone by the next job), how often the final save was
killed, and how often its exit ended after L with the final save durable: nothing is lost then
(the batch script's ``slurmclock supervise`` requeues the job at SLURM's TERM at the limit), so it
is counted apart, not as a failure. All rules
see the same random step, save and exit times in each trial (common random numbers), so
differences are the rules', not the dice's.

Early allocations -- slurmclock alone in a job's first, second and sixth allocation, when its
budget has measured few saves (``--history`` simulates any one of them in part 1).

Part 2 -- failures. Kills arrive at random (exponential, mean MTBF), each followed by a restart;
the checkpoint interval is fixed (10 min, 1 h, 4 h) or ``auto``: Young/Daly sqrt(2 x save cost x
MTBF) with the measured median save cost, as ``slurmclock.checkpoint_interval`` computes it (10 s
assumed until the first save of each restart). Goodput = persisted work / wall time. Work is
modelled as continuous (steps are much shorter than intervals); saves block.

Pure Python + numpy, seeded; a few minutes (``--quick``: a few seconds).

    python bench/simulate.py [--quick] [--trials N] [--seed S] [--margin SECONDS] [--out DIR]

Writes bench/results/simulate.json, simulate.png (goodput vs allocation length) and
simulate_mtbf.png (goodput vs MTBF).
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, print_table, write_results  # noqa: E402

from slurmclock import (  # noqa: E402
    STOP_SIGNALS,
    Deadline,
    SaveTail,
    StopSignals,
    TimeBudget,
    TimeLoop,
    checkpoint_interval,
)

MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0
ALLOCATIONS = (10 * MINUTE, 20 * MINUTE, 30 * MINUTE, HOUR, 2 * HOUR, 4 * HOUR, 12 * HOUR, DAY)
MTBFS = (0.5 * HOUR, HOUR, 2 * HOUR, 6 * HOUR, 12 * HOUR, DAY, 3 * DAY, 7 * DAY)
ASSUMED_SAVE_BANDWIDTH = 200e6  # pyrecover-train's first guess of a save: 1 s + bytes / this
AUTO_ASSUMED_SAVE_COST = 10.0  # pyrecover-train's Young/Daly cost before a save was measured
SIGNAL_LEAD = 300.0  # submit-training-simple.sh: #SBATCH --signal=B:USR2@300, exported as the lead
SIGNAL_EARLY = 30.0  # SLURM sends the warning up to 30 s before LEAD (its timer's period)
STOP_POLICIES = (
    "slurmclock",
    "no-extra-saves",
    "pyrecover-v0",
    "submitit",
    "lightning-90s",
    "oracle",
)
PEERS = ("pyrecover-v0", "submitit", "lightning-90s")
# What the earlier allocations left in the checkpoint for the budget: the last 50 steps, the last
# 20 saves of each kind (blocking: one final save per allocation; background: the periodic async
# saves) and the exits of the last 5 allocations. By default the allocation simulated has
# HISTORY earlier ones, enough to fill every window (a steady state); --history 1 is the job's
# second allocation, --history 5 its sixth.
PRIOR_STEPS, PRIOR_SAVES, PRIOR_EXITS, HISTORY = 50, 20, 5, 20
EXTRA_SAVES = 4  # at most this many extra saves after the final one (the trainer: no limit)
INTERVAL_POLICIES: dict[str, float | str] = {
    "fixed 10 min": 10 * MINUTE,
    "fixed 1 h": HOUR,
    "fixed 4 h": 4 * HOUR,
    "auto (Young/Daly)": "auto",
}


@dataclass(kw_only=True, slots=True)
class Scenario:
    """A training job's time profile. Times in seconds; lognormal ``sigma`` is of log-seconds."""

    name: str
    about: str
    step_median: float
    step_sigma: float
    first_step: float  # compile + cache warm-up
    slow_steps: int  # steps after the first that run ``slow_factor`` slower (autotuning, ...)
    slow_factor: float
    save_median: float  # a blocking save, until durable: the final one (periodic ones unless async)
    save_sigma: float
    state_bytes: float  # for the trainer's first guess of a save
    startup_parts: dict[str, float]  # allocation start -> the first step's start, by part
    exit_median: float  # after the final save: process exit, srun teardown, scontrol requeue
    exit_sigma: float
    # Periodic saves in the background (pyrecover-train's --async-checkpoint auto: on with CUDA,
    # off for FSDP-sharded state): they block for the snapshot (the first one of a process also
    # allocates the pinned host memory) and are durable async_durable_median later.
    async_periodic: bool = False
    snapshot_s: float = 0.0
    first_snapshot_s: float = 0.0
    async_durable_median: float = 0.0
    periodic_every: float = 30 * MINUTE  # wall seconds of steps between periodic saves
    nodes: int = 1  # across nodes the first allocation keeps the exit guess (TimeLoop)
    restart: float | None = None  # after a failure (part 2): requeue wait + startup
    sources: tuple[str, ...] = ()  # where the figures come from

    def __post_init__(self) -> None:
        for name in ("step_median", "first_step", "save_median", "state_bytes", "periodic_every"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Scenario {self.name}: {name} must be > 0 seconds (or bytes)")
        if min(self.step_sigma, self.save_sigma, self.exit_sigma) < 0:
            raise ValueError(f"Scenario {self.name}: sigmas must be >= 0 (0 = constant times)")
        if self.async_periodic and not self.async_durable_median >= self.first_snapshot_s:
            raise ValueError(f"Scenario {self.name}: an async save is durable after its snapshot")
        slowest = self.async_durable_median * math.exp(4 * self.save_sigma)
        if self.async_periodic and not self.periodic_every > slowest:
            # The shared timeline has no save wait for the one before (the rules' loops do).
            raise ValueError(
                f"Scenario {self.name}: periodic saves every {self.periodic_every:.0f} s must be "
                f"further apart than its slowest async save ({slowest:.0f} s): save less often"
            )

    @property
    def startup(self) -> float:
        return float(sum(self.startup_parts.values()))

    @property
    def initial_save_guess(self) -> float:
        return 1.0 + self.state_bytes / ASSUMED_SAVE_BANDWIDTH

    @property
    def periodic_steps(self) -> int:
        return max(1, round(self.periodic_every / self.step_median))

    @property
    def restart_cost(self) -> float:
        return self.startup + 2 * MINUTE if self.restart is None else self.restart


# Measured (bench/results/gpu-h100/, bench/gpu.sh on one H100 80GB, torch 2.11 cu130; and
# e2e/ on a local SLURM 22.05) unless marked "assumed" or "scaled".
H100_1B = {
    "step": 0.283,  # mfu-1b: median step, steps 15-30 (batch 8 x 2048, bf16, compiled)
    "compile": 50.0,  # mfu-1b: steps 1-5 took 5 x 10.23 s; minus 5 steady steps, rounded down
    "pre_step": 29.0,  # mfu-1b: 105 s run - 51.2 s (steps 1-5) - 7.1 s (6-30) - 15.6 s final save
    # - ~2 s exit: imports, CUDA, data (a first run: building the token cache too), model
    "load": 16.5,  # ckpt-1b: ckptstore verified cold load of the 18 GB model + AdamW state
    "save_sync": 15.6,  # ckpt-1b: ckptstore sync save until durable
    "snapshot": 0.38,  # ckpt-1b: async save() with the device-to-host copy synchronized
    "first_snapshot": 19.1,  # ckpt-1b: the first async save allocates 18 GB of pinned memory
    "async_durable": 22.2,  # ckpt-1b: async save until durable (the writer shares the host)
}
LAUNCH = 0.7  # e2e (local SLURM): allocation start -> the trainer process's start

SCENARIOS = (
    Scenario(
        name="1b, one H100",
        about=(
            "1.5B params, 0.28 s steps, 50 s compile, 18 GB state, blocking saves 15.6 s, async "
            "saves block 0.38 s (the first 19.1 s), 46 s start-up (measured)"
        ),
        step_median=H100_1B["step"],
        step_sigma=0.1,  # assumed
        first_step=H100_1B["compile"],
        slow_steps=0,  # mfu-1b: steps 6-10 already at the steady 282 ms
        slow_factor=1.0,
        save_median=H100_1B["save_sync"],
        save_sigma=0.25,  # assumed (one measured round)
        state_bytes=18e9,
        startup_parts={
            "launch": LAUNCH,
            "imports, CUDA, data, model": H100_1B["pre_step"],
            "resume load": H100_1B["load"],
        },
        exit_median=4.0,  # assumed
        exit_sigma=0.3,
        async_periodic=True,  # --async-checkpoint auto: on with CUDA
        snapshot_s=H100_1B["snapshot"],
        first_snapshot_s=H100_1B["first_snapshot"],
        async_durable_median=H100_1B["async_durable"],
        sources=("bench/results/gpu-h100 (gpu.sh, one H100)", "e2e launch on a local SLURM"),
    ),
    Scenario(
        name="8b, 4 nodes, busy Lustre",
        about=(
            "8B params on 16 GPUs (FSDP), 4 s steps, 100 s compile, 96 GB state, blocking saves "
            "~90 s with a heavy tail, async saves blocking 0.13 s (the first 6.4 s), 120 s start-up"
        ),
        step_median=4.0,  # assumed
        step_sigma=0.15,
        first_step=100.0,  # scaled: the 1.5B's measured 50 s x 32/16 layers
        slow_steps=5,  # assumed
        slow_factor=2.0,
        save_median=90.0,  # assumed: the heavy-tailed profile of issue 12
        save_sigma=0.5,
        state_bytes=96e9,
        startup_parts={
            "launch": LAUNCH,
            "imports, CUDA, data, model": H100_1B["pre_step"],  # as measured for the 1.5B
            "resume load": 90.0,  # scaled: 96 GB read at the rate its saves write (~1 GB/s)
        },
        exit_median=12.0,  # assumed
        exit_sigma=0.4,
        nodes=4,
        async_periodic=True,  # --async-checkpoint auto: on with CUDA (FSDP: each rank its shard)
        # scaled: each of 16 ranks snapshots its 6 GB shard (1/3 of the 1.5B's 18 GB), and the
        # writer makes a save durable 22.2 / 15.6 times later than a blocking save would be
        snapshot_s=H100_1B["snapshot"] / 3,
        first_snapshot_s=H100_1B["first_snapshot"] / 3,
        async_durable_median=90.0 * H100_1B["async_durable"] / H100_1B["save_sync"],
        sources=("scaled from the 1.5B's measurements; saves and steps assumed (issue 12)",),
    ),
)


def lognormal(rng: np.random.Generator, median: float, sigma: float, n: int) -> np.ndarray:
    return median * np.exp(sigma * rng.standard_normal(n)) if sigma else np.full(n, median)


def periodic_saves(sc: Scenario, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(until durable, blocking) seconds of a process's first ``n`` periodic saves."""
    if not sc.async_periodic:
        saves = lognormal(rng, sc.save_median, sc.save_sigma, n)
        return saves, saves
    block = np.full(n, sc.snapshot_s)
    block[:1] = sc.first_snapshot_s
    durable = lognormal(rng, sc.async_durable_median, sc.save_sigma, n)
    return np.maximum(durable, block), block


def prior_saves(
    sc: Scenario, length: float, rng: np.random.Generator, history: int
) -> tuple[list[float], list[float]]:
    """(blocking, background) saves that the budget state of ``history`` earlier allocations of
    this length holds, the last PRIOR_SAVES of each kind: per allocation its periodic saves
    (until durable; background when async) and its blocking final save."""
    per_allocation = max(0, int((length - sc.startup) // sc.periodic_every))
    blocking: list[float] = []
    background: list[float] = []
    for _ in range(history):
        periodic = periodic_saves(sc, rng, per_allocation)[0].tolist()
        (background if sc.async_periodic else blocking).extend(periodic)
        blocking.append(float(lognormal(rng, sc.save_median, sc.save_sigma, 1)[0]))
    return blocking[-PRIOR_SAVES:], background[-PRIOR_SAVES:]


# -- part 1: one allocation, four stop rules ---------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """What one rule got out of one allocation."""

    useful: float  # seconds of steps that are in a committed checkpoint at the kill
    lost: float  # seconds of steps computed after the last committed checkpoint
    final_ok: bool  # the final save finished before the kill (False: killed, or none started)
    saved_at: float | None = None  # when the last save the job made was durable (or abandoned)
    exited_at: float | None = None  # when its exit ended (None: killed at the limit)
    final_at: float | None = None  # when the final save was durable (extra saves may follow)
    final_useful: float = 0.0  # seconds of steps in the final save

    def released(self, length: float) -> float:
        """When the job let the allocation go: its exit, or SLURM's TERM at the limit (where
        ``slurmclock supervise`` requeues it at once)."""
        return length if self.exited_at is None else min(self.exited_at, length)

    def exit_after_limit(self, length: float) -> bool:
        """The final save was durable but the exit ended after the limit: ``slurmclock
        supervise`` requeues the job at SLURM's TERM, before the step is gone: no loss."""
        return self.final_ok and (self.exited_at is None or self.exited_at > length)


class Trial:
    """The random draws of one allocation and the timeline all rules share until they stop."""

    def __init__(
        self, sc: Scenario, length: float, rng: np.random.Generator, history: int = HISTORY
    ) -> None:
        self.sc, self.length = sc, length
        low = sc.step_median * math.exp(-4 * sc.step_sigma)
        n = int(max(0.0, length - sc.startup) / low) + 2
        d = lognormal(rng, sc.step_median, sc.step_sigma, n)
        d[0] = sc.first_step
        d[1 : 1 + sc.slow_steps] *= sc.slow_factor
        self.d = d
        self.cs = np.cumsum(d)
        self.every = sc.periodic_steps
        n_saves = n // self.every + 2
        # Periodic save k (k >= 1, index k - 1) blocks training for block[k-1] seconds and is
        # durable saves[k-1] seconds after it started (what the trainer measures and the budget
        # records): the same for a blocking save.
        self.saves, self.block = periodic_saves(sc, rng, n_saves)
        self.final_save = float(lognormal(rng, sc.save_median, sc.save_sigma, 1)[0])
        self.exit = float(lognormal(rng, sc.exit_median, sc.exit_sigma, 1)[0])
        self.signal_at = length - SIGNAL_LEAD - SIGNAL_EARLY * float(rng.random())
        blocking, background = prior_saves(sc, length, rng, history)
        exits = lognormal(rng, sc.exit_median, sc.exit_sigma, min(history, PRIOR_EXITS))
        self.prior_state = {  # what the previous allocation stored (TimeBudget.state_dict())
            "version": 1,
            "steps": lognormal(
                rng, sc.step_median, sc.step_sigma, PRIOR_STEPS if history else 0
            ).tolist(),
            "saves": blocking,
            "background_saves": background,
            "exits": [
                {"job": "sim", "restart": k, "seconds": float(x)} for k, x in enumerate(exits)
            ],
        }
        # Save k (k >= 1) runs after step number k * every (index k * every - 1).
        cum_block = np.concatenate(([0.0], np.cumsum(self.block)))
        idx = np.arange(n)
        done_before = idx // self.every  # periodic saves started before step index i starts
        self.t_end = sc.startup + self.cs + cum_block[done_before]
        self.t_start = self.t_end - d
        self.cum_block = cum_block
        # Saves after the final one (slurmclock's extra saves): blocking, like the final save.
        self.extra_saves = lognormal(rng, sc.save_median, sc.save_sigma, EXTRA_SAVES)

    # - shared bookkeeping -

    def useful(self, steps: int) -> float:
        return float(self.cs[steps - 1]) if steps > 0 else 0.0

    def result(
        self,
        persisted: int,
        computed: int,
        final_ok: bool,
        saved_at: float | None = None,
        final: tuple[int, float] | None = None,
    ) -> Outcome:
        """Outcome from step counts: ``persisted`` in a committed checkpoint, ``computed`` done;
        ``saved_at``: when the last save was durable (the exit and requeue follow it); ``final``:
        (steps, durable at) of the final save when extra saves followed it."""
        exited = saved_at + self.exit if final_ok and saved_at is not None else None
        steps, final_at = final or (persisted, saved_at)
        return Outcome(
            self.useful(persisted),
            self.useful(computed) - self.useful(persisted),
            final_ok,
            saved_at,
            exited,
            final_at if final_ok else None,
            self.useful(steps) if final_ok else 0.0,
        )

    def nothing_trained(self) -> Outcome:
        """A rule that stops before its first step: nothing to save, it exits at once."""
        start = self.sc.startup
        return Outcome(0.0, 0.0, True, start, start + self.exit, start, 0.0)

    def last_step_done_before(self, t: float) -> int:
        """Index of the last step finished by time t on the shared timeline (-1: none)."""
        return int(np.searchsorted(self.t_end, t, side="right")) - 1

    def in_flight_until(self, j: int) -> float:
        """When the last periodic save started before step index j ended is durable (0: none).
        A blocking save was durable before the next step began; an async one may still be
        written, and a save started now (the final one) waits for it."""
        k = j // self.every
        return float(self.t_end[k * self.every - 1] + self.saves[k - 1]) if k >= 1 else 0.0

    def periodic_committed(self, upto_index: int, kill: float) -> int:
        """Steps persisted by the periodic saves of the shared timeline that finished by ``kill``
        and cover steps up to index ``upto_index``."""
        best = 0
        k = (upto_index + 1) // self.every
        while k >= 1:
            end = self.t_end[k * self.every - 1] + self.saves[k - 1]
            if end <= kill:
                best = k * self.every
                break
            k -= 1
        return best

    def outcome_stop_after(self, j: int | None, *, final_needed: bool = True) -> Outcome:
        """Stop after step index j on the shared timeline and write the final save (None: the
        rule never stopped, the kill came first)."""
        L = self.length
        if j is None or self.t_end[j] > L:
            last = self.last_step_done_before(L)
            persisted = self.periodic_committed(last, L)
            return self.result(persisted, last + 1, False)
        if not final_needed:  # a periodic save of step j already ran: it is the final one
            persisted = self.periodic_committed(j, L)
            done = float(self.t_end[j] + self.saves[(j + 1) // self.every - 1])
            return self.result(persisted, j + 1, persisted == j + 1, done)
        done = max(float(self.t_end[j]), self.in_flight_until(j)) + self.final_save
        if done <= L:
            return self.result(j + 1, j + 1, True, done)
        persisted = self.periodic_committed(j - 1, L)
        return self.result(persisted, j + 1, False)


def signal_rule(trial: Trial, signal_at: float) -> Outcome:
    """Stop after the first step that ends once the signal arrived, then save."""
    j = int(np.searchsorted(trial.t_end, signal_at, side="left"))
    return trial.outcome_stop_after(j if j < len(trial.t_end) else None)


def pyrecover_v0_rule(trial: Trial) -> Outcome:
    """Before each step: stop when left < 6 x max step + 2 x max save (running maxima)."""
    sc = trial.sc
    max_step = np.maximum.accumulate(np.maximum(trial.d, sc.step_median))  # initial: the median
    # Before step index i: the maxima of steps < i and of the saves done before i.
    max_step_before = np.concatenate(([sc.step_median], max_step[:-1]))
    save_max = np.maximum.accumulate(np.maximum(trial.saves, sc.initial_save_guess))
    done = np.arange(len(trial.d)) // trial.every  # saves done before step index i starts
    max_save_before = np.where(done > 0, save_max[np.maximum(done - 1, 0)], sc.initial_save_guess)
    # Step index i starts after step i-1 and the periodic save that may follow it.
    start = trial.t_start.copy()
    left = trial.length - start
    stop = np.nonzero(left < 6 * max_step_before + 2 * max_save_before)[0]
    if len(stop) == 0:
        return trial.outcome_stop_after(None)
    i = int(stop[0])
    if i == 0:  # stops before its first step: nothing to save, nothing trained
        return trial.nothing_trained()
    # The check runs after the periodic save of step i-1, if there was one.
    return trial.outcome_stop_after(i - 1, final_needed=i % trial.every != 0)


def oracle_rule(trial: Trial) -> Outcome:
    """Stop after the last step whose final save and exit still end before L (knowing them).
    The final save replaces a periodic one due at the same step (as in pyrecover-train) and
    starts once a periodic save still being written is durable."""
    n, every = len(trial.d), trial.every
    k = np.arange(n) // every  # periodic saves started before step index j ended
    in_flight = np.where(
        k >= 1, trial.t_end[np.maximum(k * every - 1, 0)] + trial.saves[np.maximum(k - 1, 0)], 0.0
    )
    done = np.maximum(trial.t_end, in_flight) + trial.final_save
    fits = np.nonzero(done + trial.exit <= trial.length)[0]
    if len(fits) == 0:
        return trial.nothing_trained()
    j = int(fits[-1])
    return trial.result(j + 1, j + 1, True, float(done[j]))


def _rolling_max(d: np.ndarray, window: int) -> np.ndarray:
    if len(d) < window:
        return np.maximum.accumulate(d)
    from numpy.lib.stride_tricks import sliding_window_view

    head = np.maximum.accumulate(d[: window - 1])
    return np.concatenate((head, sliding_window_view(d, window).max(axis=1)))


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def slurmclock_rule(
    trial: Trial, margin: float | None = None, *, fast: bool = True, extra: bool = True
) -> Outcome:
    """Drive slurmclock's TimeLoop -- the object pyrecover-train drives -- with the budget the
    trainer builds: after each step the loop says go on, save (a periodic save, only when the
    budget says it fits) or stop (the final save); each save is reported to it once durable (an
    async one some steps later, as the trainer learns it from the store, and before the final
    save's record, which waits for it); after the final save, the loop's extra saves (train
    while it says a step fits, save, abandoned when not durable at the plan's abandon time;
    ``extra=False``: pyrecover-train --no-extra-saves). SLURM's USR2 warning is raised on the
    stop flag when it arrives. ``fast``: skip, step-free, the part of the run where the budget
    cannot stop (same result)."""
    sc, L, d = trial.sc, trial.length, trial.d
    clock, flag, budget, loop = _trainer(trial, margin, extra)
    i0 = _first_close_step(trial, budget) if fast else 0
    cfg = budget.config
    w, window = cfg.warmup_steps, cfg.step_window
    for x in d[: min(w, i0)]:
        budget.record_step(float(x))
    for x in d[max(w, i0 - window) : i0]:
        budget.record_step(float(x))
    now = float(trial.t_start[i0])
    saves = _Durable(loop, background=sc.async_periodic)
    for k in range(1, i0 // trial.every + 1):  # the periodic saves started before step i0
        seconds = float(trial.saves[k - 1])
        saves.started(float(trial.t_end[k * trial.every - 1]) + seconds, seconds, k * trial.every)
    if now > L:  # the kill came during the periodic save after step i0 - 1
        return trial.result(saves.committed_by(L), i0, False)
    saves.record_until(now)
    signalled = False
    for i in range(i0, len(d)):
        now += float(d[i])
        if now > L:  # killed mid-step
            return trial.result(saves.committed_by(L), i, False)
        if not signalled and now >= trial.signal_at:
            clock.now, signalled = trial.signal_at, True
            flag.request("SIGUSR2")  # stamped with its arrival time
        clock.now = now
        saves.record_until(now)
        due = (i + 1) % trial.every == 0
        act = loop.after_step(i + 1, seconds=float(d[i]), save_due=due)
        if act.save == "final":
            done = max(now, saves.in_flight_until()) + trial.final_save
            if done > L:
                return trial.result(saves.committed_by(L), i + 1, False)
            clock.now = done
            with loop.saving(act):  # every save durable, the final one last
                saves.record_until(done)
                loop.saved(i + 1, trial.final_save)
            persisted, computed, saved_at = _extra_saves(trial, loop, clock, i, done)
            return trial.result(persisted, computed, True, saved_at, final=(i + 1, done))
        if act.save == "periodic":
            now = max(now, saves.in_flight_until())  # one save in flight: wait for it
            saves.record_until(now)
            k = (i + 1) // trial.every
            started, now = now, now + float(trial.block[k - 1])
            if now > L:  # killed mid-save
                return trial.result(saves.committed_by(L), i + 1, False)
            saves.started(started + float(trial.saves[k - 1]), float(trial.saves[k - 1]), i + 1)
            saves.record_until(now)
    raise RuntimeError("simulation ran out of drawn steps: raise the step count bound")


def _trainer(
    trial: Trial, margin: float | None, extra: bool
) -> tuple[_FakeClock, StopSignals, TimeBudget, TimeLoop]:
    """The clock, stop flag, budget and loop that pyrecover-train builds, on a fake clock."""
    sc = trial.sc
    clock = _FakeClock()
    flag = StopSignals(STOP_SIGNALS, clock=clock)  # not installed: raised by the simulator
    budget = TimeBudget(
        Deadline(end=trial.length, source="simulated"),
        margin=margin,
        initial_save_estimate=sc.initial_save_guess,
        warmup_steps=3,  # what pyrecover-train passes with --compile
        signal_lead=SIGNAL_LEAD,  # what the sbatch script exports
        signals=flag,
        clock=clock,
        timer=clock,
    )
    budget.load_state_dict(trial.prior_state)
    loop = TimeLoop(
        budget,
        extra_saves=extra,
        background_saves=sc.async_periodic,
        # As the trainer measures it after its first step; across nodes it keeps the exit guess.
        launch=sc.startup_parts["launch"] if sc.nodes == 1 else lambda: None,
        watchdog=False,  # the abandon is simulated: the save's drawn time against the plan
    )
    return clock, flag, budget, loop


def shared_until(trial: Trial, margin: float | None = None) -> float:
    """Until when slurmclock's run of ``trial`` is the shared timeline for sure (it can neither
    stop nor refuse a periodic save before): a kill before it keeps the periodic saves' work."""
    budget = _trainer(trial, margin, True)[2]
    return float(trial.t_start[_first_close_step(trial, budget)])


def _extra_saves(
    trial: Trial, loop: TimeLoop, clock: _FakeClock, i: int, now: float
) -> tuple[int, int, float]:
    """After the final save of step index ``i``, durable at ``now``: the loop's extra saves
    (train while it says a step fits, save; abandoned at the plan's abandon time). Returns
    (steps persisted, steps computed, when the exit began: a durable save's end or the
    abandon)."""
    persisted, saved_at, j = i + 1, now, i
    for save in trial.extra_saves:
        while loop.training:
            j += 1
            now += float(trial.d[j])
            clock.now = now
            act = loop.after_step(j + 1, seconds=float(trial.d[j]))
            if act.save == "extra":
                break
        if not loop.training:
            break
        plan = loop.plan
        assert plan is not None
        if now + float(save) > plan.abandon_at:  # abandoned: the exit starts then
            return persisted, j + 1, plan.abandon_at
        now += float(save)
        clock.now = now
        with loop.saving(act):
            loop.saved(j + 1, float(save))  # not a save-time sample (the loop knows)
        persisted, saved_at = j + 1, now
    return persisted, j + 1, saved_at  # a stop signal may have ended extra training


class _Durable:
    """Periodic saves started and not yet recorded: each is reported to the loop (and its steps
    count as persisted) once durable, as the trainer learns it from the store."""

    def __init__(self, loop: TimeLoop, *, background: bool) -> None:
        self.loop, self.background = loop, background
        self.pending: list[tuple[float, float, int]] = []  # (durable at, seconds, steps)
        self.persisted = 0

    def started(self, durable_at: float, seconds: float, steps: int) -> None:
        self.pending.append((durable_at, seconds, steps))

    def record_until(self, now: float) -> None:
        while self.pending and self.pending[0][0] <= now:
            _, seconds, self.persisted = self.pending.pop(0)
            self.loop.saved(self.persisted, seconds, background=self.background)

    def in_flight_until(self) -> float:
        return self.pending[-1][0] if self.pending else 0.0

    def committed_by(self, kill: float) -> int:
        """Steps in a checkpoint that was durable when the kill came."""
        done = [steps for at, _, steps in self.pending if at <= kill]
        return max([self.persisted, *done])


def _first_close_step(trial: Trial, budget: TimeBudget) -> int:
    """First step index after which the budget might stop: before it the time left is at least
    an upper bound of what the budget needs (so it cannot stop, nor refuse a save, and the
    shared timeline holds). Simulating from there step by step gives the same decisions."""
    cfg, d = budget.config, trial.d
    prior_steps = trial.prior_state["steps"]
    step_bound = np.maximum(_rolling_max(d, cfg.step_window), max(prior_steps, default=0.0))
    # The decision after step i has recorded at most the periodic saves started before it
    # (i // every; fewer while an async one is still being written): the bound is the largest
    # estimate over those prefixes, for the final save and (async) for a periodic one.
    seen = np.arange(len(d)) // trial.every
    background = trial.sc.async_periodic
    tail = SaveTail(window=cfg.save_window, quantile=cfg.save_quantile)
    tail.load(trial.prior_state["saves"])
    tail.load(trial.prior_state["background_saves"], background=True)

    def bounds() -> tuple[float, float]:
        final = tail.bound() or cfg.initial_save_estimate
        periodic = tail.bound(background=True) or cfg.initial_save_estimate
        return final, periodic if background else 0.0

    save_bound = [bounds()]
    for x in trial.saves[: int(seen[-1]) + 1]:
        tail.add(float(x), background=background)
        save_bound.append(bounds())
    # Before the launch is recorded (the first allocation's exit guess comes from it): the most.
    end = budget.needed_after_save()
    # can_save(background=True) keeps a periodic save's bound free on top of the stop's needs
    worst = np.maximum.accumulate([final + periodic for final, periodic in save_bound])
    bound = step_bound + worst[seen] + end
    close = np.nonzero(trial.length - trial.t_end < bound)[0]
    return int(close[0]) if len(close) else len(d) - 1


def stop_rules(margin: float | None) -> dict[str, Callable[[Trial], Outcome]]:
    return {
        "slurmclock": lambda t: slurmclock_rule(t, margin),
        "no-extra-saves": lambda t: slurmclock_rule(t, margin, extra=False),
        "pyrecover-v0": pyrecover_v0_rule,
        "submitit": lambda t: signal_rule(t, min(0.8 * t.length, t.length - 10 * MINUTE)),
        "lightning-90s": lambda t: signal_rule(t, t.length - 90.0),
        "oracle": oracle_rule,
    }


def time_limit_study(
    scenarios: Sequence[Scenario],
    lengths: Sequence[float],
    trials: int,
    seed: int,
    margin: float | None,
    history: int = HISTORY,
) -> list[dict[str, Any]]:
    rules = stop_rules(margin)
    rows: list[dict[str, Any]] = []
    for si, sc in enumerate(scenarios):
        for li, length in enumerate(lengths):
            rng = np.random.default_rng([seed, si, li])
            got: dict[str, list[Outcome]] = {name: [] for name in rules}
            for _ in range(trials):
                trial = Trial(sc, length, rng, history)
                for name, rule in rules.items():
                    got[name].append(rule(trial))
            for name, outs in got.items():
                goodput = np.array([o.useful for o in outs]) / length
                rows.append(
                    {
                        "scenario": sc.name,
                        "allocation_s": length,
                        "policy": name,
                        "goodput_mean": float(goodput.mean()),
                        "goodput_p10": float(np.quantile(goodput, 0.1)),
                        "lost_work_s_mean": float(np.mean([o.lost for o in outs])),
                        "final_save_killed": float(np.mean([not o.final_ok for o in outs])),
                        "exit_after_limit": float(
                            np.mean([o.exit_after_limit(length) for o in outs])
                        ),
                        "trials": trials,
                    }
                )
    return rows


EARLY_HISTORIES = (0, 1, 5)  # the job's first, second and sixth allocation
EARLY_LENGTHS = (30 * MINUTE, HOUR, DAY)


def early_study(
    scenarios: Sequence[Scenario], trials: int, seed: int, margin: float | None
) -> list[dict[str, Any]]:
    """slurmclock in a job's early allocations, when the budget has measured few saves (the
    tail bound then leans on its prior spread), against the steady state of part 1."""
    rows: list[dict[str, Any]] = []
    for si, sc in enumerate(scenarios):
        for li, length in enumerate(EARLY_LENGTHS):
            for history in EARLY_HISTORIES:
                rng = np.random.default_rng([seed, si, li, history, 1])
                outs, ceiling = [], []
                for _ in range(trials):
                    trial = Trial(sc, length, rng, history)
                    outs.append(slurmclock_rule(trial, margin))
                    ceiling.append(oracle_rule(trial).useful)
                rows.append(
                    {
                        "scenario": sc.name,
                        "allocation_s": length,
                        "history": history,
                        "goodput_mean": float(np.mean([o.useful for o in outs])) / length,
                        "oracle_goodput_mean": float(np.mean(ceiling)) / length,
                        "final_save_killed": float(np.mean([not o.final_ok for o in outs])),
                        "exit_after_limit": float(
                            np.mean([o.exit_after_limit(length) for o in outs])
                        ),
                        "trials": trials,
                    }
                )
    return rows


def print_early(erows: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    steady = {(r["scenario"], r["allocation_s"]): r for r in rows if r["policy"] == "slurmclock"}
    table: list[list[object]] = []
    for key in dict.fromkeys((r["scenario"], r["allocation_s"]) for r in erows):
        cells: list[object] = [key[0].split(",")[0], fmt_len(key[1])]
        picked = [x for x in erows if (x["scenario"], x["allocation_s"]) == key]
        picked += [steady[key]] if key in steady else []
        cells += [
            f"{r['goodput_mean'] * 100:5.1f}% / {r['final_save_killed'] * 100:4.1f}%"
            f" / {r['exit_after_limit'] * 100:4.1f}%"
            for r in picked
        ]
        table.append(cells)
    print_table(
        "early allocations, slurmclock: goodput / final save killed / exit after the limit "
        f"(mean of {erows[0]['trials']} trials)",
        ["profile", "allocation", *(f"history {h}" for h in EARLY_HISTORIES), "steady"],
        table,
    )


# -- part 2: random failures, checkpoint intervals ---------------------------------------------


def failure_run(
    sc: Scenario, setting: float | str, mtbf: float, horizon: float, rng: np.random.Generator
) -> float:
    """Goodput of one long run with exponential failures; saves block for their full time."""
    t, persisted = 0.0, 0.0
    while t < horizon:
        end = min(t + float(rng.exponential(mtbf)), horizon)
        persisted += one_process(sc, setting, mtbf, t + sc.restart_cost, end, rng)
        t = end
    return persisted / horizon


def one_process(
    sc: Scenario, setting: float | str, mtbf: float, t: float, end: float, rng: np.random.Generator
) -> float:
    """Work persisted by one process that trains from t until it is killed at ``end``. Each
    process measures its own save costs, as the trainer does (nothing measured after a restart).
    """
    if setting != "auto":  # a fixed interval: all cycles at once
        interval = float(setting)
        n = int(max(0.0, end - t) // interval) + 1
        ends = t + np.cumsum(interval + lognormal(rng, sc.save_median, sc.save_sigma, n))
        return interval * int(np.searchsorted(ends, end, side="right"))
    persisted = 0.0
    costs: list[float] = []  # sorted, for the running median
    while True:
        # checkpoint_interval takes the median of what it is given; handing it the middle
        # element(s) of the sorted costs gives that median without re-sorting every time.
        n = len(costs)
        every = checkpoint_interval(
            setting, costs[(n - 1) // 2 : n // 2 + 1], AUTO_ASSUMED_SAVE_COST, mtbf
        )
        assert every is not None
        save = sc.save_median * math.exp(sc.save_sigma * float(rng.standard_normal()))
        t += every + save
        if t > end:  # killed before this save committed: its work is lost
            return persisted
        persisted += every
        bisect.insort(costs, save)


def mtbf_study(
    scenarios: Sequence[Scenario], mtbfs: Sequence[float], trials: int, seed: int, span: float
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for si, sc in enumerate(scenarios):
        for mi, mtbf in enumerate(mtbfs):
            horizon = max(3 * DAY, span * mtbf)
            for pi, (name, setting) in enumerate(INTERVAL_POLICIES.items()):
                # Same seed for every policy at one MTBF: the same failure times, mostly.
                goodputs = [
                    failure_run(
                        sc, setting, mtbf, horizon, np.random.default_rng([seed, si, mi, k])
                    )
                    for k in range(trials)
                ]
                interval = checkpoint_interval(setting, [sc.save_median], 0.0, mtbf)
                rows.append(
                    {
                        "scenario": sc.name,
                        "mtbf_s": mtbf,
                        "policy": name,
                        "interval_s": interval,
                        "goodput_mean": float(np.mean(goodputs)),
                        "trials": trials,
                        "horizon_s": horizon,
                        "order": pi,
                    }
                )
    return rows


# -- output ------------------------------------------------------------------------------------


def fmt_len(s: float) -> str:
    if s >= DAY and s % DAY == 0:
        return f"{s / DAY:.3g} d"
    if s >= HOUR:
        return f"{s / HOUR:.3g} h"
    return f"{s / MINUTE:.3g} min"


def headline(
    rows: list[dict[str, Any]], mrows: list[dict[str, Any]], erows: list[dict[str, Any]]
) -> dict[str, Any]:
    """slurmclock against the best peer (worst case over scenarios and lengths from 30 minutes,
    where the targets apply, and over all lengths), against the oracle's ceiling, its killed final
    saves (also in early allocations, ``erows``); auto's goodput over the best fixed interval at
    each MTBF (worst case)."""
    by = {(r["scenario"], r["allocation_s"], r["policy"]): r for r in rows}
    ratios, ratios_30, of_oracle, killed, killed_30, late = [], [], [], [], [], []
    for (scn, length, pol), r in by.items():
        if pol != "slurmclock":
            continue
        best = max(by[(scn, length, p)]["goodput_mean"] for p in PEERS)
        ratio = r["goodput_mean"] / best if best > 0 else math.inf
        ratios.append(ratio)
        if length >= 30 * MINUTE:
            ratios_30.append(ratio)
            killed_30.append(r["final_save_killed"])
        ceiling = by[(scn, length, "oracle")]["goodput_mean"]
        of_oracle.append(r["goodput_mean"] / ceiling if ceiling > 0 else math.inf)
        killed.append(r["final_save_killed"])
        late.append(r["exit_after_limit"])
    mby: dict[tuple[str, float], dict[str, float]] = {}
    for r in mrows:
        mby.setdefault((r["scenario"], r["mtbf_s"]), {})[r["policy"]] = r["goodput_mean"]
    auto_vs_fixed = [
        g["auto (Young/Daly)"] / max(v for k, v in g.items() if k.startswith("fixed"))
        for g in mby.values()
    ]
    targets = {  # issue 12: (scenario prefix, allocation) -> slurmclock's cell
        "goodput_1b_1h": ("1b", HOUR),
        "goodput_1b_24h": ("1b", DAY),
        "goodput_8b_1h": ("8b", HOUR),
    }
    cells = {
        name: next(
            r
            for (scn, length, pol), r in by.items()
            if pol == "slurmclock" and scn.startswith(prefix) and length == at
        )
        for name, (prefix, at) in targets.items()
    }
    return {
        **{name: r["goodput_mean"] for name, r in cells.items()},
        "final_save_killed_8b_1h": cells["goodput_8b_1h"]["final_save_killed"],
        "slurmclock_vs_best_other_min_from_30min": min(ratios_30),
        "slurmclock_vs_best_other_min": min(ratios),
        "slurmclock_vs_best_other_median": float(np.median(ratios)),
        "slurmclock_vs_oracle_min": min(of_oracle),
        "slurmclock_final_save_killed_max": max(killed),
        "slurmclock_final_save_killed_max_from_30min": max(killed_30),
        "slurmclock_exit_after_limit_max": max(late),
        "auto_vs_best_fixed_min": min(auto_vs_fixed),
        "auto_vs_best_fixed_median": float(np.median(auto_vs_fixed)),
        "slurmclock_final_save_killed_max_early_from_30min": max(
            r["final_save_killed"] for r in erows
        ),
    }


def print_tables(rows: list[dict[str, Any]], mrows: list[dict[str, Any]]) -> None:
    table: list[list[object]]
    for sc in dict.fromkeys(r["scenario"] for r in rows):
        table = []
        for length in dict.fromkeys(r["allocation_s"] for r in rows):
            cells: list[object] = [fmt_len(length)]
            for pol in STOP_POLICIES:
                r = next(
                    x
                    for x in rows
                    if (x["scenario"], x["allocation_s"], x["policy"]) == (sc, length, pol)
                )
                cells.append(
                    f"{r['goodput_mean'] * 100:5.1f}% / {r['lost_work_s_mean']:5.0f} s"
                    f" / {r['final_save_killed'] * 100:4.1f}% / {r['exit_after_limit'] * 100:4.1f}%"
                )
            table.append(cells)
        print_table(
            f"time limits, {sc}: goodput / lost work / final save killed / exit after the limit "
            f"(mean of {rows[0]['trials']} trials)",
            ["allocation", *STOP_POLICIES],
            table,
        )
    for sc in dict.fromkeys(r["scenario"] for r in mrows):
        table = []
        for mtbf in dict.fromkeys(r["mtbf_s"] for r in mrows):
            sel = [r for r in mrows if r["scenario"] == sc and r["mtbf_s"] == mtbf]
            auto = next(r for r in sel if r["policy"].startswith("auto"))
            goodputs = [f"{r['goodput_mean'] * 100:5.1f}%" for r in sel]
            table.append([fmt_len(mtbf), *goodputs, fmt_len(auto["interval_s"])])
        print_table(
            f"random failures, {sc}: goodput (mean of {mrows[0]['trials']} runs)",
            ["MTBF", *INTERVAL_POLICIES, "auto interval"],
            table,
        )


def charts(rows: list[dict[str, Any]], mrows: list[dict[str, Any]], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no charts (pip install matplotlib)")
        return []
    paths = []
    for data, xkey, policies, fname, title, xlabel in (
        (rows, "allocation_s", STOP_POLICIES, "simulate.png", "Goodput per allocation",
         "allocation length"),
        (mrows, "mtbf_s", tuple(INTERVAL_POLICIES), "simulate_mtbf.png",
         "Goodput under random failures", "mean time between failures"),
    ):  # fmt: skip
        scenarios = list(dict.fromkeys(r["scenario"] for r in data))
        fig, axes = plt.subplots(1, len(scenarios), figsize=(6 * len(scenarios), 4.2), sharey=True)
        for ax, sc in zip(np.atleast_1d(axes), scenarios, strict=True):
            for pol in policies:
                sel = [r for r in data if r["scenario"] == sc and r["policy"] == pol]
                xs = [r[xkey] / HOUR for r in sel]
                style = {"linestyle": "--", "color": "0.45"} if pol == "oracle" else {}
                label = "oracle (the ceiling)" if pol == "oracle" else pol
                ys = [r["goodput_mean"] * 100 for r in sel]
                ax.plot(xs, ys, marker="o", label=label, **style)
            ax.set_xscale("log")
            ticks = [r[xkey] for r in data if r["scenario"] == sc and r["policy"] == policies[0]]
            ax.set_xticks([x / HOUR for x in ticks], [fmt_len(x) for x in ticks], fontsize=8)
            ax.minorticks_off()
            ax.set_title(sc, fontsize=10)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
        np.atleast_1d(axes)[0].set_ylabel("goodput, % of wall time (higher is better)")
        np.atleast_1d(axes)[0].legend(fontsize=8)
        fig.suptitle(title)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"wrote {path}")
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    quick_env = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    ap.add_argument("--quick", action="store_true", default=quick_env, help="few trials")
    ap.add_argument(
        "--trials",
        type=int,
        default=None,
        help="trials per cell (default 1000: the killed-save rates, ~0.5 %%, need them)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--margin",
        type=float,
        default=None,
        help="a fixed margin for slurmclock (--stop-margin); default: measured exit + slack",
    )
    ap.add_argument(
        "--history",
        type=int,
        default=HISTORY,
        help=f"earlier allocations whose measurements the budget starts from (default {HISTORY}: "
        "every window full; 0: the job's first allocation)",
    )
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args(argv)
    trials = args.trials or (20 if args.quick else 1000)
    if trials < 1:
        ap.error("--trials must be >= 1")
    if args.history < 0:
        ap.error("--history must be >= 0")
    if args.margin is not None and not (math.isfinite(args.margin) and args.margin >= 0):
        ap.error("--margin must be a finite number of seconds >= 0")
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = time_limit_study(SCENARIOS, ALLOCATIONS, trials, args.seed, args.margin, args.history)
    erows = early_study(SCENARIOS, trials, args.seed, args.margin)
    t1 = time.perf_counter()
    mrows = mtbf_study(
        SCENARIOS, MTBFS, max(4, min(20, trials // 10)), args.seed, span=10 if args.quick else 40
    )
    t2 = time.perf_counter()
    print_tables(rows, mrows)
    print_early(erows, rows)
    head = headline(rows, mrows, erows)
    print_table(
        "headline (worst case over scenarios and lengths / MTBFs)",
        ["figure", "value"],
        [[k, f"{v:.3f}"] for k, v in head.items()],
    )
    print(f"simulated in {t1 - t0:.1f} s (time limits) + {t2 - t1:.1f} s (failures)")
    write_results(
        "simulate",
        {
            "headline": head,
            "scenarios": [
                {**asdict(s), "initial_save_guess": s.initial_save_guess} for s in SCENARIOS
            ],
            "trials": trials,
            "seed": args.seed,
            "margin_s": args.margin,
            "history": args.history,
            "time_limits": rows,
            "failures": mrows,
            "early": erows,
        },
        out,
    )
    charts(rows, mrows, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
