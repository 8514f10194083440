"""Drivers and readers for the end-to-end suite.

The long scenarios (a real SLURM time limit over several allocations, preemption, a 2-task job)
are *driven* in background threads that only act and observe -- submit, signal, requeue, wait --
and return what they saw; the tests make the assertions. So the scenarios run side by side
(SLURM mostly waits: for the 30 s limit timer, for a requeue) while the CPU-bound ones run in the
foreground, and the whole session fits in CI's budget on 2 cores.

A module of its own because pytest's importlib mode does not let tests import conftest.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from train_helpers import run_cli, tiny_flags  # on sys.path via pytest's pythonpath

from pyrecover_train.metrics import read_events

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = ROOT / "apps" / "train" / "slurm" / "submit-training-simple.sh"

# The time-limit scenario's allocations: `sbatch --time=3` of the shipped script, nothing else
# changed. With the shipped defaults a trainer trains for about ALLOC_TRAIN_S of each (start-up
# and the measured stop margin take the rest), so a run of GOAL_ALLOCATIONS - 0.7 times that
# many seconds of steps needs at least GOAL_ALLOCATIONS allocations at the calibrated speed
# (slower later means more allocations, never fewer).
TIME_LIMIT_MIN = 3
ALLOC_TRAIN_S = TIME_LIMIT_MIN * 60 - 25
GOAL_ALLOCATIONS = 3
GOODPUT_TARGET = 0.85  # of every non-final allocation, in persisted steps (issue 12)
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
}


def job_env(**extra: str) -> dict[str, str]:
    """What every sbatch of the suite adds to the job's environment."""
    # One thread per process: results do not depend on how busy the shared machine is, and a
    # straight run outside SLURM computes bitwise the same numbers. PYRECOVER_END_TIME="" so an
    # override in the caller's environment cannot hide SLURM's deadline.
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYRECOVER_END_TIME": ""}
    # The script's commands (pyrecover-train, slurmclock) from this interpreter's environment,
    # also when it was not activated.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env.update(extra)
    return env


# -- metrics ------------------------------------------------------------------------------------


def events(metrics: Path) -> list[dict[str, Any]]:
    return list(read_events(metrics)) if metrics.exists() else []


def runs(metrics: Path) -> list[list[dict[str, Any]]]:
    """The events of each process start, in order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for e in events(metrics):
        out.setdefault(e["run"], []).append(e)
    return list(out.values())


def one(evs: Sequence[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [e for e in evs if e["event"] == kind]
    assert len(found) == 1, f"{len(found)} {kind!r} events in one run: {found}"
    return found[0]


def last_step(metrics: Path, *, run_index: int | None = None) -> int:
    """The highest step logged (by the run at ``run_index``, or by any run)."""
    rs = runs(metrics)
    if run_index is not None:
        rs = rs[run_index : run_index + 1] if run_index < len(rs) else []
    return max((e["step"] for r in rs for e in r if e["event"] == "step"), default=0)


def wait_until(what: str, ok: Callable[[], bool], timeout: float, poll: float = 0.2) -> None:
    end = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


@dataclass(frozen=True)
class Calibration:
    """CPU seconds of the tiny configuration on this machine, measured before anything else runs
    (one process, one thread): a lower bound of its wall time however busy the machine gets."""

    step_s: float  # per step
    startup_s: float  # of a run's fixed work: imports, data, model, exit


def calibrate(corpus: Path, cache: Path, scratch: Path) -> Calibration:
    """A run sized with ``step_s`` never takes fewer allocations than planned (a busier machine:
    more); ``startup_s`` is what a loaded machine stretches at the start of every allocation."""

    def cpu(steps: int) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = run_cli(
            tiny_flags(
                corpus,
                cache,
                scratch / str(steps),
                "--training-steps",
                str(steps),
                "--checkpoint-frequency",
                "0",
                "--log-every",
                "100",
            )
        )
        assert r.returncode == 0, r.stdout + r.stderr
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)

    # The difference of two runs: the start-up (imports, data, model) cancels out.
    short = cpu(100)
    step_s = max(1e-4, (cpu(500) - short) / 400)
    return Calibration(step_s, max(0.0, short - 100 * step_s))


# -- SLURM jobs ---------------------------------------------------------------------------------


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
    a process that happened to get less of the CPU than the other does not flatter it."""

    restart: int
    persisted_steps: int
    reference_step_s: float | None
    own_step_s: float
    limit_s: float
    held_s: float  # from the script's first log line to its last, whole seconds
    quiet: Calibration | None = None

    @property
    def load(self) -> float:
        """How many times slower than quiet steps ran in this allocation (>= 1)."""
        return 1.0 if self.quiet is None else max(1.0, self.step_s / self.quiet.step_s)

    @property
    def target(self) -> float:
        """GOODPUT_TARGET, less the time a loaded machine adds to the start-up's measured CPU
        work (``load - 1`` times it): on a quiet machine the target itself; what the run
        controls (the stop margin, the exit) gets no allowance."""
        extra = 0.0 if self.quiet is None else (self.load - 1.0) * self.quiet.startup_s
        return GOODPUT_TARGET - extra / self.limit_s

    @property
    def step_s(self) -> float:
        rates = [r for r in (self.reference_step_s, self.own_step_s) if r is not None]
        return min(rates)

    @property
    def share(self) -> float:
        return self.persisted_steps * self.step_s / self.limit_s

    def describe(self) -> str:
        ref = "-" if self.reference_step_s is None else f"{1000 * self.reference_step_s:.1f}"
        return (
            f"allocation {self.restart}: {self.persisted_steps} steps x {1000 * self.step_s:.1f} "
            f"ms (reference {ref}, own {1000 * self.own_step_s:.1f}) / {self.limit_s:.0f} s = "
            f"{100 * self.share:.1f}% (target {100 * self.target:.1f}% at load x{self.load:.1f})"
        )


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
        use = AllocationUse(
            alloc.restart,
            (last or 0) - first,
            rate(reference, window),
            own,
            limit_s,
            window[1] - window[0] + 1.0,
            quiet,
        )
        out.append(use)
    return out


