"""How much of each allocation went into steps that persisted, read from outside the trainer:
the batch script's job log (its allocations, the trainer's resume and stop lines) and the
step events' times, against a straight run's time per step in the same seconds.

Stdlib only, so the repo session tests the arithmetic without torch or SLURM
(tests/test_allocation_use.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

GOODPUT_TARGET = 0.85  # of every non-final allocation, in persisted steps (issue 12)


@dataclass(frozen=True)
class Calibration:
    """CPU seconds of the tiny configuration on this machine, measured before anything else runs
    (one process, one thread): a lower bound of its wall time however busy the machine gets."""

    step_s: float  # per step
    startup_s: float  # of a run's fixed work: imports, data, model, exit


@dataclass
class Allocation:
    """One run of the batch script, from its log lines (local time, 1 s resolution)."""

    restart: int
    started: float
    ended: float | None = None
    status: int | None = None
    last_line: float | None = None
    trainer: list[tuple[str, int]] = field(default_factory=list)  # ("stopped at", 1234), ...

    def step_said(self, what: str, default: int | None) -> int | None:
        """The step of the trainer's last "resumed from" / "stopped at" / "finished:" line."""
        found = [step for said, step in self.trainer if said.endswith(what)]
        return found[-1] if found else default

    @property
    def held_s(self) -> float | None:
        return None if self.ended is None else self.ended - self.started + 1.0


_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] submit-training-simple: (.*)$")


