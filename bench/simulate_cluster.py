"""Cluster simulator: what a many-node job meets between its allocations on a real SLURM cluster.

``simulate.py`` looks inside one allocation. This follows one job for months on a cluster: every
allocation is simulated by ``simulate.py``'s timeline with slurmclock's real ``TimeBudget`` and
``TimeLoop`` (start-up, steps, periodic async saves, the final save and the extra saves, the exit),
and between allocations comes what SLURM and the other users add:

* the requeue delay: a requeued job may start again only ``cred_expire`` + 1 s after its requeue
  (121 s at SLURM's default ``cred_expire=120``; the tests here set 10), and not before its step is
  gone (KillWait after the TERM) and a lost node of its allocation is marked DOWN;
* the queue wait after that, drawn from a distribution the user sets (``--queue``): presets
  ``none``, ``idle`` (the next scheduler pass), ``busy-replay`` and ``idle-replay`` (MEASURED:
  the waits our requeued job met in ``queue_replay.py``'s runs on a real SLURM with backfill and
  a replayed workload, ``results/queue-busy`` and ``results/queue-idle``; after the requeue hold,
  which is added here: see ``queue_waits.py``), ``busy`` (GUESSED: kept to compare), or
  ``replay:DIR``, ``fixed:S``, ``uniform:LO,HI``, ``exp:MEAN``, ``lognormal:MEDIAN,SIGMA``,
  ``empirical:FILE|S,S,...``. The default report runs ``idle``, ``busy-replay`` and ``busy``
  and sets the guess beside the measurement;
* node failures (per-node MTBF, a share of them frozen rather than dead) and crashes of the
  training process on a healthy node (per-node MTBF too), exponential.

What a failure costs depends on the recovery policy (each column of the table):

* ``today``: the supervisor requeues. A lost node holds the step until slurmctld marks it DOWN
  (``SlurmdTimeout``, 300 s by default), then the requeue; a crash is requeued as the step exits;
* ``crash restart``: a crash relaunches the step inside the allocation (issue 27 item 5); a lost
  node as today;
* ``N-1``: a lost node too: the step is relaunched on the allocation's healthy nodes as soon as
  ddpkit reports it (~1 s dead, ~20 s frozen) and goes on with N-1 nodes (their steps take
  N/(N-1) as long) until the allocation ends, down to ``--min-nodes``;
* ``N-1 or requeue``: as ``N-1``, but the supervisor requeues at once (the node excluded) when
  the rest of the allocation on one node less costs more (time left / N) than the requeue's wait
  (the requeue delay or SlurmdTimeout, whichever is longer, + the mean queue wait, which a job can
  measure from its own requeues);
* ``hot spare``: ``--nodes=N+1``: the step is relaunched on N nodes, the spare among them, at full
  speed (a second loss in the same allocation: as ``N-1 or requeue``); the spare costs 1/(N+1)
  of the node-hours (and may itself fail, idle);
* ``no failures``: the same job with no failure at all: what the time limits and the queue cost.

How the next allocation is asked for (``handover``, a second table): ``requeue`` (today's
``scontrol requeue``: the hold above, then the queue's wait) or ``successor``
(``REQUEUE=successor``: a job submitted at the stop with ``--dependency=afterany``, eligible when
ours has ended, no hold; on a replay queue its wait is drawn from the replay's own successor
runs, since SLURM treated them differently) or ``successor-early`` (``REQUEUE=successor-early``:
the successor submitted while the job trains, when slurmclock's own ``plan_submit`` says from the
chain's waits so far; it meets the successor's waits, counted from its submission -- assumed: a
pending job without a dependency waits as long as a successor does once eligible; on the three
load-1.8 replays it ran on, its waits averaged 18.8 model minutes against the successor's 17.0
(n=11 each); when it starts first, the job saves and hands over). It is the optimistic side:
the replay also showed an early job delaying the others, which a single job's waits omit.
``--time-min`` is measured on the replay only (``queue_replay.py``): it changes when the
backfill starts a job, which the queue's wait alone does not carry.

A relaunch costs what an allocation's start costs (launch, imports, the checkpoint's load, the
compile step) plus the work since the last durable checkpoint; it is made only while the time
left is worth it (start-up + compile + 10 steps + a save + the exit), else the job is requeued.
The oracle that never stops trains all the time at full speed on N nodes: goodput = training
time persisted (at N nodes' speed) / wall time, its share. Every default with its source is in
``simulate_cluster.json`` (``parameters``) and printed with the table.

    python bench/simulate_cluster.py [--quick] [--trials N] [--days D] [--nodes 16]
        [--allocations 1h,24h] [--queue idle --queue busy ...] [--failures llama3 ...]
        [--cred-expire 120] [--slurmd-timeout 300] [--checkpoint-every 30m] [--profile 8b]
        [--early-quantiles 0.5,0.75,1]

Writes bench/results/simulate_cluster.json and simulate_cluster.png (goodput vs MTBF).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, print_table, write_results  # noqa: E402
from queue_waits import POLICY, read_replay  # noqa: E402
from simulate import (  # noqa: E402
    DAY,
    HOUR,
    MINUTE,
    SCENARIOS,
    Outcome,
    Scenario,
    Trial,
    fmt_len,
    shared_until,
    slurmclock_rule,
)

from slurmclock import parse_human_duration  # noqa: E402
from slurmclock.supervisor.handover import KEEP_WAITS, LEAD_S, plan_submit  # noqa: E402

# SLURM's defaults (slurm.conf(5) of SLURM 22.05, the version tested here)
CRED_EXPIRE = 120.0  # AuthInfo=cred_expire: "how long a requeued job must wait before starting"
SLURMD_TIMEOUT = 300.0  # a node that does not answer is DOWN after this
KILL_WAIT = 30.0  # TERM -> KILL at the time limit
# Measured: e2e/README.md (fault matrix, test_dead_rank) and issue 27's 2-node runs
DETECT_DEAD = 1.0  # every rank knows a rank or node is gone: 0.1-1.3 s (ddpkit)
DETECT_FROZEN = 20.0  # ... that it is frozen: 18.9-21.8 s (ddpkit's heartbeat watchdog)
DETECT_CRASH = 1.0  # a crashed step has exited and the supervisor acts: assumed ~1 s
# The successor (`slurmclock supervise --successor`): sbatch --dependency=afterany at the stop;
# SLURM makes it eligible when ours has ended, no requeue hold. Its sbatch: assumed ~1 s.
SUBMIT_S = 1.0
HANDOVERS = ("requeue", "successor", "successor-early")
FROZEN_SHARE = 0.25  # guessed: a quarter of lost nodes hang rather than die
RESTART_STEPS = 10  # a relaunch is worth it when this many steps and a save still fit
# Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, sec. 3.3.4): 419 unexpected interruptions
# in 54 days of one 16,384-GPU job on 8-GPU servers = one per 264 node-days, 78% hardware.
LLAMA3_NODE_DAYS = 54 * 16384 / 8 / 419
HARDWARE_SHARE = 0.78
NODES = 16
ALLOCATIONS = (HOUR, DAY)
SWEEP_MTBF_DAYS = (7.0, 30.0, 90.0, LLAMA3_NODE_DAYS, 1000.0)  # any interruption, per node


# -- the queue ---------------------------------------------------------------------------------

QUEUE_KINDS = {"fixed": 1, "uniform": 2, "exp": 1, "lognormal": 2, "empirical": -1}
QUEUE_HELP = (
    "none, idle, busy-replay, idle-replay, busy (guessed), replay:DIR (queue_replay.py's runs), "
    "fixed:S, uniform:LO,HI, exp:MEAN, lognormal:MEDIAN,SIGMA, or empirical:FILE|S,S,... "
    "(durations: 90, 90s, 15m, 2h, 1d)"
)


@dataclass(kw_only=True, slots=True)
class QueueWait:
    """Seconds a requeued job waits in the queue once it is eligible again."""

    name: str
    kind: str  # a key of QUEUE_KINDS
    values: tuple[float, ...]  # seconds (lognormal: median seconds, sigma of log-seconds)
    about: str = ""
    replay: str = ""  # the folder of queue_replay.py runs it was read from (replay:DIR)
    replay_label: str | None = None  # the runs' label there (a preset's), None: every label

    def __post_init__(self) -> None:
        want = QUEUE_KINDS.get(self.kind)
        if want is None:
            raise ValueError(f"queue wait {self.name!r}: unknown kind {self.kind!r}: {QUEUE_HELP}")
        if (want >= 0 and len(self.values) != want) or not self.values:
            count = "at least one" if want < 0 else str(want)
            raise ValueError(f"queue wait {self.name!r}: {self.kind} takes {count} value(s)")
        if not all(math.isfinite(v) and v >= 0 for v in self.values):
            raise ValueError(f"queue wait {self.name!r}: values must be finite and >= 0")
        if self.kind == "uniform" and self.values[0] > self.values[1]:
            raise ValueError(f"queue wait {self.name!r}: uniform:LO,HI needs LO <= HI")

    def draw(self, rng: np.random.Generator) -> float:
        v = self.values
        if self.kind == "fixed":
            return v[0]
        if self.kind == "uniform":
            return float(rng.uniform(v[0], v[1]))
        if self.kind == "exp":
            return float(rng.exponential(v[0]))
        if self.kind == "lognormal":
            return v[0] * math.exp(v[1] * float(rng.standard_normal()))
        return v[int(rng.integers(len(v)))]

    @property
    def mean(self) -> float:
        v = self.values
        if self.kind == "uniform":
            return (v[0] + v[1]) / 2
        if self.kind == "lognormal":
            return v[0] * math.exp(v[1] ** 2 / 2)
        return float(np.mean(v))


QUEUE_PRESETS = {
    "none": QueueWait(name="none", kind="fixed", values=(0.0,), about="no wait in the queue"),
    "idle": QueueWait(
        name="idle",
        kind="uniform",
        values=(0.0, 60.0),
        about="an idle cluster: the next pass of the main scheduler starts the job "
        "(sched_interval, 60 s by default; slurm.conf(5))",
    ),
    "busy": QueueWait(
        name="busy",
        kind="lognormal",
        values=(30 * MINUTE, 1.0),
        about="a busy cluster, GUESSED: lognormal, median 30 min, sigma 1 (mean 49 min, one in "
        "ten waits > 1.8 h); kept to compare with busy-replay",
    ),
}
# Measured on a real SLURM (queue_replay.py): the committed runs, read when asked for (not under
# BENCH_RESULTS, which bench/run.py points at its output folder)
REPO = Path(__file__).resolve().parent.parent
REPLAY_PRESETS = {
    "busy-replay": "bench/results/queue-busy",
    "idle-replay": "bench/results/queue-idle",
}
DEFAULT_QUEUES = ("idle", "busy-replay", "busy")


def parse_queue(text: str) -> QueueWait:
    """A preset name or KIND:VALUES (see QUEUE_HELP)."""
    if text in QUEUE_PRESETS:
        return QUEUE_PRESETS[text]
    kind, sep, rest = text.partition(":")
    if text in REPLAY_PRESETS or (kind == "replay" and rest):
        preset = REPLAY_PRESETS.get(text)
        return replay_queue(text, REPO / preset if preset else Path(rest), preset)
    if not sep or kind not in QUEUE_KINDS:
        raise ValueError(f"--queue {text!r}: use {QUEUE_HELP}")
    is_file = kind == "empirical" and Path(rest).is_file()
    items = (
        Path(rest).read_text().replace(",", " ") if is_file else rest.replace(",", " ")
    ).split()
    try:
        if kind == "lognormal" and len(items) == 2:
            values = (parse_human_duration(items[0]), _sigma(items[1]))
        else:
            values = tuple(parse_human_duration(x) for x in items)
    except ValueError as e:
        why = str(e)
        if kind == "empirical" and not is_file:
            why = f"{rest!r} is neither a file nor waits like 30s,5m,2h"
        raise ValueError(f"--queue {text!r}: {why}") from None
    return QueueWait(name=text, kind=kind, values=values, about=f"{kind} (set by --queue)")


def replay_queue(
    name: str, path: Path, label: str | None = None, policy: str = POLICY
) -> QueueWait:
    """The empirical distribution of the queue waits (model seconds, after the requeue hold:
    ``requeue_delay`` adds it) that today's requeue (or ``policy``) met in ``queue_replay.py``'s
    runs in ``path`` (``queue_waits.read_replay``)."""
    try:
        got = read_replay(path, label, policy)
    except ValueError as e:
        raise ValueError(f"--queue {name!r}: {e}") from None
    return QueueWait(
        name=name,
        kind="empirical",
        values=got.waits,
        about=got.about(),
        replay=str(path),
        replay_label=label,
    )


def successor_queue(q: QueueWait) -> QueueWait:
    """The queue a successor job meets: a replay's own successor runs where the queue came from
    a replay (SLURM treated them differently: eligible at once, no reset of a requeued job), else
    the same distribution (only the requeue hold differs)."""
    if not q.replay:
        return q
    return replay_queue(q.name, Path(q.replay), q.replay_label, policy="successor")


def _sigma(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"sigma {text!r} must be a number (log-seconds: 1.0)") from None


# -- failures ----------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Failures:
    """How often a node is lost and a training process crashes on a healthy node, per node."""

    name: str
    node_mtbf: float  # seconds per node between node losses (dead or frozen); inf: never
    crash_mtbf: float  # seconds per node between crashes of the training process; inf: never
    about: str = ""

    def __post_init__(self) -> None:
        if not (self.node_mtbf > 0 and self.crash_mtbf > 0):
            raise ValueError(f"failures {self.name!r}: MTBFs must be > 0 (never: 'never')")

    @classmethod
    def split(cls, name: str, mtbf: float, about: str) -> Failures:
        """Any interruption every ``mtbf`` seconds per node, in Llama 3's proportions."""
        return cls(
            name=name,
            node_mtbf=mtbf / HARDWARE_SHARE,
            crash_mtbf=mtbf / (1 - HARDWARE_SHARE),
            about=about,
        )


