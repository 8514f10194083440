"""slurmclock.supervisor.history: the failure streak at one checkpoint step, a run that
vanished, the newest checkpoint -- read from timeline events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slurmclock import JobTimeline, TimeBudget
from slurmclock.supervisor.history import Streak, failure_streak, newest_checkpoint, vanished_run
from slurmclock.timeline import Event


def ev(event: str, restart: int = 0, **info: Any) -> Event:
    return Event(event, 1.0, restart, info)


def test_failure_streak_counts_failures_at_one_checkpoint() -> None:
    events = [ev("checkpoint", step=100), ev("failed", rc=1, step=100)]
    assert failure_streak(events) == Streak(1, 100, events[-1])
    events += [ev("start", 1), ev("failed", 1, rc=1, step=100), ev("failed", 2, rc=9, step=100)]
    assert failure_streak(events).count == 3
    # progress: a failure at a newer checkpoint starts again at 1
    newer = ev("failed", 3, step=200)
    assert failure_streak([*events, newer]) == Streak(1, 200, newer)
    # a clean end, or the user resuming after the chain stopped, ends the streak
    for end in (ev("exited", rc=75), ev("exited", rc=0), ev("gave_up", why="x")):
        assert failure_streak([*events, end]).count == 0
    # a crash's own exit, a limit or a preemption neither counts nor ends it
    more = [ev("exited", rc=1), ev("signal", name="TERM", kind="limit"), ev("requeued")]
    assert failure_streak([*events, *more]).count == 3


def test_before_any_checkpoint_the_step_is_none() -> None:
    assert failure_streak([ev("failed"), ev("failed")]).count == 2
    assert newest_checkpoint([ev("checkpoint", step=5), ev("checkpoint", step=7)]) == 7
    assert newest_checkpoint([ev("checkpoint", step="x"), ev("start")]) is None


def test_a_run_that_vanished() -> None:
    assert vanished_run([]) is None
    lost = ev("start", 2)
    assert vanished_run([ev("start"), ev("exited", rc=75), lost, ev("checkpoint", 2, step=9)])
    assert vanished_run([lost]) == lost
    for end in (
        ev("exited", 2, rc=137),
        ev("gave_up", 2),
        ev("signal", 2, name="TERM", kind="limit"),
        ev("signal", 2, name="TERM", kind="requeued"),
    ):
        assert vanished_run([lost, end]) is None
    # a user's stop request is not SLURM ending the run: without an exit the run vanished
    assert vanished_run([lost, ev("signal", 2, name="TERM", kind="stop")]) == lost


def test_record_save_with_a_step_marks_the_checkpoint(tmp_path: Path) -> None:
    """The contract with the trainers: a durable checkpoint is a ``checkpoint step=N`` event."""
    timeline = JobTimeline("42", directory=tmp_path, env={})
    budget = TimeBudget(timeline=timeline)
    budget.record_save(1.5, background=True, step=300)
    budget.record_save(1.5)  # no step: nothing to mark
    budget.record_save(2.0, final=True, step=400)
    marks = [(e.name, e.info.get("step")) for e in timeline.events()]
    assert marks == [("checkpoint", 300), ("checkpoint", 400), ("saved", None)]
    assert newest_checkpoint(timeline.events()) == 400