def allocations(log_text: str) -> list[Allocation]:
    """Each allocation of a job from the script's own log (the job log is opened in append mode,
    so every run of a requeued job writes to the same file)."""
    out: list[Allocation] = []
    for line in log_text.splitlines():
        if (m := re.search(r"(?:resumed from|stopped at|finished:) step (\d+)", line)) and out:
            out[-1].trainer.append((line.split(" step ")[0], int(m.group(1))))
        m = _LINE.match(line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
        said = m.group(2)
        if s := re.match(r"job \S+, restart (\d+)", said):
            out.append(Allocation(int(s.group(1)), t))
            continue
        if out:
            out[-1].last_line = t
        if (s := re.match(r"training step exited with status (\d+)", said)) and out:
            out[-1].ended, out[-1].status = t, int(s.group(1))
    return out


@dataclass
class AllocationUse:
    """How much of one allocation went into steps that persisted, measured from outside: the
    steps from the job log (where the trainer resumed, where it stopped with a durable save),
    times a straight run's time per step, over the allocation's time limit. Two straight rates:
    the reference run's in the same seconds (side by side, the same load; None once it had
    finished), and the job's own steady rate in the allocation (from its step events' times:
    everything but the start-up and the stop). ``share`` takes the faster, i.e. the lower share:
    a process that happened to get less of the CPU than the other does not flatter it.

    The reference may cover only part of the allocation (it finished, or started late); the
    machine's load in the rest can differ tenfold (the other scenarios' start-ups). So the two
    are compared where both ran (``own_beside_s``: the job's rate in the reference's seconds)
    and the job's whole-allocation rate is scaled by that ratio, never by a rate from other
    seconds."""

    restart: int
    persisted_steps: int
    reference_step_s: float | None
    own_step_s: float
    limit_s: float
    held_s: float  # from the script's first log line to its last, whole seconds
    quiet: Calibration | None = None
    own_beside_s: float | None = None  # the job's rate in the reference's seconds
    startup_cpu_wait_s: float | None = None  # the kernel's: runnable, no CPU free (startup event)

    @property
    def load(self) -> float:
        """How many times slower than quiet steps ran in this allocation (>= 1)."""
        return 1.0 if self.quiet is None else max(1.0, self.step_s / self.quiet.step_s)

    @property
    def startup_allowance_s(self) -> float:
        """What a loaded machine added to this allocation's start-up, at least: the larger of two
        lower bounds. The steps' load times the start-up's calibrated CPU work (``load - 1``
        times it) misses a burst of load in the start-up's own seconds (the other scenarios'
        imports: 15x there, 5x over the steps, in one CI run); the kernel's count of the seconds
        the trainer sat runnable with no CPU free misses the launch before the process and any
        I/O. A sleep or a slow store in the start-up is neither: it gets no allowance."""
        estimate = 0.0 if self.quiet is None else (self.load - 1.0) * self.quiet.startup_s
        return max(estimate, self.startup_cpu_wait_s or 0.0)

    @property
    def target(self) -> float:
        """GOODPUT_TARGET, less :attr:`startup_allowance_s`: on a quiet machine the target
        itself; what the run controls (the stop margin, the exit) gets no allowance."""
        return GOODPUT_TARGET - self.startup_allowance_s / self.limit_s

    @property
    def step_s(self) -> float:
        if self.reference_step_s is None:
            return self.own_step_s
        beside = self.own_beside_s or self.own_step_s
        return min(self.own_step_s, self.own_step_s * self.reference_step_s / beside)

    @property
    def share(self) -> float:
        return self.persisted_steps * self.step_s / self.limit_s

    def describe(self) -> str:
        ref = "-" if self.reference_step_s is None else f"{1000 * self.reference_step_s:.1f}"
        if self.reference_step_s is not None and self.own_beside_s is not None:
            ref += f" beside own {1000 * self.own_beside_s:.1f}"
        return (
            f"allocation {self.restart}: {self.persisted_steps} steps x {1000 * self.step_s:.1f} "
            f"ms (reference {ref}, own {1000 * self.own_step_s:.1f}) / {self.limit_s:.0f} s = "
            f"{100 * self.share:.1f}% (target {100 * self.target:.1f}% at load x{self.load:.1f}"
            f"{self._waited()})"
        )

    def _waited(self) -> str:
        waited = self.startup_cpu_wait_s
        return "" if waited is None else f", start-up {waited:.1f} s waiting for a CPU"


def allocation_use(
    allocs: Sequence[Allocation],
    job_runs: Sequence[Sequence[dict[str, Any]]],
    reference: Sequence[dict[str, Any]],
    limit_s: float,
    quiet: Calibration | None = None,
) -> list[AllocationUse]:
    """:class:`AllocationUse` of each allocation (job log + each run's step events)."""
    out = []
    for alloc, run in zip(allocs, job_runs, strict=True):
        first = alloc.step_said("resumed from", 0) or 0
        last = alloc.step_said("stopped at", None)
        last = alloc.step_said("finished:", 0) if last is None else last
        window = (alloc.started, alloc.last_line or alloc.started)
        own = rate(run, None)
        assert own is not None, f"allocation {alloc.restart}: too few step events"
        ref = rate(reference, window)
        span = covered(reference, window)
        use = AllocationUse(
            alloc.restart,
            (last or 0) - first,
            ref,
            own,
            limit_s,
            window[1] - window[0] + 1.0,
            quiet,
            None if ref is None or span is None else rate(run, span, min_cover=0.0),
            _cpu_wait(run),
        )
        out.append(use)
    return out


def _cpu_wait(run: Sequence[dict[str, Any]]) -> float | None:
    """The start-up's CPU wait from a run's ``startup`` event; None from a trainer or a kernel
    that does not count it, or a value that is not a number of seconds."""
    waited = next((e.get("cpu_wait") for e in run if e["event"] == "startup"), None)
    ok = isinstance(waited, int | float) and not isinstance(waited, bool) and 0 <= waited < 1e6
    return float(waited) if ok else None


def _steps_in(
    evs: Sequence[dict[str, Any]], window: tuple[float, float] | None
) -> list[dict[str, Any]]:
    steps = [e for e in evs if e["event"] == "step"]
    if window is not None:
        steps = [e for e in steps if window[0] <= e["time"] <= window[1]]
    return steps


def rate(
    evs: Sequence[dict[str, Any]], window: tuple[float, float] | None, min_cover: float = 0.5
) -> float | None:
    """Seconds per step between the first and last step events (inside ``window``, which they
    must cover at least ``min_cover`` of); None when they do not."""
    steps = _steps_in(evs, window)
    if len(steps) < 2 or steps[-1]["step"] == steps[0]["step"]:
        return None
    span = steps[-1]["time"] - steps[0]["time"]
    if window is not None and span < min_cover * (window[1] - window[0]):
        return None
    return float(span / (steps[-1]["step"] - steps[0]["step"]))


def covered(
    evs: Sequence[dict[str, Any]], window: tuple[float, float]
) -> tuple[float, float] | None:
    """The seconds of ``window`` from the first to the last step event in it; None without two."""
    steps = _steps_in(evs, window)
    return (steps[0]["time"], steps[-1]["time"]) if len(steps) >= 2 else None