FAILURE_PRESETS = {
    "llama3": Failures.split(
        "llama3",
        LLAMA3_NODE_DAYS * DAY,
        "Llama 3's rate: an interruption every 264 node-days, 78% of them a node (hardware), "
        "22% a crash",
    ),
    "flaky": Failures.split(
        "flaky",
        30 * DAY,
        "GUESSED: a cluster ~9x worse: an interruption every 30 node-days (78% / 22%)",
    ),
}
FAILURES_HELP = "llama3, flaky, or NODE_MTBF/CRASH_MTBF per node (durations or 'never': 100d/400d)"


def parse_failures(text: str) -> Failures:
    if text in FAILURE_PRESETS:
        return FAILURE_PRESETS[text]
    parts = text.split("/")
    if len(parts) != 2:
        raise ValueError(f"--failures {text!r}: use {FAILURES_HELP}")
    try:
        node, crash = (math.inf if p == "never" else parse_human_duration(p) for p in parts)
    except ValueError as e:
        raise ValueError(f"--failures {text!r}: {e}") from None
    return Failures(name=text, node_mtbf=node, crash_mtbf=crash, about="set by --failures")


# -- policies and the cluster ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    about: str
    restart_crash: bool = False  # relaunch in the allocation after a crash
    restart_node: bool = False  # ... and after a lost node (on the nodes left, or a spare)
    spares: int = 0
    requeue_if_cheaper: bool = False  # a lost node, no spare: requeue when N-1 would cost more
    failures: bool = True  # False: the reference without failures


