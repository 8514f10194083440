"""A successor already waiting (``slurmclock supervise --successor-early``, supervisor/handover):
when it is submitted (planned from the chain's waits), the refusal fallback, the kept or
cancelled successor, the hand-over on SIGUSR1, and the successor's bounded wait for its
predecessor -- a fake SLURM (runner) and a fake clock; the real SLURM case is in
test_successor.py (it shares that module's cluster)."""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from slurmclock import CommandError
from slurmclock.commands import Runner
from slurmclock.supervisor.config import SuperviseConfig
from slurmclock.supervisor.handover import (
    HANDOVER_MAX_S,
    KEEP_WAITS,
    KILL_S,
    LEAD_S,
    PREDECESSOR,
    WAITS,
    Waiter,
    await_predecessor,
    chain_waits,
    handover_bound,
    own_times,
    plan_submit,
)
from slurmclock.supervisor.supervise import Supervisor

# -- when: planned from the chain's waits ----------------------------------------------------


@pytest.mark.parametrize(
    ("waits", "at", "said"),
    [
        ([], 1000 + 1800, "at half of the allocation"),  # a 1 h allocation from t=1000
        ([120.0], 4600 - 120 - LEAD_S, "median wait in the queue is 120 s"),
        ([100.0, 3000.0, 200.0], 4600 - 200 - LEAD_S, "is 200 s (of 3)"),  # one outlier
        ([0.0, 1.0], 4600 - 0.5 - LEAD_S, "before the end"),  # idle: just before the end
        ([9000.0], 1000, "9000 s"),  # longer than the allocation: at once
    ],
)
def test_plan_from_the_chain_waits(waits: list[float], at: float, said: str) -> None:
    got, why = plan_submit(started=1000.0, end=4600.0, waits=waits)
    assert got == pytest.approx(at) and said in why


def test_no_end_known_submits_at_the_stop() -> None:
    assert plan_submit(started=1.0, end=None, waits=[5.0])[0] is None


@pytest.mark.parametrize(
    ("raw", "waits", "bad"),
    [
        ("", [], 0),
        ("10:20.5", [10.0, 20.5], 0),
        ("10:x:-5:1e9:nan:30", [10.0, 30.0], 4),  # another job wrote it: bad items skipped
        (":".join(str(i) for i in range(20)), [float(i) for i in range(12, 20)], 0),
        ("9" * 10_000, [], 1),  # bounded: read no further than a few items
    ],
)
def test_chain_waits_are_untrusted(raw: str, waits: list[float], bad: int) -> None:
    assert chain_waits({WAITS: raw}) == (waits, bad)
    assert len(chain_waits({WAITS: raw})[0]) <= KEEP_WAITS


def _answer(text: str | BaseException) -> Runner:
    def run(argv: Sequence[str], timeout: float) -> str:
        if isinstance(text, BaseException):
            raise text
        return text

    return run


@pytest.mark.parametrize(
    ("answer", "wait"),
    [
        ("2026-11-28T10:00:00|2026-11-28T10:05:00\n", 300.0),
        ("N/A|N/A\n", None),
        ("2026-11-28T10:05:00|2026-11-28T10:00:00\n", None),  # started before it was submitted
        ("", None),
        (CommandError(["squeue"], "timeout", "timed out"), None),
    ],
)
def test_own_wait_from_squeue(answer: Any, wait: float | None) -> None:
    got = own_times("42", _answer(answer), 5.0)
    assert (None if got is None else got[1] - got[0]) == wait


# -- the supervisor, with a real step and a fake SLURM ----------------------------------------


class Slurm:
    """A fake SLURM: ``sbatch`` answers from ``sbatch`` (a list, one per call: a job id or an
    error), ``squeue -o %T`` ``state``; the step's ``scancel --signal=TERM`` calls ``on_term``."""

    def __init__(self, sbatch: list[str | BaseException], state: str = "PENDING") -> None:
        self.sbatch, self.state = sbatch, state
        self.calls: list[list[str]] = []
        self.on_term: Callable[[], None] | None = None

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        argv = list(argv)
        self.calls.append(argv)
        if argv[0] == "sbatch":
            got = self.sbatch.pop(0)
            if isinstance(got, BaseException):
                raise got
            return got
        if argv[0] == "squeue" and "%V|%S" in argv:
            return "2026-11-28T10:00:00|2026-11-28T10:00:07\n"  # waited 7 s
        if argv[0] == "squeue" and "%T" in argv:
            return self.state + "\n"
        if argv[0] == "scontrol" and argv[1:3] == ["show", "job"]:
            return "JobId=42 JobState=RUNNING Reason=None Restarts=0"
        if argv[:2] == ["scancel", "--signal=TERM"] and self.on_term is not None:
            self.on_term()
        return ""

    def said(self, word: str) -> list[list[str]]:
        return [c for c in self.calls if c[0] == word]