def rate(evs: Sequence[dict[str, Any]], window: tuple[float, float] | None) -> float | None:
    """Seconds per step between the first and last step events (inside ``window``, which they
    must cover at least half of); None when they do not."""
    steps = [e for e in evs if e["event"] == "step"]
    if window is not None:
        steps = [e for e in steps if window[0] <= e["time"] <= window[1]]
    if len(steps) < 2 or steps[-1]["step"] == steps[0]["step"]:
        return None
    span = steps[-1]["time"] - steps[0]["time"]
    if window is not None and span < 0.5 * (window[1] - window[0]):
        return None
    return float(span / (steps[-1]["step"] - steps[0]["step"]))


@dataclass
class JobRecord:
    """What a driver saw of one sbatch job."""

    name: str
    job_id: str = ""
    info: dict[str, str] = field(default_factory=dict)
    log: str = ""
    notes: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


class Job:
    """An sbatch of the trainer's script, with its own folder, log and checkpoints."""

    def __init__(self, cluster: Any, workdir: Path, name: str) -> None:
        self.cluster, self.name = cluster, name
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ckpt = self.dir / "ckpt"
        self.id = ""

    @property
    def metrics(self) -> Path:
        return self.ckpt / self.name / "metrics.jsonl"

    def submit(
        self, sbatch_args: Sequence[str], script_args: Sequence[str], **env: str
    ) -> JobRecord:
        # The job's timeline (slurmclock's) in the scenario's folder: job ids restart at 1 with
        # every test cluster, so a shared folder would hand a job the exits of an older one.
        env = {"SLURMCLOCK_DIR": str(self.dir / "timelines"), **env}
        self.id = self.cluster.sbatch(
            SCRIPT,
            "--cpus-per-task=1",
            f"--output={self.dir}/job-%j.out",
            *sbatch_args,
            cwd=self.dir,
            env=job_env(**env),
            script_args=[f"--exp_name={self.name}", *script_args],
        )
        return JobRecord(self.name, self.id)

    def log(self, job_id: str | None = None) -> str:
        path = self.dir / f"job-{job_id or self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def state(self) -> dict[str, str]:
        info: dict[str, str] = self.cluster.job(self.id)
        return info

    def wait_done(self, timeout: float) -> dict[str, str]:
        try:
            info: dict[str, str] = self.cluster.wait_for(self.id, FINAL_STATES, timeout=timeout)
        except Exception as e:
            raise AssertionError(f"job {self.name} ({self.id}): {e}\n--- log:\n{self.log()}") from e
        return info

    def finish(self, record: JobRecord, timeout: float) -> JobRecord:
        record.info = self.wait_done(timeout)
        record.log = self.log()
        return record


def trainer_flags(
    corpus: Path, cache: Path, ckpt: Path, steps: int, every: int, *extra: str
) -> list[str]:
    return tiny_flags(
        corpus,
        cache,
        ckpt,
        "--training-steps",
        str(steps),
        "--checkpoint-frequency",
        str(every),
        "--keep-last",
        "2",
        *extra,
    )


@dataclass
class LongRuns:
    """Background work shared by the SLURM scenarios (one configuration, one reference)."""

    steps: int
    quiet: Calibration | None
    flags: list[str]
    reference: Path
    background: Background
    workdir: Path
    preempt_reference: Path | None = None


SHORT_STEPS = 300
SHORT_EVERY = 5


def short_flags(corpus: Path, cache: Path, ckpt: Path, *extra: str) -> list[str]:
    """Saves every 5 steps, a progress event every step: kills and damage land anywhere."""
    return trainer_flags(corpus, cache, ckpt, SHORT_STEPS, SHORT_EVERY, "--log-every", "1", *extra)


# -- background work ----------------------------------------------------------------------------


class Background:
    """Drivers running in threads; ``result(name)`` waits and re-raises what went wrong."""

    def __init__(self) -> None:
        self._threads: dict[str, threading.Thread] = {}
        self._results: dict[str, Any] = {}
        self._errors: dict[str, BaseException] = {}

    def start(self, name: str, fn: Callable[[], Any]) -> None:
        def run() -> None:
            t0 = time.monotonic()
            try:
                value = fn()
                if isinstance(value, JobRecord):
                    value.seconds = time.monotonic() - t0
                self._results[name] = value
            except BaseException as e:  # delivered to the test that asks for it
                self._errors[name] = e

        thread = threading.Thread(target=run, name=f"e2e-{name}", daemon=True)
        self._threads[name] = thread
        thread.start()

    def result(self, name: str, timeout: float) -> Any:
        thread = self._threads[name]
        thread.join(timeout)
        if thread.is_alive():
            raise AssertionError(f"background scenario {name!r} still running after {timeout} s")
        if name in self._errors:
            raise self._errors[name]
        return self._results[name]

    def join_all(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for thread in self._threads.values():
            thread.join(max(0.0, end - time.monotonic()))


def start_straight(args: Sequence[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """An uninterrupted reference run, in the background."""
    return subprocess.Popen(
        [sys.executable, "-m", "pyrecover_train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def iso_to_epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"