POLICIES = (
    Policy(
        "no failures",
        "the same job without failures: what the time limits and the queue cost",
        failures=False,
    ),
    Policy("today", "the supervisor requeues; a lost node holds the step until SlurmdTimeout"),
    Policy(
        "crash restart", "a crash relaunches the step in the allocation; a lost node as today", True
    ),
    Policy(
        "N-1",
        "also a lost node: relaunch on the nodes left, slower, to the allocation's end",
        True,
        True,
    ),
    Policy(
        "N-1 or requeue",
        "as N-1, but requeue (the node excluded) when the time left / N is more than the "
        "requeue's wait (requeue delay or SlurmdTimeout, + the mean queue wait)",
        True,
        True,
        requeue_if_cheaper=True,
    ),
    Policy(
        "hot spare",
        "--nodes=N+1: the spare replaces a lost node; a second one: as N-1 or requeue",
        True,
        True,
        1,
        requeue_if_cheaper=True,
    ),
)
FAILING = tuple(p for p in POLICIES if p.failures)


@dataclass(kw_only=True, slots=True)
class Cluster:
    """What SLURM and the other users add between and during a job's allocations."""

    nodes: int = NODES
    min_nodes: int = NODES // 2
    queue: QueueWait
    failures: Failures
    cred_expire: float = CRED_EXPIRE
    slurmd_timeout: float = SLURMD_TIMEOUT
    kill_wait: float = KILL_WAIT
    frozen_share: float = FROZEN_SHARE
    handover: str = "requeue"  # or "successor", "successor-early": how the next one is asked for
    # successor-early: plan the lead at this quantile of the chain's waits (None: slurmclock's
    # plan_submit, the median), to compare plans
    early_quantile: float | None = None

    def __post_init__(self) -> None:
        if self.handover not in HANDOVERS:
            raise ValueError(f"handover {self.handover!r}: use one of {', '.join(HANDOVERS)}")
        if self.nodes < 1:
            raise ValueError(f"--nodes {self.nodes}: a job has at least 1 node")
        if not 1 <= self.min_nodes <= self.nodes:
            raise ValueError(f"--min-nodes {self.min_nodes}: must be 1..--nodes ({self.nodes})")
        for name in ("cred_expire", "slurmd_timeout", "kill_wait"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0")
        if not 0 <= self.frozen_share <= 1:
            raise ValueError("--frozen-share must be between 0 and 1")
        if self.early_quantile is not None and not 0 <= self.early_quantile <= 1:
            raise ValueError("--early-quantiles: each must be between 0 and 1 (0.5: the median)")

    @property
    def requeue_delay(self) -> float:
        """From the release to eligible: SLURM's hold of a requeued job, or a successor's sbatch."""
        return self.cred_expire + 1.0 if self.handover == "requeue" else SUBMIT_S


# -- one job -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    """A run of the steps to its stop at the limit, as slurmclock's budget and loop drove it:
    its outcome, and when its periodic saves were durable with the training each held."""

    out: Outcome
    durable: np.ndarray
    held: np.ndarray

    @classmethod
    def simulated(cls, trial: Trial) -> Run:
        every = trial.every
        ends = np.arange(every - 1, len(trial.d), every)  # the steps a periodic save follows
        durable = trial.t_end[ends] + trial.saves[: len(ends)]
        return cls(slurmclock_rule(trial), durable, trial.cs[ends])

    def later(self, more: float) -> Run:
        """The same run with ``more`` seconds of steady steps before its first periodic save."""
        return Run(_later(self.out, more), self.durable + more, self.held + more)

    def kept(self, kill: float, length: float) -> tuple[float, bool]:
        """Seconds of steps persisted when a failure comes ``kill`` seconds in, and whether the
        run had ended by itself before. A failure after the final save keeps that save (not
        the extra saves' steps); one in the minutes before it keeps the periodic saves of the
        plain timeline (the budget may have refused one)."""
        out = self.out
        if kill >= out.released(length):
            return out.useful, True
        if out.final_at is not None and kill >= out.final_at:
            return out.final_useful, False
        i = int(np.searchsorted(self.durable, kill, side="right"))
        # never more than the run trained (the plain timeline goes on past its stop)
        return (min(float(self.held[i - 1]), out.useful + out.lost) if i else 0.0), False


class Job:
    """A job profile on ``nodes`` nodes with allocations of ``length`` seconds, and the runs of
    its steps that the allocations hold, each simulated with slurmclock's budget and loop and
    drawn from pools simulated ahead (a pool is simulated the first time it is needed):

    * a whole allocation: from a pool of such allocations;
    * a relaunched run (shorter, maybe on fewer nodes): shorter than three periods of the
      periodic saves (more if ``window`` is long), from a pool of runs a minute shorter at
      most; longer, from a pool of runs of that many periods that end in the same phase of the
      periodic saves (to a minute), the difference as steady steps (and periodic saves) before
      their first save;
    * a failure earlier than ``window`` before the run's end (twice the most that the budget's
      first possible stop lay before the end in the whole-allocation pool): the budget cannot
      have acted yet, so the periodic saves of a plain timeline up to the failure are simulated.
    """

    def __init__(
        self, sc: Scenario, nodes: int, length: float, *, pool: int, phase_pool: int, seed: int
    ) -> None:
        self.nodes, self.length, self.seed, self.phase_pool = nodes, length, seed, phase_pool
        self.base = replace(sc, nodes=nodes)
        self._on: dict[int, Scenario] = {}
        self._pools: dict[tuple[int, str, int], list[Run]] = {}
        rng = np.random.default_rng([seed, 7])
        trials = [Trial(self.base, length, rng) for _ in range(pool)]
        self.pool = [Run.simulated(t) for t in trials]
        self.window = 2 * max(length - shared_until(t) for t in trials)

    def on(self, running: int) -> Scenario:
        """The profile on ``running`` of the job's nodes: the same global batch, so each step
        takes nodes / running as long (saves and start-up as on all nodes)."""
        if running not in self._on:
            self._on[running] = replace(
                self.base, step_median=self.base.step_median * self.nodes / running, nodes=running
            )
        return self._on[running]

    @property
    def handover_s(self) -> float:
        """From a successor's "save and hand over" to this job gone: its save and exit."""
        return self.base.save_median + self.base.exit_median

    def worth(self, running: int) -> float:
        """The least time left for which a relaunch in the allocation is worth it: start-up,
        compile, RESTART_STEPS steps, a save and the exit."""
        sc = self.on(running)
        steps = sc.first_step + RESTART_STEPS * sc.step_median
        return sc.startup + steps + sc.save_median + sc.exit_median

    def segment(
        self, running: int, length: float, kill: float, rng: np.random.Generator
    ) -> tuple[float, Outcome | None]:
        """Training seconds (at the speed of all nodes) that a run of ``length`` seconds on
        ``running`` nodes persists when a failure comes ``kill`` seconds in (inf: none), and its
        outcome when it ended by itself first (None: the failure ended it)."""
        speed = running / self.nodes
        if kill < length - self.window:  # only the steps up to the kill matter
            trial = Trial(self.on(running), kill + 1.0, rng)
            return speed * committed(trial, kill), None
        run = self.run(running, length, rng)
        kept, ended = run.kept(kill, length)
        return speed * kept, run.out if ended else None

    def run(self, running: int, length: float, rng: np.random.Generator) -> Run:
        """A run of ``length`` seconds on ``running`` nodes, to its stop at the limit."""
        if running == self.nodes and length == self.length:
            return self.pool[int(rng.integers(len(self.pool)))]
        period = self.on(running).periodic_every
        # long enough that a failure in its last ``window`` comes after its first periodic save
        periods = max(3, math.ceil(self.window / period) + 2)
        if length < periods * period:
            key, short = (running, "minutes", int(length // MINUTE)), length // MINUTE * MINUTE
        else:
            phase = int(length % period // MINUTE)
            key, short = (running, "phase", phase), periods * period + phase * MINUTE
        if key not in self._pools:
            seeded = np.random.default_rng([self.seed, 8, running, len(key[1]), key[2]])
            sc = self.on(running)
            self._pools[key] = [
                Run.simulated(Trial(sc, short, seeded)) for _ in range(self.phase_pool)
            ]
        return self._pools[key][int(rng.integers(self.phase_pool))].later(length - short)


def _later(out: Outcome, more: float) -> Outcome:
    """``out`` with ``more`` seconds of steady steps before its end (persisted by its end)."""

    def shifted(at: float | None) -> float | None:
        return None if at is None else at + more

    return replace(
        out,
        useful=out.useful + more,
        saved_at=shifted(out.saved_at),
        exited_at=shifted(out.exited_at),
        final_at=shifted(out.final_at),
        final_useful=out.final_useful + more if out.final_at is not None else 0.0,
    )


def committed(trial: Trial, kill: float) -> float:
    """Seconds of steps in the periodic saves of ``trial`` durable by ``kill``."""
    return trial.useful(trial.periodic_committed(trial.last_step_done_before(kill), kill))


@dataclass(slots=True)
class Streams:
    """Separate random streams, so that the policies see the same queue waits, failures and
    step times for as long as their histories agree (common random numbers)."""

    queue: np.random.Generator
    fail: np.random.Generator
    spare: np.random.Generator
    draws: np.random.Generator

    @classmethod
    def seeded(cls, seed: Sequence[int]) -> Streams:
        return cls(*(np.random.default_rng([*seed, k]) for k in range(4)))


@dataclass(slots=True)
class Allocation:
    useful: float = 0.0  # training seconds at the speed of all N nodes, persisted
    released: float = 0.0  # the requeue, from the allocation's start
    ended: float = 0.0  # the job's step gone (its nodes free), from the allocation's start
    eligible: float = 0.0  # when the job may start again, from the allocation's start
    failures: int = 0
    restarts: int = 0


def next_failure(cl: Cluster, running: int, rng: np.random.Generator) -> tuple[float, bool]:
    """Seconds to the next failure on ``running`` nodes, and whether it is a lost node."""
    f = cl.failures
    node = rng.exponential(f.node_mtbf / running) if math.isfinite(f.node_mtbf) else math.inf
    crash = rng.exponential(f.crash_mtbf / running) if math.isfinite(f.crash_mtbf) else math.inf
    return (float(node), True) if node <= crash else (float(crash), False)


def allocation(
    cl: Cluster, pol: Policy, job: Job, rngs: Streams, length: float | None = None
) -> Allocation:
    """One allocation under ``pol``, from its start to the requeue; ``length``: a limit other
    than the job's (a run that hands over to its successor, or one that waited for its
    predecessor)."""
    a = Allocation()
    length = job.length if length is None else length
    running, start, down_by = cl.nodes, 0.0, 0.0
    # when each idle spare dies (a spare taken into the step fails with the step's nodes)
    spares = list(rngs.spare.exponential(cl.failures.node_mtbf, pol.spares))
    while True:
        kill, node = next_failure(cl, running, rngs.fail) if pol.failures else (math.inf, False)
        frozen = rngs.fail.random() < cl.frozen_share
        useful, out = job.segment(running, length - start, kill, rngs.draws)
        a.useful += useful
        if out is not None:  # ran to its stop at the limit
            return _ended(a, cl, out, start, length, down_by)
        at = start + kill
        a.failures += 1
        detect = (DETECT_FROZEN if frozen else DETECT_DEAD) if node else DETECT_CRASH
        if node:
            down_by = at + cl.slurmd_timeout  # the allocation ends only once the node is DOWN
        relaunch = pol.restart_node if node else pol.restart_crash
        if relaunch:
            running, spares = _nodes_left(cl, pol, length, node, at, detect, running, spares)
        if relaunch and running >= cl.min_nodes and length - at - detect >= job.worth(running):
            start = at + detect
            a.restarts += 1
            continue
        # the supervisor requeues on the fault record; today a lost node first holds the step
        requeue = at + detect if relaunch or not node else at + cl.slurmd_timeout
        a.released = min(requeue, length)
        a.ended = max(a.released, down_by)
        a.eligible = max(a.released + cl.requeue_delay, a.ended)
        return a


def _nodes_left(
    cl: Cluster,
    pol: Policy,
    length: float,
    node: bool,
    at: float,
    detect: float,
    running: int,
    spares: list[float],
) -> tuple[int, list[float]]:
    """The nodes a relaunch after a failure at ``at`` runs on (0: requeue instead), and the
    spares left: a lost node's place goes to a spare still alive, else the step goes on with one
    node less -- unless ``requeue_if_cheaper`` and the rest of the allocation on one node less
    costs more than waiting for the requeue."""
    if not node:
        return running, spares
    alive = [s for s in spares if s > at]
    if alive:
        return running, alive[1:]
    if pol.requeue_if_cheaper:
        slower = (length - at - detect) / cl.nodes
        wait = max(detect + cl.requeue_delay, cl.slurmd_timeout) + cl.queue.mean
        if slower > wait:
            return 0, []
    return running - 1, []


def _ended(
    a: Allocation, cl: Cluster, out: Outcome, start: float, length: float, down_by: float
) -> Allocation:
    """The allocation ended at its limit: the exit requeued it (or supervise did at SLURM's TERM,
    the step gone at its exit or KillWait later)."""
    a.released = start + out.released(length - start)
    gone = length + cl.kill_wait if out.exited_at is None else start + out.exited_at
    a.ended = max(a.released, min(gone, length + cl.kill_wait), down_by)
    a.eligible = max(a.released + cl.requeue_delay, a.ended)
    return a


@dataclass(slots=True)
class Tally:
    useful: float = 0.0  # training seconds at the speed of all N nodes, persisted
    wall: float = 0.0
    node_seconds: float = 0.0  # nodes held (spares too) x time, allocation start to requeue
    waited: float = 0.0  # requeue delays and queue waits
    allocations: int = 0
    failures: int = 0
    restarts: int = 0

    def count(self, a: Allocation, nodes: int, held: float, waited: float) -> None:
        """One allocation ``a`` that held ``nodes`` for ``held`` seconds and was followed by
        ``waited`` seconds until the next one started."""
        self.useful += a.useful
        self.node_seconds += nodes * held
        self.waited += waited
        self.allocations += 1
        self.failures += a.failures
        self.restarts += a.restarts


def run_job(cl: Cluster, pol: Policy, job: Job, days: float, seed: Sequence[int]) -> Tally:
    """The job's allocations over ``days`` of wall time (the last one finished)."""
    rngs = Streams.seeded(seed)
    t = cl.queue.draw(rngs.queue)  # the first submission waits too
    tally = Tally(waited=t)
    if cl.handover == "successor-early":
        return _run_early(cl, pol, job, days, rngs, tally)
    while t < days * DAY:
        a = allocation(cl, pol, job, rngs)
        wait = a.eligible - a.released + cl.queue.draw(rngs.queue)
        t += a.released + wait
        tally.count(a, cl.nodes + pol.spares, a.released, wait)
    tally.wall = t
    return tally


def _run_early(
    cl: Cluster, pol: Policy, job: Job, days: float, rngs: Streams, tally: Tally
) -> Tally:
    """``REQUEUE=successor-early``: each allocation submits its successor (no dependency) when
    slurmclock's own ``plan_submit`` says, from the chain's waits so far. A successor that starts
    while this job trains asks it to save and hand over (the run's limit becomes that moment +
    its save and exit) and its step starts once this job is gone (``head``: two allocations
    held). A failure before the submission submits the successor at the stop, as ``successor``."""
    t, head, waits = tally.waited, 0.0, list[float]()
    while t < days * DAY:
        submit = _plan(cl, job.length, waits[-KEEP_WAITS:])
        wait = cl.queue.draw(rngs.queue)
        starts = submit + SUBMIT_S + wait  # from this allocation's start, as all times here
        limit = job.length - head
        if starts < job.length:  # the successor may start while this job trains
            limit = max(min(limit, starts + job.handover_s - head), job.worth(cl.nodes))
        a = allocation(cl, pol, job, rngs, limit)
        released, ended = head + a.released, head + a.ended
        if released < submit:  # stopped by a failure before the early submission
            wait = cl.queue.draw(rngs.queue)
            starts = max(released + SUBMIT_S, ended) + wait
        waits.append(wait)
        tally.count(a, cl.nodes + pol.spares, released, max(0.0, starts - released))
        head = max(0.0, ended - starts)  # the next step waits until this job is gone
        t += starts
    tally.wall = t
    return tally


def _plan(cl: Cluster, length: float, waits: list[float]) -> float:
    """When the early successor is submitted, from the allocation's start."""
    if cl.early_quantile is None or not waits:
        submit, _ = plan_submit(started=0.0, end=length, waits=waits)
        assert submit is not None  # an end is known
        return submit
    return max(0.0, length - float(np.quantile(waits, cl.early_quantile)) - LEAD_S)


# -- studies -----------------------------------------------------------------------------------


def cell(cl: Cluster, pol: Policy, job: Job, days: float, trials: int, seed: int) -> dict[str, Any]:
    """One policy on one cluster: ``trials`` jobs of ``days`` each (the same seeds for every
    policy), pooled: training time persisted / wall time."""
    tallies = [run_job(cl, pol, job, days, (seed, k)) for k in range(trials)]
    useful, wall = sum(t.useful for t in tallies), sum(t.wall for t in tallies)
    per = np.array([t.useful / t.wall for t in tallies])
    return {
        "policy": pol.name,
        "handover": cl.handover,
        "queue": cl.queue.name,
        "allocation_s": job.length,
        "failures": cl.failures.name,
        "node_mtbf_s": cl.failures.node_mtbf,
        "crash_mtbf_s": cl.failures.crash_mtbf,
        "goodput": useful / wall,
        "goodput_se": float(per.std(ddof=1) / math.sqrt(trials)) if trials > 1 else None,
        "node_hour_share": useful * cl.nodes / sum(t.node_seconds for t in tallies),
        "waiting_share": sum(t.waited for t in tallies) / wall,
        "failures_per_day": sum(t.failures for t in tallies) / (wall / DAY),
        "restarts_per_day": sum(t.restarts for t in tallies) / (wall / DAY),
        "allocations_per_day": sum(t.allocations for t in tallies) / (wall / DAY),
        "simulated_days": wall / DAY,
        "trials": trials,
    }


def study(
    base: Cluster,
    queues: Sequence[QueueWait],
    failure_sets: Sequence[Failures],
    jobs: Sequence[Job],
    *,
    days: float,
    trials: int,
    seed: int,
) -> list[dict[str, Any]]:
    """Every policy under every queue, failure rate and allocation length. The reference
    without failures is the same at every failure rate: run once per queue and length."""
    rows: list[dict[str, Any]] = []
    for job in jobs:
        for queue in queues:
            ref = cell(replace(base, queue=queue), POLICIES[0], job, days, trials, seed)
            for failures in failure_sets:
                cl = replace(base, queue=queue, failures=failures)
                rows.append({**ref, "failures": failures.name, "node_mtbf_s": failures.node_mtbf})
                rows += [cell(cl, pol, job, days, trials, seed) for pol in FAILING]
    failure_cost(rows)
    return rows


def failure_cost(rows: list[dict[str, Any]]) -> None:
    """Adds to each row what one failure cost: the hours of the N nodes' training that the
    policy lost against the run without failures (same queue and length), per failure."""
    refs = {
        (r["queue"], r["allocation_s"]): r["goodput"] for r in rows if r["policy"] == "no failures"
    }
    for r in rows:
        per_day = r["failures_per_day"]
        lost = refs[(r["queue"], r["allocation_s"])] - r["goodput"]
        r["hours_lost_per_failure"] = 24 * lost / per_day if per_day > 0 else None


def handover_study(
    base: Cluster,
    queues: Sequence[QueueWait],
    failures: Failures,
    jobs: Sequence[Job],
    rows: list[dict[str, Any]],
    *,
    days: float,
    trials: int,
    seed: int,
) -> list[dict[str, Any]]:
    """Today's requeue (the rows of ``study``) against a successor job (issue 35 item 3) and
    one submitted early (item 4), with and without ``failures``, per queue and length: the
    successor skips the requeue hold and, on a replay, meets the queue its own runs met there;
    the early one meets the same waits, counted from its submission (assumed: a pending job
    without a dependency waits as long as a successor does once eligible)."""
    by = {(r["policy"], r["failures"], r["queue"], r["allocation_s"]): r for r in rows}
    out: list[dict[str, Any]] = []
    for queue in queues:
        succ = successor_queue(queue)
        for job in jobs:
            for pol in (POLICIES[0], POLICIES[1]):
                today = by[(pol.name, failures.name, queue.name, job.length)]
                cl = replace(base, queue=succ, failures=failures, handover="successor")
                got = cell(cl, pol, job, days, trials, seed)
                early = cell(replace(cl, handover="successor-early"), pol, job, days, trials, seed)
                out.append(
                    {
                        "queue": queue.name,
                        "allocation_s": job.length,
                        "policy": pol.name,
                        "failures": failures.name if pol.failures else "none",
                        "mean_wait_requeue_s": queue.mean,
                        "mean_wait_successor_s": succ.mean,
                        "successor_waits_from": succ.about,
                        "goodput_requeue": today["goodput"],
                        "goodput_successor": got["goodput"],
                        "successor_vs_requeue": got["goodput"] / today["goodput"],
                        "waiting_share_requeue": today["waiting_share"],
                        "waiting_share_successor": got["waiting_share"],
                        "goodput_successor_early": early["goodput"],
                        "successor_early_vs_requeue": early["goodput"] / today["goodput"],
                        "waiting_share_successor_early": early["waiting_share"],
                        "node_hour_share_successor_early": early["node_hour_share"],
                    }
                )
    return out


def lead_study(
    base: Cluster,
    queues: Sequence[QueueWait],
    jobs: Sequence[Job],
    rows: list[dict[str, Any]],
    quantiles: Sequence[float],
    *,
    days: float,
    trials: int,
    seed: int,
) -> list[dict[str, Any]]:
    """``successor-early`` without failures, its lead planned at each quantile of the chain's
    waits instead of slurmclock's median: is the plan's median the right choice?"""
    by = {(r["policy"], r["queue"], r["allocation_s"]): r for r in rows}
    out: list[dict[str, Any]] = []
    for queue in queues:
        for job in jobs:
            today = by[(POLICIES[0].name, queue.name, job.length)]["goodput"]
            cl = replace(base, queue=successor_queue(queue), handover="successor-early")
            for q in quantiles:
                got = cell(replace(cl, early_quantile=q), POLICIES[0], job, days, trials, seed)
                out.append(
                    {
                        "queue": queue.name,
                        "allocation_s": job.length,
                        "quantile": q,
                        "goodput": got["goodput"],
                        "vs_requeue": got["goodput"] / today,
                        "allocations_per_day": got["allocations_per_day"],
                    }
                )
    return out


def sweep(
    base: Cluster,
    queues: Sequence[QueueWait],
    jobs: Sequence[Job],
    refs: list[dict[str, Any]],
    *,
    mtbf_days: Sequence[float],
    days: float,
    trials: int,
    seed: int,
) -> list[dict[str, Any]]:
    """Goodput against the per-node MTBF (any interruption, in Llama 3's proportions)."""
    rows: list[dict[str, Any]] = []
    for job in jobs:
        for queue in queues:
            ref = next(
                r
                for r in refs
                if r["policy"] == POLICIES[0].name
                and (r["queue"], r["allocation_s"]) == (queue.name, job.length)
            )
            for mtbf in mtbf_days:
                failures = Failures.split(f"{mtbf:.0f} d", mtbf * DAY, "swept")
                cl = replace(base, queue=queue, failures=failures)
                rows.append({**ref, "failures": failures.name, "node_mtbf_s": failures.node_mtbf})
                rows += [cell(cl, pol, job, days, trials, seed) for pol in FAILING]
    failure_cost(rows)
    return rows


# -- output ------------------------------------------------------------------------------------


def _cell_text(r: dict[str, Any], today: float, spares: int) -> str:
    text = f"{r['goodput'] * 100:5.1f}%"
    if r["policy"] in ("no failures", "today"):
        return text
    ratio = f"{r['goodput'] / today:.3f}x"
    if spares and r["policy"] == "hot spare":
        ratio += f"; {r['node_hour_share'] * 100:.1f}% of node-h"
    return f"{text} ({ratio})"


def print_goodput(rows: list[dict[str, Any]], nodes: int, spares: int) -> None:
    for failures in dict.fromkeys(r["failures"] for r in rows):
        table: list[list[object]] = []
        sel = [r for r in rows if r["failures"] == failures]
        for key in dict.fromkeys((r["queue"], r["allocation_s"]) for r in sel):
            got = {r["policy"]: r for r in sel if (r["queue"], r["allocation_s"]) == key}
            today = got["today"]["goodput"]
            cells = [_cell_text(got[p.name], today, spares) for p in POLICIES]
            per_day = got["today"]["failures_per_day"]
            table.append([key[0], fmt_len(key[1]), f"{per_day:.2f}", *cells])
        print_table(
            f"goodput of a {nodes}-node job, failures {failures!r}: training time persisted / "
            f"wall time (an oracle that never stops: 100%), vs today; mean of "
            f"{sel[0]['trials']} jobs x {sel[0]['simulated_days'] / sel[0]['trials']:.0f} days",
            ["queue", "allocation", "failures/day", *(p.name for p in POLICIES)],
            table,
        )


def print_handover(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print_table(
        "between allocations: today's requeue (cred_expire + 1 s hold, the requeue's queue) vs "
        "a successor job (REQUEUE=successor: no hold; on a replay, the queue its own runs met) "
        "vs one submitted while the job trains (REQUEUE=successor-early: the same waits)",
        [
            "queue",
            "allocation",
            "failures",
            "mean wait, requeue / successor",
            "goodput, requeue",
            "goodput, successor",
            "successor / requeue",
            "goodput, successor-early",
            "early / requeue",
        ],
        [
            [
                r["queue"],
                fmt_len(r["allocation_s"]),
                r["failures"],
                f"{r['mean_wait_requeue_s'] / MINUTE:.1f} / "
                f"{r['mean_wait_successor_s'] / MINUTE:.1f} min",
                f"{r['goodput_requeue'] * 100:.1f}%",
                f"{r['goodput_successor'] * 100:.1f}%",
                f"{r['successor_vs_requeue']:.3f}x",
                f"{r['goodput_successor_early'] * 100:.1f}%",
                f"{r['successor_early_vs_requeue']:.3f}x",
            ]
            for r in rows
        ],
    )


def print_costs(rows: list[dict[str, Any]]) -> None:
    table: list[list[object]] = []
    for key in dict.fromkeys((r["failures"], r["queue"], r["allocation_s"]) for r in rows):
        got = {
            r["policy"]: r for r in rows if (r["failures"], r["queue"], r["allocation_s"]) == key
        }
        cells = []
        for pol in FAILING:
            h = got[pol.name]["hours_lost_per_failure"]
            cells.append("-" if h is None else f"{h * 60:.0f} min")
        table.append([key[0], key[1], fmt_len(key[2]), *cells])
    print_table(
        "what one failure costs: minutes of the whole job's training lost per failure, against "
        "the same job without failures (noisy where failures are rare)",
        ["failures", "queue", "allocation", *(p.name for p in FAILING)],
        table,
    )


def print_parameters(params: list[dict[str, Any]]) -> None:
    print_table(
        "parameters (GUESSED where the source says so)",
        ["parameter", "value", "source"],
        [[p["name"], p["value"], p["source"]] for p in params],
    )


def parameters(
    cl: Cluster, job: Job, queues: Sequence[QueueWait], failure_sets: Sequence[Failures]
) -> list[dict[str, Any]]:
    """Every input with its value and where it comes from."""

    def days(mtbf: float) -> str:
        return f"{mtbf / DAY:.0f} d" if math.isfinite(mtbf) else "never"

    rows = _job_rows(cl, job) + _cluster_rows(cl)
    rows += [(f"queue '{q.name}'", f"mean {q.mean / MINUTE:.1f} min", q.about) for q in queues]
    rows += [
        (
            f"failures '{f.name}'",
            f"per node: a node lost every {days(f.node_mtbf)}, a crash every {days(f.crash_mtbf)}",
            f.about,
        )
        for f in failure_sets
    ]
    return [{"name": n, "value": v, "source": s} for n, v, s in rows]


def _job_rows(cl: Cluster, job: Job) -> list[tuple[str, object, str]]:
    sc = job.base
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in sc.startup_parts.items())
    return [
        ("nodes", cl.nodes, "issue 27's headline job"),
        ("profile", sc.name, f"{sc.about}; " + "; ".join(sc.sources)),
        ("start-up, also of a relaunch", f"{sc.startup:.0f} s", f"the profile's: {parts}"),
        ("compile step", f"{sc.first_step:.0f} s", "the profile's"),
        (
            "periodic saves",
            f"every {fmt_len(sc.periodic_every)}" + (", async" if sc.async_periodic else ""),
            "pyrecover-train's --async-checkpoint default (--checkpoint-every sets it); their "
            "times: the profile's",
        ),
        (
            "relaunch worth it when left >=",
            f"{job.worth(cl.nodes):.0f} s",
            f"start-up + compile + {RESTART_STEPS} steps + a save + the exit (issue 27: "
            "start-up + a few steps)",
        ),
        ("speed on fewer nodes", "running / N", "assumed: data parallel, the same global batch"),
        ("min nodes (N-1 policies)", cl.min_nodes, "--min-nodes (the user's choice; default N/2)"),
        (
            "hot spare",
            "1 node, may fail idle",
            "its queue wait taken as the N-node job's (assumed)",
        ),
    ]


def _cluster_rows(cl: Cluster) -> list[tuple[str, object, str]]:
    slurm = "SLURM 22.05's default, slurm.conf(5)"
    return [
        (
            "cred_expire",
            f"{cl.cred_expire:.0f} s",
            f"{slurm}; a requeued job waits it + 1 s (this repository's tests set 10)",
        ),
        (
            "SlurmdTimeout",
            f"{cl.slurmd_timeout:.0f} s",
            f"{slurm}; a lost node holds the step (and the job's end) until DOWN",
        ),
        ("KillWait", f"{cl.kill_wait:.0f} s", slurm),
        (
            "a dead node or rank seen",
            f"{DETECT_DEAD:.0f} s",
            "measured: e2e/README.md (0.2-1.3 s), issue 27 (0.12 s across nodes)",
        ),
        (
            "a frozen one seen",
            f"{DETECT_FROZEN:.0f} s",
            "measured: e2e/README.md, ddpkit's heartbeat watchdog (18.9-21.8 s)",
        ),
        ("a crash seen", f"{DETECT_CRASH:.0f} s", "assumed: the step exits, the supervisor acts"),
        ("frozen share of lost nodes", f"{cl.frozen_share:.0%}", "GUESSED"),
    ]


def headline(
    rows: list[dict[str, Any]], handover: Sequence[dict[str, Any]] = ()
) -> dict[str, float]:
    """A few figures for bench/run.py's table (those the run has). The busy queue is the one
    measured on the replay (``busy_replay``); the guess (``busy_guess``) is kept beside it."""
    by = {(r["policy"], r["failures"], r["queue"], fmt_len(r["allocation_s"])): r for r in rows}
    out: dict[str, float] = {}
    named = (("idle", "idle"), ("busy-replay", "busy_replay"), ("busy", "busy_guess"))
    for (queue, key), length in ((q, n) for n in ("1 h", "1 d") for q in named):
        r = by.get(("no failures", "flaky", queue, length))
        if r is not None:
            out[f"no_failures_{key}_{length.replace(' ', '')}"] = r["goodput"]
    picks = (
        ("today", "busy-replay", "1 d", False),
        ("crash restart", "busy-replay", "1 h", True),
        ("N-1", "idle", "1 d", True),
        ("N-1", "busy-replay", "1 h", True),
        ("N-1 or requeue", "idle", "1 d", True),
        ("hot spare", "idle", "1 d", True),
        ("hot spare", "busy-replay", "1 d", True),
    )
    for pol, queue, length, ratio in picks:
        r, today = by.get((pol, "flaky", queue, length)), by.get(("today", "flaky", queue, length))
        if r is None or today is None:
            continue
        q = queue.replace("-", "_")
        name = f"{pol.replace(' ', '_').replace('-', '')}_flaky_{q}_{length.replace(' ', '')}"
        out[f"{name}_vs_today" if ratio else name] = (
            r["goodput"] / today["goodput"] if ratio else r["goodput"]
        )
    for h in handover:
        if h["failures"] == "none" and h["queue"] in ("idle", "busy-replay"):
            q, length = h["queue"].replace("-", "_"), fmt_len(h["allocation_s"]).replace(" ", "")
            out[f"successor_vs_requeue_{q}_{length}"] = h["successor_vs_requeue"]
            out[f"successor_early_vs_requeue_{q}_{length}"] = h["successor_early_vs_requeue"]
    for pol in ("today", "hot spare"):
        r = by.get((pol, "flaky", "busy-replay", "1 d"))
        if r is not None and r["hours_lost_per_failure"] is not None:
            key = f"minutes_per_failure_{pol.replace(' ', '_')}_flaky_busy_replay_1d"
            out[key] = 60 * r["hours_lost_per_failure"]
    return out


GUESS, MEASURED = "busy", "busy-replay"


def guess_vs_replay(
    rows: list[dict[str, Any]], queues: Sequence[QueueWait]
) -> list[dict[str, Any]]:
    """The guessed busy queue beside the one measured on the replay, per failure set, length and
    policy (no failures, today): how far the guess was off. [] unless the run had both."""
    means = {q.name: q.mean for q in queues}
    if GUESS not in means or MEASURED not in means:
        return []
    by = {(r["policy"], r["failures"], r["queue"], r["allocation_s"]): r for r in rows}
    out = []
    first = rows[0]["failures"]  # the run without failures is the same under every failure set
    for pol, failures, queue, length in by:
        if queue != MEASURED or pol not in ("no failures", "today"):
            continue
        if pol == "no failures" and failures != first:
            continue
        guess, measured = by[(pol, failures, GUESS, length)], by[(pol, failures, queue, length)]
        out.append(
            {
                "policy": pol,
                "failures": failures,
                "allocation_s": length,
                "mean_wait_guess_s": means[GUESS],
                "mean_wait_replay_s": means[MEASURED],
                "goodput_guess": guess["goodput"],
                "goodput_replay": measured["goodput"],
                "replay_vs_guess": measured["goodput"] / guess["goodput"],
            }
        )
    return out


def print_guess_vs_replay(comparison: list[dict[str, Any]]) -> None:
    if not comparison:
        return
    c0 = comparison[0]
    print_table(
        f"the busy queue: GUESSED (lognormal, mean wait {c0['mean_wait_guess_s'] / MINUTE:.1f} "
        f"min) vs MEASURED on the replay (mean wait {c0['mean_wait_replay_s'] / MINUTE:.1f} min)",
        ["failures", "allocation", "policy", "goodput, guess", "goodput, replay", "replay / guess"],
        [
            [
                c["failures"],
                fmt_len(c["allocation_s"]),
                c["policy"],
                f"{c['goodput_guess'] * 100:.1f}%",
                f"{c['goodput_replay'] * 100:.1f}%",
                f"{c['replay_vs_guess']:.3f}x",
            ]
            for c in comparison
        ],
    )


def chart(srows: list[dict[str, Any]], nodes: int, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart (pip install matplotlib)")
        return None
    lengths = list(dict.fromkeys(r["allocation_s"] for r in srows))
    queues = list(dict.fromkeys(r["queue"] for r in srows))
    fig, axes = plt.subplots(
        len(lengths), len(queues), figsize=(5.5 * len(queues), 3.8 * len(lengths)), squeeze=False
    )
    for (i, length), (j, queue) in ((a, b) for a in enumerate(lengths) for b in enumerate(queues)):
        ax = axes[i][j]
        sel = [r for r in srows if (r["allocation_s"], r["queue"]) == (length, queue)]
        for pol in POLICIES:
            pts = [r for r in sel if r["policy"] == pol.name]
            xs = [r["node_mtbf_s"] * HARDWARE_SHARE / DAY for r in pts]
            style = {"linestyle": "--", "color": "0.45"} if not pol.failures else {"marker": "o"}
            ax.plot(xs, [r["goodput"] * 100 for r in pts], label=pol.name, **style)
        ax.set_xscale("log")
        ax.set_title(f"{fmt_len(length)} allocations, queue '{queue}'", fontsize=10)
        ax.set_xlabel("per-node MTBF, any interruption (days; Llama 3: 264)")
        ax.set_ylabel("goodput, % of wall time")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"A {srows[0].get('nodes', NODES)}-node job: goodput under failures, by recovery policy"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def _arg(parse: Any) -> Any:
    """An argparse type from a parser that raises ValueError with its own message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _lengths(text: str) -> tuple[float, ...]:
    out = tuple(parse_human_duration(x) for x in text.split(","))
    if not all(x >= 10 * MINUTE for x in out):
        raise ValueError(f"--allocations {text!r}: each must be >= 10 minutes (1h, 24h, 1d)")
    return out


def _quantiles(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(","))
    except ValueError:
        out = ()
    if not out or not all(0 <= q <= 1 for q in out):
        raise ValueError(f"--early-quantiles {text!r}: give numbers in 0..1, e.g. 0.5,0.75,1")
    return out


def _profile(text: str) -> Scenario:
    for sc in SCENARIOS:
        if sc.name.split(",")[0] == text:
            return sc
    names = ", ".join(sc.name.split(",")[0] for sc in SCENARIOS)
    raise ValueError(f"--profile {text!r}: pick one of {names}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    quick_env = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    ap.add_argument("--quick", action="store_true", default=quick_env, help="a smoke run")
    ap.add_argument("--trials", type=int, default=None, help="jobs per cell (default 8)")
    ap.add_argument("--days", type=float, default=None, help="days of each job (default 365)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=_arg(_profile), default=SCENARIOS[1], help="8b or 1b")
    ap.add_argument(
        "--checkpoint-every",
        type=_arg(parse_human_duration),
        default=None,
        help="periodic saves every this much training (default: the profile's, 30m)",
    )
    ap.add_argument("--nodes", type=int, default=NODES)
    ap.add_argument("--min-nodes", type=int, default=None, help="default: nodes / 2")
    ap.add_argument("--allocations", type=_arg(_lengths), default=ALLOCATIONS, help="1h,24h")
    ap.add_argument("--queue", type=_arg(parse_queue), action="append", help=QUEUE_HELP)
    ap.add_argument("--failures", type=_arg(parse_failures), action="append", help=FAILURES_HELP)
    for name, default in (("cred-expire", CRED_EXPIRE), ("slurmd-timeout", SLURMD_TIMEOUT)):
        ap.add_argument(f"--{name}", type=_arg(parse_human_duration), default=default)
    ap.add_argument("--kill-wait", type=_arg(parse_human_duration), default=KILL_WAIT)
    ap.add_argument("--frozen-share", type=float, default=FROZEN_SHARE)
    ap.add_argument("--no-sweep", action="store_true", help="skip goodput vs MTBF (the chart)")
    ap.add_argument(
        "--early-quantiles",
        type=_arg(_quantiles),
        default=(),
        help="also compare successor-early leads at these quantiles of the chain's waits "
        "(0.5,0.75,1; slurmclock plans at the median)",
    )
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args(argv)
    args.trials = (2 if args.quick else 8) if args.trials is None else args.trials
    args.days = (20.0 if args.quick else 365.0) if args.days is None else args.days
    if args.trials < 1 or not args.days > 0:
        ap.error("--trials must be >= 1 and --days > 0")
    try:
        args.queue = args.queue or [parse_queue(q) for q in DEFAULT_QUEUES]
    except ValueError as e:
        ap.error(str(e))
    args.failures = args.failures or [FAILURE_PRESETS["llama3"], FAILURE_PRESETS["flaky"]]
    try:
        if args.checkpoint_every is not None:
            args.profile = replace(args.profile, periodic_every=args.checkpoint_every)
        args.cluster = Cluster(
            nodes=args.nodes,
            min_nodes=args.min_nodes or max(1, args.nodes // 2),
            queue=args.queue[0],
            failures=args.failures[0],
            cred_expire=args.cred_expire,
            slurmd_timeout=args.slurmd_timeout,
            kill_wait=args.kill_wait,
            frozen_share=args.frozen_share,
        )
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    pool, phase_pool = (8, 2) if args.quick else (200, 16)
    jobs = [
        Job(args.profile, args.nodes, length, pool=pool, phase_pool=phase_pool, seed=args.seed)
        for length in args.allocations
    ]
    run = {"days": args.days, "trials": args.trials, "seed": args.seed}
    rows = study(args.cluster, args.queue, args.failures, jobs, **run)
    handovers = handover_study(args.cluster, args.queue, args.failures[0], jobs, rows, **run)
    leads = []
    if args.early_quantiles:
        leads = lead_study(args.cluster, args.queue, jobs, rows, args.early_quantiles, **run)
    t1 = time.perf_counter()
    srows = []
    if not args.no_sweep:
        mtbfs = SWEEP_MTBF_DAYS[1::2] if args.quick else SWEEP_MTBF_DAYS
        srows = sweep(args.cluster, args.queue, jobs, rows, mtbf_days=mtbfs, **run)
    t2 = time.perf_counter()
    params = parameters(args.cluster, jobs[0], args.queue, args.failures)
    print_parameters(params)
    print_goodput(rows, args.nodes, 1)
    print_costs(rows)
    comparison = guess_vs_replay(rows, args.queue)
    print_guess_vs_replay(comparison)
    print_handover(handovers)
    if leads:
        print_table(
            "successor-early, no failures: the lead at a quantile of the chain's waits (+ 60 s; "
            "slurmclock plans at the median, 0.5)",
            ["queue", "allocation", "quantile", "goodput", "vs requeue", "allocations a day"],
            [
                [
                    r["queue"],
                    fmt_len(r["allocation_s"]),
                    f"{r['quantile']:g}",
                    f"{r['goodput'] * 100:.1f}%",
                    f"{r['vs_requeue']:.3f}x",
                    f"{r['allocations_per_day']:.1f}",
                ]
                for r in leads
            ],
        )
    head = headline(rows, handovers)
    if head:  # only for the preset queues and failures
        print_table("headline", ["figure", "value"], [[k, f"{v:.4f}"] for k, v in head.items()])
    print(f"simulated in {t1 - t0:.1f} s (table) + {t2 - t1:.1f} s (MTBF sweep)")
    write_results(
        "simulate_cluster",
        {
            "headline": head,
            "busy_guess_vs_replay": comparison,
            "handover": handovers,
            "early_leads": leads,
            "parameters": params,
            "policies": [asdict(p) for p in POLICIES],
            "profile": asdict(jobs[0].base),
            **run,
            "goodput": rows,
            "sweep": srows,
        },
        out,
    )
    if srows:
        chart(srows, args.nodes, out / "simulate_cluster.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
