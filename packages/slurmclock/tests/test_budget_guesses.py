"""The budget's first-run guesses and what one run leaves the next: a short job trains, one
stalled save does not stop the next runs at their first step, an own loop carries its saves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slurmclock import Deadline, JobTimeline, SaveTail, TimeBudget, TimeLoop
from slurmclock.budget import SAVE_GUESS, STALL_FACTOR

NO_ENV: dict[str, str] = {}
JOB = {"SLURM_JOB_ID": "91", "SLURM_RESTART_COUNT": "0"}


def budget_at(clock: Any, left: float, **kw: Any) -> TimeBudget:
    kw.setdefault("env", NO_ENV)
    return TimeBudget(Deadline(clock.now + left, "override"), clock=clock, **kw)


# -- one stall -------------------------------------------------------------------------------


def test_one_stalled_save_cannot_move_the_bound_by_orders_of_magnitude() -> None:
    steady, stalled = SaveTail(), SaveTail()
    for _ in range(5):
        steady.add(10.0)
        stalled.add(10.0)
    stalled.add(47_231.0)  # a store that hung (issue 34: the bound was 47,231 s after it)
    before, after = steady.bound(), stalled.bound()
    assert before is not None and after is not None
    assert after < 10 * before and after < 100


def test_a_stall_loaded_from_a_checkpoint_does_not_stop_the_next_run(clock: Any) -> None:
    first = budget_at(clock, 3600)
    for seconds in (10.0, 11.0, 9.5, 47_231.0):
        first.record_save(seconds)
    state = first.state_dict()
    assert 47_231.0 in state["saves"]  # the measurement is kept; its weight is not
    second = budget_at(clock, 600)
    second.load_state_dict(state)
    second.record_step(1.0)
    assert second.save_estimate is not None and second.save_estimate < 150  # was 47,231 s
    assert not second.should_stop()


def test_a_store_that_became_slow_for_good_is_followed() -> None:
    tail = SaveTail(window=20)
    for _ in range(10):
        tail.add(10.0)
    for _ in range(11):
        tail.add(200.0)
    bound = tail.bound()
    assert bound is not None and bound >= 200.0


def test_two_saves_of_which_one_stalled_are_bounded(clock: Any) -> None:
    tail = SaveTail()
    tail.add(10.0)
    tail.add(47_231.0)
    bound = tail.bound()
    assert bound is not None and bound < 10.0 * STALL_FACTOR * 10


# -- the first run's guesses -----------------------------------------------------------------


@pytest.mark.parametrize("left", [20.0, 40.0, 60.0, 66.0])
def test_a_short_deadline_trains_past_its_first_step(clock: Any, left: float) -> None:
    budget = budget_at(clock, left)
    budget.record_step(0.2)
    decision = budget.should_stop()
    assert not decision, decision.reason
    assert budget.needed_to_stop() < left


def test_the_save_guess_is_said_with_its_share(clock: Any) -> None:
    budget = budget_at(clock, 40.0)
    budget.record_step(0.2)
    assert "0.25 of the 40 s left" in budget.should_stop().reason or not budget.should_stop()
    assert budget.needed_to_stop() == pytest.approx(0.2 + 10.0 + 5.0 + 2.0)


def test_a_long_deadline_keeps_the_60_s_guess(clock: Any) -> None:
    budget = budget_at(clock, 3600.0)
    assert budget.needed_to_stop() == pytest.approx(SAVE_GUESS + 5.0 + 2.0)


def test_a_given_guess_is_kept_even_for_a_short_deadline(clock: Any) -> None:
    budget = budget_at(clock, 60.0, initial_save_estimate=60.0)
    budget.record_step(0.2)
    assert budget.should_stop()
    with pytest.raises(ValueError, match="initial_save_estimate"):
        TimeBudget(initial_save_estimate=-1.0)


def test_without_a_deadline_the_guess_is_60_s() -> None:
    assert TimeBudget(env=NO_ENV).needed_to_stop() == pytest.approx(SAVE_GUESS + 5.0 + 2.0)


# -- an own loop's next run ------------------------------------------------------------------


def test_saves_marked_in_the_timeline_start_the_next_run(tmp_path: Path, clock: Any) -> None:
    """A loop without pyrecover-train (no budget state in its checkpoint): its saves reach the
    job's next run through the timeline."""
    first = JobTimeline(env=JOB, directory=tmp_path)
    budget = budget_at(clock, 3600, timeline=first)
    budget.record_save(4.0, step=10)
    budget.record_save(6.0, step=20, background=True)
    budget.record_save(47_231.0, step=30)  # a stall, tamed as it is loaded
    budget.extra_saved(2.0, step=40)  # an extra save is not a sample
    again = JobTimeline(env={**JOB, "SLURM_RESTART_COUNT": "1"}, directory=tmp_path)
    second = budget_at(clock, 3600, timeline=again)
    assert second.has_save_estimate and second.saves_measured == 0
    assert second.state_dict()["saves"] == [4.0, 47_231.0]
    assert second.state_dict()["background_saves"] == [6.0]
    assert second.save_estimate is not None and second.save_estimate < 100


def test_a_checkpoints_state_replaces_the_timelines_saves(tmp_path: Path, clock: Any) -> None:
    timeline = JobTimeline(env=JOB, directory=tmp_path)
    budget_at(clock, 3600, timeline=timeline).record_save(4.0, step=10)
    later = budget_at(clock, 3600, timeline=JobTimeline(env=JOB, directory=tmp_path))
    later.record_save(5.0)  # this run's own
    later.load_state_dict({"version": 1, "saves": [3.0, 3.5]})
    assert later.state_dict()["saves"] == [3.0, 3.5, 5.0]


def test_an_own_loop_measures_its_saves_into_the_timeline(tmp_path: Path, clock: Any) -> None:
    timeline = JobTimeline(env=JOB, directory=tmp_path)
    budget = budget_at(clock, 3600, timeline=timeline)
    loop = TimeLoop(budget, watchdog=False)
    loop.saved(5, 3.25)
    (mark,) = [e for e in timeline.events() if e.name == "checkpoint"]
    assert mark.info == {
        "step": 5,
        "seconds": 3.25,
        "host": mark.info["host"],
        "pid": mark.info["pid"],
    }
