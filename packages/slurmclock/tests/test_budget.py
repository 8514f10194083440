"""TimeBudget: robust estimates, the exact stop rule, explanations, no deadline."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmclock import BudgetConfig, Deadline, DeadlineWatcher, Decision, StopSignals, TimeBudget


def budget_at(clock: Any, left: float, **kw: Any) -> TimeBudget:
    return TimeBudget(Deadline(clock.now + left, "override"), clock=clock, **kw)


def test_decision_truthiness_and_aliases() -> None:
    yes, no = Decision(True, "r", 1.0), Decision(False, "r", None)
    assert yes and not no
    assert yes.stop and yes.ok and not no.stop and not no.ok
    with pytest.raises(AttributeError):
        yes.yes = False  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"margin": -1}, "margin must be a number of seconds >= 0"),
        ({"margin": float("nan")}, "margin"),
        ({"initial_save_estimate": "60"}, "initial_save_estimate"),
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
        ({"step_window": 0}, "step_window must be an integer >= 1"),
        ({"save_window": 1.5}, "save_window"),
        ({"step_quantile": 0}, r"step_quantile must be in \(0, 1\]"),
        ({"step_quantile": 1.5}, "step_quantile"),
    ],
)
def test_bad_config_says_how_to_fix_it(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BudgetConfig(**kw)
    with pytest.raises(ValueError, match=message):
        TimeBudget(None, **kw)


def test_bad_deadline_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="DeadlineWatcher, a Deadline or None"):
        TimeBudget(3600)  # type: ignore[arg-type]


def test_without_a_deadline_it_never_stops_for_time(clock: Any) -> None:
    for budget in (
        TimeBudget(None, clock=clock),
        TimeBudget(Deadline(None, "squeue"), clock=clock),
    ):
        budget.record_step(1e6)
        d = budget.should_stop()
        assert not d and d.seconds_left is None
        assert "no deadline" in d.reason and "never stops for time" in d.reason
        assert budget.can_save()
        assert budget.seconds_left() is None


def test_stops_exactly_when_left_is_below_step_plus_save_plus_margin(clock: Any) -> None:
    budget = budget_at(clock, 1000.0, margin=30.0, warmup_steps=0)
    budget.record_step(10.0)
    budget.record_save(20.0)
    assert budget.needed_to_stop() == 60.0
    clock.advance(1000 - 60)  # exactly 60 s left: enough
    d = budget.should_stop()
    assert not d and d.seconds_left == 60.0 and d.needed == 60.0
    clock.advance(0.001)  # a hair less: stop
    d = budget.should_stop()
    assert d and d.needed == 60.0
    assert d.reason.startswith("stop: 59.9 s left < 60.0 s needed = next step 10.0 s")
    assert "final save 20.0 s (max of last 1 saves)" in d.reason and "margin 30.0 s" in d.reason


def test_before_any_save_the_initial_guess_is_used_and_said(clock: Any) -> None:
    budget = budget_at(clock, 100.0, margin=10.0, initial_save_estimate=95.0)
    d = budget.should_stop()
    assert d and d.needed == 105.0
    assert "initial guess, no save measured yet" in d.reason
    assert budget.save_estimate is None and budget.step_estimate is None
    budget.record_save(5.0)
    assert not budget.should_stop()
    assert budget.save_estimate == 5.0


def test_warmup_steps_do_not_inflate_the_estimate(clock: Any) -> None:
    budget = budget_at(clock, 3600.0, warmup_steps=2)
    assert budget.step_estimate is None
    budget.record_step(120.0)  # torch.compile
    assert budget.step_estimate == 120.0  # only warm-up so far: conservative
    budget.record_step(15.0)  # recompilation
    assert budget.step_estimate == 15.0
    for _ in range(10):
        budget.record_step(1.0)
    assert budget.step_estimate == 1.0  # not 120, as a running max would say for ever
    assert "p90 of last 10 steps" in budget.should_stop().reason


def test_step_estimate_is_a_high_quantile_of_a_moving_window(clock: Any) -> None:
    budget = budget_at(clock, 3600.0, warmup_steps=0, step_window=20, step_quantile=0.9)
    for i in range(20):
        budget.record_step(2.0 if i % 10 == 0 else 1.0)  # 10 % slow steps (eval, GC)
    assert budget.step_estimate == 1.0  # p90 of 18x1.0 and 2x2.0
    budget.record_step(2.0)
    budget.record_step(2.0)  # now 3 slow in the last 20
    assert budget.step_estimate == 2.0
    for _ in range(20):
        budget.record_step(3.0)  # the run got slower: the window follows
    assert budget.step_estimate == 3.0


def test_save_estimate_is_the_longest_recent_save(clock: Any) -> None:
    budget = budget_at(clock, 3600.0, save_window=3)
    for seconds in (50.0, 10.0, 12.0):
        budget.record_save(seconds)
    assert budget.save_estimate == 50.0
    budget.record_save(11.0)  # the slow first save (directory creation, ...) ages out
    assert budget.save_estimate == 12.0
    assert budget.saves_measured == 4


def test_can_save_checks_save_plus_margin(clock: Any) -> None:
    budget = budget_at(clock, 100.0, margin=20.0)
    budget.record_save(80.0)
    d = budget.can_save()
    assert d and d.needed == 100.0 and "save fits: 100.0 s left >= 100.0 s" in d.reason
    clock.advance(1)
    d = budget.can_save()
    assert not d and d.reason.startswith("no time to save: 99.0 s left < 100.0 s")


def test_context_managers_measure_with_the_timer(clock: Any) -> None:
    budget = budget_at(clock, 3600.0, warmup_steps=0)
    with budget.step():
        clock.advance(2.5)
    with budget.save():
        clock.advance(7.0)
    assert budget.step_estimate == 2.5 and budget.save_estimate == 7.0
    with pytest.raises(RuntimeError), budget.step():
        clock.advance(100)
        raise RuntimeError("a failed step is not a measurement")
    assert budget.step_estimate == 2.5 and budget.steps_measured == 1


def test_bad_measurements_are_ignored_with_a_warning(
    clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    budget = budget_at(clock, 3600.0)
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        budget.record_step(-1.0)
        budget.record_save(float("nan"))
    assert budget.steps_measured == 0 and budget.saves_measured == 0
    assert "ignoring step duration -1.0" in caplog.text


def test_a_stop_signal_stops_at_once(clock: Any) -> None:
    flag = StopSignals(("USR2",))  # not installed: request() raises the same flag
    budget = TimeBudget(None, signals=flag, clock=clock)
    assert not budget.should_stop()
    flag.request("SIGUSR2")
    d = budget.should_stop()
    assert d and d.reason == "stop: received SIGUSR2"
    assert budget.snapshot()["stop_signal"] == "SIGUSR2"


def test_a_watcher_is_re_polled_and_its_clock_used(clock: Any, fakes: Any) -> None:
    end = [clock.now + 100]
    runner = fakes.Runner(squeue=lambda argv: f"{fakes.iso(end[0])} 10:00")
    watcher = DeadlineWatcher(env={"SLURM_JOB_ID": "7"}, runner=runner, clock=clock)
    budget = TimeBudget(watcher, margin=10.0, initial_save_estimate=10.0)  # clock from watcher
    clock.advance(85)
    assert budget.should_stop()  # 15 s left < 20 s
    end[0] += 600  # the admin extends the job
    clock.advance(60)
    assert not budget.should_stop()  # re-polled: 555 s left
    assert budget.seconds_left() == pytest.approx(555.0)
    assert runner.count("squeue") == 2


def test_snapshot_is_json_ready(clock: Any) -> None:
    budget = budget_at(clock, 500.0)
    budget.record_step(1.0)
    snap = json.loads(json.dumps(budget.snapshot()))
    assert snap["seconds_left"] == 500.0 and snap["deadline_source"] == "override"
    assert snap["step_estimate"] == 1.0 and snap["save_estimate"] is None
    assert snap["needed_to_stop"] == 1.0 + 60.0 + 60.0


@settings(max_examples=200, deadline=None)
@given(
    step=st.floats(0.05, 30.0),
    compile_step=st.floats(0.0, 300.0),
    save=st.floats(0.1, 120.0),
    jitter=st.lists(st.floats(0.0, 1.0), min_size=50, max_size=50),
    limit=st.floats(60.0, 4 * 3600.0),
    periodic=st.integers(5, 200),
)
def test_simulated_run_saves_before_the_deadline_and_wastes_little(
    step: float,
    compile_step: float,
    save: float,
    jitter: list[float],
    limit: float,
    periodic: int,
) -> None:
    """A training loop on a fake clock: step times vary by up to +-10 %, saves by up to +-10 %.

    With the margin covering that variation, the final save always ends before the deadline,
    and the time left unused is at most the estimated step + one save + the margin. Periodic
    saves only start when can_save() says they fit; one at the stopping step is the final one.
    """
    now = [0.0]
    margin = 0.25 * (step + save) + 1.0  # covers +-10 % around an estimate: 22 %
    budget = TimeBudget(
        Deadline(limit, "override"),
        margin=margin,
        initial_save_estimate=1.2 * save,
        clock=lambda: now[0],
    )
    i = 0
    final_end = None
    step_estimate = 0.0
    while True:
        j = jitter[i % len(jitter)]
        with budget.step():
            now[0] += compile_step if i == 0 else step * (0.9 + 0.2 * j)
        i += 1
        saved = i % periodic == 0 and bool(budget.can_save())
        if saved:
            with budget.save():
                now[0] += save * (0.9 + 0.2 * j)
        if budget.should_stop():
            step_estimate = budget.step_estimate or 0.0
            if not saved:  # a periodic save of this very step is the final checkpoint
                with budget.save():
                    now[0] += save * (0.9 + 0.2 * (1 - j))
            final_end = now[0]
            break
        assert i < 10_000_000
    if compile_step + 1.2 * save + margin <= limit:  # the first step itself fit
        assert final_end <= limit, budget.snapshot()
        # Unused: at most what the budget reserved (its step estimate is the compile step's
        # duration while only warm-up steps are measured: conservative, never optimistic).
        assert limit - final_end <= step_estimate + 1.2 * save + margin + 1e-9


def simulate(
    limit: float, should_stop: Any, budget: TimeBudget, now: list[float]
) -> tuple[int, float]:
    """1 s steps after a 90 s compile step, a 30 s save every 500 steps; returns (steps, unused)."""
    steps = 0
    while True:
        with budget.step():
            now[0] += 90.0 if steps == 0 else 1.0
        steps += 1
        saved = steps % 500 == 0
        if saved:
            with budget.save():
                now[0] += 30.0
        if should_stop():
            if not saved:
                now[0] += 30.0
            return steps, limit - now[0]


def test_uses_more_of_the_allocation_than_the_original_rule() -> None:
    """The original PyRecover stopped when left < 6 x slowest step + 2 x slowest save: the 90 s
    compile step alone made it stop 10 minutes early, every job."""
    limit = 3600.0
    now = [0.0]
    ours = TimeBudget(Deadline(limit, "override"), margin=60.0, clock=lambda: now[0])
    steps, unused = simulate(limit, ours.should_stop, ours, now)

    now[0] = 0.0
    clock = TimeBudget(None, clock=lambda: now[0])  # only the timing harness
    slowest_step = 90.0  # the compile step: the running max never forgets it
    their_steps, their_unused = simulate(
        limit, lambda: limit - now[0] < 6 * slowest_step + 2 * 30.0, clock, now
    )
    assert 0 <= unused <= 1.0 + 30.0 + 60.0  # next step + save + margin at most
    assert their_unused > 500  # ~9 minutes of a 1 h job thrown away
    assert steps > their_steps + 400