def _supervisor(tmp_path: Path, slurm: Slurm, waits: str = "100000") -> Supervisor:
    env = {
        "PATH": os.environ["PATH"],
        "SLURM_JOB_ID": "42",
        "SLURMCLOCK_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": "n1",
        "PYRECOVER_END_TIME": str(time.time() + 3600),
        WAITS: waits,  # a long wait: the successor is due at once
    }
    config = SuperviseConfig(successor=("-t", "60", "job.sh"), successor_early=True)
    return Supervisor(config, env=env, runner=slurm, out=io.StringIO(), here="n1")


def _log(sup: Supervisor) -> str:
    assert isinstance(sup.out, io.StringIO)
    return sup.out.getvalue()


# The step: waits until the supervisor has submitted its successor (its sbatch is in the log
# the test gives it), then does what ``then`` says.
STEP = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))  # "saves" and stops
end = time.time() + 30
while time.time() < end and not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
{then}
"""


def _step(tmp_path: Path, then: str) -> list[str]:
    return [sys.executable, "-c", STEP.format(then=then), str(tmp_path / "submitted")]


class Fake(Slurm):
    """:class:`Slurm` whose sbatch answers come one by one and flag the step to go on."""

    def __init__(self, tmp_path: Path, answers: list[str | BaseException], state: str) -> None:
        super().__init__([], state)
        self.flag, self.answers = tmp_path / "submitted", answers

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        if argv[0] == "sbatch":
            self.calls.append(list(argv))
            got = self.answers.pop(0)
            self.flag.touch()
            if isinstance(got, BaseException):
                raise got
            return got
        return super().__call__(argv, timeout)


def test_finished_training_cancels_the_waiting_successor(tmp_path: Path) -> None:
    slurm = Fake(tmp_path, ["77\n"], "PENDING")
    sup = _supervisor(tmp_path, slurm)
    assert sup.run(_step(tmp_path, "sys.exit(0)")) == 0
    (early,) = slurm.said("sbatch")
    assert not any(a.startswith("--dependency") for a in early)  # it pends, no dependency
    export = next(a for a in early if a.startswith("--export="))
    assert f"{PREDECESSOR}=42" in export and f"{WAITS}=100000:7" in export  # this job's 7 s
    assert ["scancel", "77"] in slurm.calls
    log = _log(sup)
    assert "submitted job 77 now: it waits in the queue while this job trains" in log
    assert "cancelled job 77, the successor submitted early" in log


def test_a_stop_first_keeps_the_waiting_successor(tmp_path: Path) -> None:
    slurm = Fake(tmp_path, ["77\n"], "PENDING")
    sup = _supervisor(tmp_path, slurm)
    assert sup.run(_step(tmp_path, "sys.exit(75)")) == 0
    assert len(slurm.said("sbatch")) == 1 and ["scancel", "77"] not in slurm.calls
    log = _log(sup)
    assert "stopped early with steps left: handing the run to a successor job" in log
    assert "job 77, submitted early, already waits to resume" in log
    assert "requeueing" not in log  # the words match what happens


@pytest.mark.parametrize(
    "refusal",
    [
        "sbatch: error: QOSMaxSubmitJobPerUserLimit",
        "sbatch: error: AssocMaxSubmitJobLimit",
        "sbatch: error: Batch job submission failed: Invalid account",
    ],
)
def test_a_refused_early_submission_falls_back_to_the_stop(tmp_path: Path, refusal: str) -> None:
    no = CommandError(["sbatch"], "failed", "exit 1", returncode=1, stderr=f"{refusal}\n")
    slurm = Fake(tmp_path, [no, "78\n"], "PENDING")
    sup = _supervisor(tmp_path, slurm)
    assert sup.run(_step(tmp_path, "sys.exit(75)")) == 0
    early, late = slurm.said("sbatch")
    assert "--dependency=afterany:42" in late and "--dependency=afterany:42" not in early
    log = _log(sup)
    (line,) = [ln for ln in log.splitlines() if "could not submit the successor early" in ln]
    assert refusal in line and "submitted at the stop instead" in line
    assert "submitted job 78 to resume after job 42 ends" in log


def test_the_successor_started_this_job_hands_over(tmp_path: Path) -> None:
    slurm = Fake(tmp_path, ["77\n"], "RUNNING")
    sup = _supervisor(tmp_path, slurm)
    step = _step(tmp_path, "os.kill(os.getppid(), signal.SIGUSR1)\ntime.sleep(30)\nsys.exit(3)")
    procs: list[Any] = []
    slurm.on_term = lambda: os.kill(procs[0].pid, 15)  # SLURM passes "save and stop" on
    original = sup._launch

    def launch(argv: Sequence[str]) -> Any:
        got = original(argv)
        procs.append(got.proc if got is not None else None)
        return got

    sup._launch = launch  # type: ignore[method-assign]
    began = time.monotonic()
    assert sup.run(step) == 0
    assert time.monotonic() - began < 20  # not the step's 30 s: it saved and stopped at once
    log = _log(sup)
    assert "job 77, the successor, started: saving and handing over" in log
    assert "handed over to job 77" in log
    assert ["scancel", "77"] not in slurm.calls and len(slurm.said("sbatch")) == 1


def test_slurmclock_stop_cancels_the_waiting_successor(tmp_path: Path) -> None:
    slurm = Fake(tmp_path, ["77\n"], "PENDING")
    sup = _supervisor(tmp_path, slurm)
    step = _step(tmp_path, "os.kill(os.getppid(), signal.SIGTERM)\ntime.sleep(30)\nsys.exit(3)")
    procs: list[Any] = []
    slurm.on_term = lambda: os.kill(procs[0].pid, 15)
    original = sup._launch

    def launch(argv: Sequence[str]) -> Any:
        got = original(argv)
        procs.append(got.proc if got is not None else None)
        return got

    sup._launch = launch  # type: ignore[method-assign]
    assert sup.run(step) == 0
    assert ["scancel", "77"] in slurm.calls
    assert "stopped on request" in _log(sup)


def test_early_needs_a_successor() -> None:
    with pytest.raises(ValueError, match="successor_early needs a successor"):
        SuperviseConfig(successor_early=True)


# -- the successor's wait for its predecessor -------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += max(s, 0.01)


class Predecessor:
    """``squeue -o %T`` of the predecessor: its states over (fake) time; ``gone_after_cancel``:
    it ends once scancel'd."""

    def __init__(self, clock: Clock, holds_for: float, gone_after_cancel: bool = True) -> None:
        self.clock, self.holds_for, self.after = clock, holds_for, gone_after_cancel
        self.calls: list[list[str]] = []
        self.cancelled = False

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        self.calls.append(list(argv))
        if list(argv) == ["scancel", "41"]:
            self.cancelled = True
        if argv[0] != "squeue":
            return ""
        if self.clock() >= self.holds_for or (self.cancelled and self.after):
            raise CommandError(argv, "failed", "x", returncode=1, stderr="Invalid job id specified")
        return "RUNNING\n" if self.clock() < self.holds_for - 2 else "COMPLETING\n"


