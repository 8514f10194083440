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

from allocation_use import Calibration
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