@pytest.mark.parametrize(
    ("holds_for", "after_cancel", "code", "cancelled", "said"),
    [
        (0.0, True, None, False, ""),  # ended already: nothing to ask
        (5.0, True, None, False, "ended 5"),  # saved and ended within seconds
        (1e9, True, None, True, "cancelled it"),  # never ends by itself: cancelled
        (1e9, False, 1, True, "rather than hold two allocations"),  # not even then
    ],
)
def test_the_successor_waits_bounded(
    holds_for: float, after_cancel: bool, code: int | None, cancelled: bool, said: str
) -> None:
    clock, lines = Clock(), []  # type: Clock, list[str]
    pred = Predecessor(clock, holds_for, after_cancel)
    w = Waiter(pred, clock, clock.sleep, lines.append, lambda: False, 5.0)
    bound = 40.0
    assert await_predecessor("41", bound, w) == code
    assert pred.cancelled == cancelled
    # Two allocations held no longer than the hand-over bound (+ the cancel's KillWait).
    assert clock.t <= bound + KILL_S + 1.0
    assert said in " ".join(lines)
    asked = [c for c in pred.calls if c[:3] == ["scancel", "--batch", "--signal=USR1"]]
    assert len(asked) == (0 if holds_for == 0 else 1)


def test_a_stop_ends_the_wait_at_once() -> None:
    clock, lines = Clock(), []  # type: Clock, list[str]
    w = Waiter(Predecessor(clock, 1e9), clock, clock.sleep, lines.append, lambda: clock.t > 3, 5.0)
    assert await_predecessor("41", 100.0, w) is None
    assert clock.t < 5 and not any("ended" in ln for ln in lines)


def test_squeue_errors_are_retried_within_the_bound() -> None:
    clock, lines = Clock(), []  # type: Clock, list[str]

    def run(argv: Sequence[str], timeout: float) -> str:
        if argv[0] == "squeue":
            raise CommandError(argv, "timeout", "squeue timed out")
        return ""

    w = Waiter(run, clock, clock.sleep, lines.append, lambda: False, 5.0)
    assert await_predecessor("41", 20.0, w) == 1  # never known to end: bounded all the same
    assert clock.t <= 20.0 + KILL_S + 1.0


@pytest.mark.parametrize(
    ("left", "bound"),
    [(None, HANDOVER_MAX_S), (3600.0, HANDOVER_MAX_S), (120.0, 30.0), (8.0, 10.0)],
)
def test_handover_bound_from_the_time_left(left: float | None, bound: float) -> None:
    assert handover_bound(left) == bound


def test_no_early_submission_once_the_allocation_ends(tmp_path: Path) -> None:
    """Due after the SIGTERM came, or after the successor was submitted at the stop: none."""
    slurm = Slurm(["77\n", "78\n"])
    sup = _supervisor(tmp_path, slurm)
    sup.early.planned, sup.early.at = True, 0.0  # due long ago
    sup.term = "limit"
    sup._early_tick()
    assert slurm.said("sbatch") == []
    sup.term = None
    assert sup._hand_over()  # the successor at the stop (nothing was submitted early)
    sup._early_tick()
    assert len(slurm.said("sbatch")) == 1 and "--dependency=afterany:42" in slurm.said("sbatch")[0]
