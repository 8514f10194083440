"""TimeBudget: robust estimates, the measured stop rule, warning signals, remembered state."""

from __future__ import annotations

import json
import logging
import math
import random
import statistics
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmclock import (
    AnyFlag,
    BudgetConfig,
    Deadline,
    DeadlineWatcher,
    Decision,
    ExtraSave,
    JobTimeline,
    SaveTail,
    SignalMeaning,
    StopSignals,
    TimeBudget,
    signal_lead_from_env,
)

NO_ENV: dict[str, str] = {}  # no PYRECOVER_SIGNAL_LEAD from the developer's shell


def budget_at(clock: Any, left: float, **kw: Any) -> TimeBudget:
    kw.setdefault("env", NO_ENV)
    return TimeBudget(Deadline(clock.now + left, "override"), clock=clock, **kw)


def test_decision_truthiness_aliases_and_cause() -> None:
    yes, no = Decision(True, "r", 1.0, cause="time"), Decision(False, "r", None)
    assert yes and not no
    assert yes.stop and yes.ok and not no.stop and not no.ok
    assert yes.cause == "time" and no.cause is None
    with pytest.raises(AttributeError):
        yes.yes = False  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"margin": -1}, "margin must be a finite number of seconds >= 0, got -1"),
        ({"margin": float("nan")}, "margin must be a finite number"),
        ({"margin": float("inf")}, "margin must be a finite number"),
        ({"initial_save_estimate": "60"}, "initial_save_estimate must be a finite number"),
        ({"initial_step_estimate": float("nan")}, "initial_step_estimate"),
        ({"initial_exit_estimate": -0.5}, "initial_exit_estimate"),
        ({"slack": float("inf")}, "slack must be a finite number"),
        ({"signal_lead": float("nan")}, "signal_lead must be a finite number"),
        ({"signal_jitter": -1}, "signal_jitter"),
        ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
        ({"step_window": 0}, "step_window must be an integer >= 1"),
        ({"save_window": 1.5}, "save_window"),
        ({"exit_window": True}, "exit_window"),
        ({"step_quantile": 0}, r"step_quantile must be in \(0, 1\]"),
        ({"step_quantile": float("nan")}, "step_quantile"),
        ({"save_quantile": 1.0}, r"save_quantile must be in \[0.5, 1\)"),
        ({"save_quantile": float("nan")}, "save_quantile"),
        ({"warning_signals": "USR2"}, "warning_signals is a tuple of names"),
    ],
)
def test_bad_config_is_one_line_that_says_how_to_fix_it(kw: dict[str, Any], message: str) -> None:
    for make in (lambda: BudgetConfig(**kw), lambda: TimeBudget(None, env=NO_ENV, **kw)):
        with pytest.raises(ValueError, match=message) as e:
            make()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"quantile": 1.0}, r"quantile must be in \[0.5, 1\)"),
        ({"quantile": math.nan}, "quantile"),
        ({"prior_spread": math.inf}, "prior_spread must be a finite number >= 0"),
        ({"prior_weight": 0}, "prior_weight must be a finite number > 0"),
    ],
)
def test_bad_save_tail_settings_are_refused(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SaveTail(**kw)


def test_bad_deadline_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="DeadlineWatcher, a Deadline or None"):
        TimeBudget(3600)  # type: ignore[arg-type]


def test_without_a_deadline_it_never_stops_for_time(clock: Any) -> None:
    for budget in (
        TimeBudget(None, clock=clock, env=NO_ENV),
        TimeBudget(Deadline(None, "squeue"), clock=clock, env=NO_ENV),
    ):
        budget.record_step(1e6)
        d = budget.should_stop()
        assert not d and d.seconds_left is None and d.cause is None
        assert "no deadline" in d.reason and "never stops for time" in d.reason
        assert budget.can_save()
        assert budget.seconds_left() is None


def test_stops_exactly_when_left_is_below_step_save_exit_and_slack(clock: Any) -> None:
    budget = budget_at(clock, 1000.0, warmup_steps=0, slack=5.0, initial_exit_estimate=7.0)
    budget.record_step(10.0)
    budget.record_save(20.0)
    save = budget.save_estimate
    assert save is not None and 120.0 < save < 160.0  # one save: a wide bound (6.9x)
    needed = 10.0 + save + 7.0 + 5.0
    assert budget.needed_to_stop() == pytest.approx(needed)
    clock.advance(1000 - needed - 1e-4)  # what is needed is left: enough
    d = budget.should_stop()
    assert not d and d.needed == pytest.approx(needed)
    clock.advance(2e-4)  # a hair less: stop, for time
    d = budget.should_stop()
    assert d and d.cause == "time"
    assert (
        d.reason.startswith("stop: ") and " s needed = next step 10.0 s (p90 of last 1" in d.reason
    )
    assert "final save " in d.reason and "(p99.5 bound of 1 saves, median 20.0 s" in d.reason
    assert "exit 7.00 s (initial guess, none measured) + slack 5.00 s" in d.reason


def test_margin_overrides_exit_and_slack(clock: Any) -> None:
    budget = budget_at(clock, 1000.0, margin=30.0, warmup_steps=0)
    budget.record_step(10.0)
    budget.record_save(20.0)
    assert budget.needed_to_stop() == pytest.approx(10.0 + (budget.save_estimate or 0) + 30.0)
    reason = budget.should_stop().reason
    assert reason.endswith("+ margin 30.0 s") and "exit" not in reason and "slack" not in reason


def test_initial_estimates_stand_in_until_measured(clock: Any) -> None:
    budget = budget_at(
        clock,
        90.0,
        initial_step_estimate=4.0,
        initial_save_estimate=70.0,
        initial_exit_estimate=12.0,
        slack=5.0,
    )
    d = budget.should_stop()
    assert d and d.needed == 4.0 + 70.0 + 12.0 + 5.0
    assert "next step 4.00 s (initial guess)" in d.reason
    assert "final save 70.0 s (initial guess, no save measured yet)" in d.reason
    assert budget.save_estimate is None and budget.step_estimate is None
    assert budget.exit_estimate is None
    budget.record_save(5.0)
    assert not budget.should_stop()


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


def test_steady_cheap_saves_need_seconds_not_a_minute(clock: Any) -> None:
    budget = budget_at(clock, 3600.0)
    rng = random.Random(1)
    for _ in range(20):
        budget.record_save(10.0 * (1 + 0.02 * rng.uniform(-1, 1)))
    bound = budget.save_estimate
    assert bound is not None and 10.2 < bound < 15.0  # the prior (x1.35, worth 4 saves) fades
    exit_and_slack = 5.0 + 2.0  # initial exit guess + slack: 7 s, not a 60 s margin
    assert budget.needed_to_stop() < bound + exit_and_slack + 0.01


def test_save_bound_grows_with_the_measured_spread() -> None:
    rng = random.Random(7)
    bounds = {}
    for sigma in (0.02, 0.25, 0.5):
        tail = SaveTail()
        for _ in range(20):
            tail.add(90.0 * math.exp(sigma * rng.gauss(0, 1)))
        bounds[sigma] = tail.value
    # x1.02 leans on the prior (x1.35 worth 4 saves), x1.65 gets ~3.6x its median
    assert bounds[0.02] < 135 < bounds[0.25] < 250 < bounds[0.5]  # type: ignore[operator]


@pytest.mark.parametrize("sigma", [0.05, 0.25, 0.5])
def test_save_bound_covers_the_next_save_but_rarely_fails(sigma: float) -> None:
    """The bound is a 99.5 % prediction bound: over many fits of 20 log-normal saves the next
    save exceeds it about 0.5 % of the time; the max of the last 5 (the old rule) fails ~17 %."""
    rng = random.Random(11)
    over = over_max5 = 0
    trials = 4000
    for _ in range(trials):
        saves = [math.exp(sigma * rng.gauss(0, 1)) for _ in range(21)]
        tail = SaveTail()
        for x in saves[:20]:
            tail.add(x)
        over += saves[20] > (tail.value or 0)
        over_max5 += saves[20] > max(saves[15:20])
    assert over / trials < 0.012
    assert over_max5 / trials > 0.12


def test_background_saves_do_not_inflate_the_final_save_bound() -> None:
    """An async save, timed until durable, shares the machine with training and takes longer
    than the final save: kept apart, it leaves the final save's bound near the blocking saves'
    own, where mixing both kinds into one fit gives a bound above the slower kind."""
    rng = random.Random(3)
    tail, mixed = SaveTail(), SaveTail()
    for _ in range(20):
        blocking, background = (m * math.exp(0.1 * rng.gauss(0, 1)) for m in (10.0, 25.0))
        tail.add(blocking)
        tail.add(background, background=True)
        mixed.add(blocking)
        mixed.add(background)
    final, periodic = tail.bound(), tail.bound(background=True)
    assert final is not None and periodic is not None and mixed.value is not None
    assert 10.5 < final < 15.0 < 26.0 < periodic < 37.0
    assert mixed.value > periodic  # the old way: one fit of both kinds
    assert tail.value == final and tail.samples and tail.background_samples
    assert "20 blocking saves (spread pooled with 20 background), median 9.8" in tail.describe()
    assert "20 background saves (spread pooled with 20 blocking), median 2" in tail.describe(
        background=True
    )


def test_the_spread_is_pooled_around_each_kinds_own_median() -> None:
    tail = SaveTail(prior_spread=0.2, prior_weight=4.0)
    for x in (10.0, 10.0, 10.0):
        tail.add(x)
        tail.add(3 * x, background=True)
    # Each kind is steady around its own median: only the prior's spread is left, over
    # (3 - 1) + (3 - 1) + 4 degrees of freedom.
    assert tail.fit() == pytest.approx((10.0, math.sqrt(4 * 0.2**2 / 8)))
    assert tail.fit(background=True) == pytest.approx((30.0, math.sqrt(4 * 0.2**2 / 8)))


def test_a_kind_without_samples_borrows_the_other_kinds_median() -> None:
    tail = SaveTail()
    assert tail.bound() is None and tail.bound(background=True) is None
    for x in (20.0, 22.0, 21.0):
        tail.add(x, background=True)
    assert tail.bound() == tail.bound(background=True)  # conservative: async saves are slower
    assert "3 background saves (no blocking one yet)" in tail.describe()
    tail.add(8.0)
    assert tail.bound() is not None and tail.bound() < tail.bound(background=True)  # type: ignore[operator]


def test_the_final_bound_stays_calibrated_beside_slower_background_saves() -> None:
    """A 99.5 % prediction bound with two kinds: over many fits of 20 blocking + 20 background
    log-normal saves (medians 90 s and 130 s, the same spread) the next blocking save exceeds
    the final save's bound about 0.5 % of the time."""
    rng = random.Random(5)
    over, trials = 0, 3000
    for _ in range(trials):
        tail = SaveTail()
        for _ in range(20):
            tail.add(90.0 * math.exp(0.5 * rng.gauss(0, 1)))
            tail.add(130.0 * math.exp(0.5 * rng.gauss(0, 1)), background=True)
        over += 90.0 * math.exp(0.5 * rng.gauss(0, 1)) > (tail.bound() or 0)
    assert over / trials < 0.012


def test_can_save_in_the_background_keeps_the_stop_free(clock: Any) -> None:
    """A background save must be durable before the stop comes due, or the final save would
    wait for it: it needs its own bound on top of everything should_stop() keeps free."""
    budget = budget_at(clock, 1000.0, margin=10.0, warmup_steps=0)
    budget.record_step(1.0)
    budget.record_save(100.0)
    budget.record_save(200.0, background=True)
    blocking = budget.can_save()
    background = budget.can_save(background=True)
    bg_bound = budget.background_save_estimate
    assert bg_bound is not None and bg_bound > (budget.save_estimate or 0)
    assert background.needed == pytest.approx(bg_bound + budget.needed_to_stop())
    assert blocking.needed == pytest.approx((budget.save_estimate or 0) + 10.0)
    assert "background save" in background.reason and "then the stop: next step" in (
        background.reason
    )
    clock.advance(1000.0 - background.needed + 0.01)  # too late for a background save ...
    assert not budget.can_save(background=True)
    assert budget.can_save()  # ... a blocking one still fits
    assert not budget.should_stop()


def extra_budget(clock: Any, left: float, saves: list[float], **kw: Any) -> TimeBudget:
    budget = budget_at(clock, left, warmup_steps=0, **kw)
    for _ in range(10):
        budget.record_step(2.0)
    for x in saves:
        budget.record_save(x)
    budget.record_exit(8.0, job="1", restart=0)
    return budget


SCATTERED = [90.0 * math.exp(0.5 * z) for z in (-1.2, -0.6, -0.3, 0.0, 0.1, 0.4, 0.7, 1.3)]


def test_an_extra_save_maximizes_the_training_it_expects_to_keep(clock: Any) -> None:
    """Room r until the exit must begin; train x, then save: kept x with chance F(r - x)."""
    budget = extra_budget(clock, 260.0, SCATTERED)
    plan = budget.extra_save()
    assert isinstance(plan, ExtraSave)
    exit_bound = budget.exit_estimate
    assert exit_bound == pytest.approx(10.0)
    assert plan.abandon_at == pytest.approx(clock.now + 260.0 - 1.5 * exit_bound - 5.0)
    room = plan.abandon_at - clock.now
    tail = SaveTail()
    for x in SCATTERED:
        tail.add(x)
    median, spread = tail.fit() or (0.0, 0.0)
    sigma = spread * math.sqrt(1 + 1 / len(SCATTERED))
    normal = statistics.NormalDist()

    def kept(x: float) -> float:
        return x * normal.cdf((math.log(room - x) - math.log(median)) / sigma)

    x = plan.train_until - clock.now
    assert x % 2.0 == pytest.approx(0.0) and 0 < x < room  # whole steps
    assert plan.expected_gain == pytest.approx(kept(x))
    assert plan.expected_gain >= max(kept(k * 2.0) for k in range(1, int(room // 2)))
    assert 0.3 < plan.chance < 0.95 and plan.chance == pytest.approx(kept(x) / x)
    assert "extra save: train" in plan.reason and "else abandoned" in plan.reason
    # The chance is that of the fitted save distribution: a sample of it agrees.
    rng = random.Random(7)
    draws = [median * math.exp(sigma * rng.gauss(0, 1)) for _ in range(4000)]
    assert sum(d <= room - x for d in draws) / 4000 == pytest.approx(plan.chance, abs=0.03)
    assert plan.step_fits(clock.now, x) and not plan.step_fits(clock.now, x + 0.01)


def test_after_an_extra_save_the_next_plan_has_less_room_and_ends(clock: Any) -> None:
    budget = extra_budget(clock, 400.0, SCATTERED)
    gains = []
    while (plan := budget.extra_save()) is not None:
        gains.append(plan.expected_gain)
        clock.now = plan.train_until + 60.0  # trained, and a quick save was durable
        assert clock.now < plan.abandon_at
    assert len(gains) >= 2 and gains == sorted(gains, reverse=True)


def test_no_extra_save_without_room_deadline_save_or_on_a_stop_signal(clock: Any) -> None:
    assert extra_budget(clock, 60.0, SCATTERED).extra_save() is None  # no room for a save
    tiny = extra_budget(clock, 18.0, [0.05] * 5)
    assert tiny.extra_save() is None  # room 3 s, a step 2 s: under one step plus min_gain
    assert extra_budget(clock, 40.0, [0.05] * 5).extra_save() is not None
    assert extra_budget(clock, 300.0, []).extra_save() is None  # no save measured
    nodeadline = TimeBudget(None, clock=clock, env=NO_ENV)
    nodeadline.record_save(1.0)
    nodeadline.record_step(1.0)
    assert nodeadline.extra_save() is None
    flag = StopSignals(("TERM",), clock=clock)
    budget = extra_budget(clock, 300.0, SCATTERED, signals=flag)
    assert budget.extra_save() is not None
    flag.request("SIGTERM")  # preemption, scancel: the exit now, nothing more
    assert budget.extra_save() is None


def test_an_extra_save_with_a_margin_keeps_the_margin(clock: Any) -> None:
    budget = extra_budget(clock, 300.0, SCATTERED, margin=30.0)
    plan = budget.extra_save()
    assert plan is not None and plan.abandon_at == pytest.approx(clock.now + 270.0)
    assert budget.extra_save(min_gain=1e6) is None


def test_background_saves_travel_in_the_state_and_old_states_read_as_blocking(
    clock: Any,
) -> None:
    budget = budget_at(clock, 3600.0)
    for x in (10.0, 11.0):
        budget.record_save(x)
    for x in (30.0, 33.0, 31.0):
        budget.record_save(x, background=True)
    state = json.loads(json.dumps(budget.state_dict()))
    assert state["saves"] == [10.0, 11.0] and state["background_saves"] == [30.0, 33.0, 31.0]
    nxt = budget_at(clock, 3600.0)
    nxt.load_state_dict(state)
    assert nxt.save_estimate == pytest.approx(budget.save_estimate)
    assert nxt.background_save_estimate == pytest.approx(budget.background_save_estimate)
    old = budget_at(clock, 3600.0)  # a state from before the kinds: every save as blocking
    old.load_state_dict({"version": 1, "saves": [10.0, 30.0], "exits": []})
    assert old.background_save_estimate == old.save_estimate
    with pytest.raises(ValueError, match=r"background_saves\[0\] must be a finite number"):
        old.load_state_dict({"version": 1, "background_saves": [-1.0]})


def test_exit_times_come_from_the_timeline_and_are_remembered(tmp_path: Path, clock: Any) -> None:
    def timeline(restart: int) -> JobTimeline:
        env = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": str(restart)}
        return JobTimeline(directory=tmp_path, env=env, clock=clock)

    for restart, exit_s in ((0, 3.0), (1, 4.0)):
        t = timeline(restart)
        t.mark("saved")
        clock.advance(exit_s / 2)
        t.mark("exited", rc=75)
        clock.advance(exit_s / 2)
        t.mark("requeued")
        clock.advance(100)
    budget = budget_at(clock, 3600.0, timeline=timeline(2), slack=5.0)
    assert budget.exit_estimate == pytest.approx(1.25 * 4.0)
    assert "exit 5.00 s (1.25 x max of 2 measured) + slack 5.00 s" in budget.should_stop().reason
    with budget.save(final=True):
        clock.advance(2.0)
    last = timeline(2).events()[-1]
    assert last.name == "saved" and last.restart == 2 and last.info["seconds"] == 2.0
    # An extra save after the final one moves the exit's start; it is not a save sample.
    saves = budget.saves_measured
    clock.advance(30.0)
    budget.extra_saved(1.5)
    assert budget.saves_measured == saves
    clock.advance(30.0)
    budget.extra_abandoned(123)
    clock.advance(4.5)
    timeline(2).mark("requeued")
    marks = [e for e in timeline(2).events() if e.name == "saved" and e.restart == 2]
    assert [m.info.get("extra") for m in marks] == [None, True, None]
    assert marks[-1].info["abandoned"] == 123
    assert timeline(3).exit_samples()[-1].seconds == pytest.approx(4.5)  # from the last one

    state = json.loads(json.dumps(budget.state_dict()))
    assert state["exits"] == [
        {"job": "77", "restart": 0, "seconds": pytest.approx(3.0)},
        {"job": "77", "restart": 1, "seconds": pytest.approx(4.0)},
    ]
    fresh = budget_at(clock, 3600.0)  # another job of the same experiment: from the checkpoint
    fresh.load_state_dict(state)
    assert fresh.exit_estimate == pytest.approx(5.0)


def test_state_dict_round_trip_starts_the_next_allocation_from_measured_numbers(
    clock: Any,
) -> None:
    budget = budget_at(clock, 3600.0, warmup_steps=1)
    for x in (60.0, 0.3, 0.31, 0.29, 0.3):
        budget.record_step(x)
    for x in (10.0, 11.0, 9.0):
        budget.record_save(x)
    budget.record_exit(4.0, job="1", restart=0)
    state = json.loads(json.dumps(budget.state_dict()))
    assert state["version"] == 1 and state["steps"] == [0.3, 0.31, 0.29, 0.3]

    nxt = budget_at(clock, 3600.0, warmup_steps=1)
    nxt.load_state_dict(state)
    assert nxt.save_estimate == pytest.approx(budget.save_estimate)
    assert nxt.exit_estimate == budget.exit_estimate == 5.0
    assert nxt.step_estimate == 0.31  # the earlier steps stand in ...
    assert "p90 of 4 steps of earlier runs" in nxt.should_stop().reason
    nxt.record_step(45.0)  # ... through this run's warm-up (compile) step ...
    assert nxt.step_estimate == 0.31
    nxt.record_step(0.5)  # ... until this run has its own
    assert nxt.step_estimate == 0.5
    nxt.load_state_dict({})  # nothing to load: no change
    assert nxt.step_estimate == 0.5


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"version": 1, "saves": [1.0, float("nan")]}, r"saves\[1\] must be a finite number"),
        ({"version": 1, "steps": [-1.0]}, r"steps\[0\] must be a finite number of seconds >= 0"),
        ({"version": 1, "steps": "0.3"}, "steps must be a list"),
        ({"version": 1, "exits": [{"job": "1", "seconds": 2}]}, r"exits\[0\] must be"),
        ({"version": 1, "exits": [{"job": "1", "restart": "x", "seconds": 2}]}, "restart must"),
        ({"version": 1, "exits": [{"job": "1", "restart": 0, "seconds": math.inf}]}, "seconds"),
        ({"version": 99}, "version 99 is not one this slurmclock reads"),
        ({"steps": [1.0]}, "version None"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_a_malformed_state_is_refused_in_one_line_and_nothing_is_loaded(
    clock: Any, state: Any, message: str
) -> None:
    budget = budget_at(clock, 3600.0)
    budget.record_save(5.0)
    before = budget.state_dict()
    with pytest.raises(ValueError, match=message) as e:
        budget.load_state_dict(state)
    assert "\n" not in str(e.value)
    assert budget.state_dict() == before


def test_can_save_checks_save_exit_and_slack(clock: Any) -> None:
    budget = budget_at(clock, 400.0, margin=20.0)
    budget.record_save(40.0)
    needed = (budget.save_estimate or 0) + 20.0
    clock.advance(400 - needed - 1e-6)
    d = budget.can_save()
    assert d and d.needed == pytest.approx(needed) and d.reason.startswith("save fits: ")
    clock.advance(0.01)
    d = budget.can_save()
    assert not d and d.reason.startswith("no time to save: ")


def test_context_managers_measure_with_the_timer(clock: Any) -> None:
    budget = budget_at(clock, 3600.0, warmup_steps=0)
    with budget.step():
        clock.advance(2.5)
    with budget.save():
        clock.advance(7.0)
    assert budget.step_estimate == 2.5 and budget.saves_measured == 1
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
        budget.record_exit(float("inf"))
    assert budget.steps_measured == 0 and budget.saves_measured == 0
    assert budget.exit_estimate is None
    assert "ignoring step duration -1.0" in caplog.text


# -- signals ------------------------------------------------------------------------------------


def signal_budget(clock: Any, end: float | None, lead: float | None, **kw: Any) -> Any:
    flag = StopSignals(("USR2", "TERM", "INT"), clock=clock)  # not installed: request() = arrival
    deadline = None if end is None else Deadline(end, "squeue", "9")
    budget = TimeBudget(
        deadline, signals=flag, signal_lead=lead, clock=clock, env=NO_ENV, slack=5.0, **kw
    )
    budget.record_step(1.0)
    budget.record_save(10.0)
    return budget, flag


def test_a_warning_that_agrees_with_the_deadline_changes_nothing(clock: Any) -> None:
    end = clock.now + 3600
    budget, flag = signal_budget(clock, end, 300.0)
    twin, _ = signal_budget(clock, end, 300.0)  # the same budget without the signal
    clock.now = end - 300 - 25  # SLURM sends it up to 30 s early
    flag.request("SIGUSR2")
    d = budget.should_stop()
    assert not d and d.cause is None and budget.deadline() == Deadline(end, "squeue", "9")
    while not twin.should_stop():
        assert not budget.should_stop()  # not before its own budget says so
        clock.advance(1.0)
    d = budget.should_stop()
    assert d and d.cause == "time" and d.reason.startswith("stop: ")
    assert d.seconds_left is not None and d.seconds_left < d.needed


def test_without_a_deadline_the_warning_bounds_it(clock: Any) -> None:
    budget, flag = signal_budget(clock, None, 120.0)
    assert not budget.should_stop() and budget.deadline() is None
    t0 = clock.now
    flag.request("SIGUSR2")
    d = budget.deadline()
    assert d is not None and d.end == t0 + 120.0 and d.source == "signal"
    decision = budget.should_stop()
    assert not decision and "(deadline: SIGUSR2 + lead 120.0 s)" in decision.reason
    clock.advance(120.0 - decision.needed + 0.01)
    d2 = budget.should_stop()
    assert d2 and d2.cause == "time"


def test_a_warning_earlier_than_the_deadline_wins_with_one_warning(
    clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    end = clock.now + 3600
    budget, flag = signal_budget(clock, end, 300.0)
    flag.request("SIGUSR2")  # 3600 s before the end, but the lead says 300
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        d = budget.deadline()
        budget.should_stop()
    assert d is not None and d.end == clock.now + 300.0 and d.source == "signal"
    assert caplog.text.count("export PYRECOVER_SIGNAL_LEAD=LEAD") == 1


def test_a_warning_with_an_unknown_lead_stops_at_once(clock: Any) -> None:
    budget, flag = signal_budget(clock, clock.now + 3600, None)
    flag.request("SIGUSR2")
    d = budget.should_stop()
    assert d and d.cause == "signal" and d.reason == "stop: received SIGUSR2; 3600 s left"


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "manual"])
def test_term_int_and_requests_stop_at_once_even_with_a_lead(clock: Any, name: str) -> None:
    budget, flag = signal_budget(clock, clock.now + 3600, 300.0)
    flag.request("SIGUSR2")
    assert not budget.should_stop()
    flag.request(name)
    d = budget.should_stop()
    assert d and d.cause == "signal" and d.reason.startswith(f"stop: received {name}")


def test_a_warning_makes_the_watcher_ask_slurm_again(clock: Any, fakes: Any) -> None:
    end = [clock.now + 3600]
    runner = fakes.Runner(squeue=lambda argv: f"{fakes.iso(end[0])} 1:00:00")
    watcher = DeadlineWatcher(
        env={"SLURM_JOB_ID": "7"}, runner=runner, clock=clock, poll_interval=600
    )
    flag = StopSignals(("USR2",), clock=clock)
    budget = TimeBudget(watcher, signals=flag, signal_lead=300.0, env=NO_ENV)
    budget.should_stop()
    assert runner.count("squeue") == 1
    end[0] = clock.now + 200  # preemption: SLURM moved the end time earlier
    flag.request("SIGUSR2")
    budget.should_stop()
    budget.should_stop()
    assert runner.count("squeue") == 2  # once for the news, not once per step
    assert budget.seconds_left() == pytest.approx(200.0)


def test_the_lead_comes_from_the_environment(clock: Any, caplog: pytest.LogCaptureFixture) -> None:
    assert signal_lead_from_env({"PYRECOVER_SIGNAL_LEAD": "300"}) == 300.0
    assert signal_lead_from_env({"PYRECOVER_SIGNAL_LEAD": "5m"}) == 300.0
    assert signal_lead_from_env({}) is None
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        assert signal_lead_from_env({"PYRECOVER_SIGNAL_LEAD": "soon"}) is None
    assert "ignoring PYRECOVER_SIGNAL_LEAD" in caplog.text
    budget = TimeBudget(None, clock=clock, env={"PYRECOVER_SIGNAL_LEAD": "90"})
    assert budget.config.signal_lead == 90.0 and budget.snapshot()["signal_lead"] == 90.0


def test_several_flags_read_as_one(clock: Any) -> None:
    slurm = StopSignals(("USR2", "TERM"), clock=clock)
    ctrl_c = StopSignals(("INT",), clock=clock)
    flag = AnyFlag(slurm, ctrl_c)
    budget = TimeBudget(
        Deadline(clock.now + 3600, "squeue"), signals=flag, signal_lead=300.0, env=NO_ENV
    )
    assert not flag.requested and flag.received is None
    clock.now += 3600 - 310
    slurm.request("SIGUSR2")
    assert flag.requested and flag.received == "SIGUSR2" and not budget.should_stop()
    clock.advance(1)
    ctrl_c.request("SIGINT")
    assert [a[0] for a in flag.arrivals] == ["SIGUSR2", "SIGINT"]
    d = budget.should_stop()
    assert d and d.reason.startswith("stop: received SIGINT")
    with pytest.raises(ValueError, match="at least one flag"):
        AnyFlag()


def test_any_stop_flag_with_arrivals_is_read_as_one(clock: Any) -> None:
    """A stop-signal source of one's own (here: a file to watch) is a StopFlag: requested,
    received and arrivals. Combined with SLURM's signals, a TERM after the USR2 warning still
    stops at once, and the warning stays information."""

    class StopFile:
        def __init__(self) -> None:
            self.arrivals: list[tuple[str, float]] = []

        requested = property(lambda self: bool(self.arrivals))
        received = property(lambda self: self.arrivals[0][0] if self.arrivals else None)

    slurm, stop_file = StopSignals(("USR2", "TERM"), clock=clock), StopFile()
    flag = AnyFlag(slurm, stop_file)
    budget = TimeBudget(
        Deadline(clock.now + 3600, "squeue"), signals=flag, signal_lead=3600.0, env=NO_ENV,
        clock=clock,
    )  # fmt: skip
    slurm.request("SIGUSR2")
    assert not budget.should_stop()
    stop_file.arrivals.append(("stop file", clock.now))
    assert budget.should_stop().reason.startswith("stop: received stop file")
    with pytest.raises(TypeError, match="raises the first flag"):
        AnyFlag(stop_file, slurm).request()


def test_a_flag_without_arrivals_is_refused_in_one_line(clock: Any) -> None:
    class Plain:
        requested = True
        received = "SIGUSR2"

    with pytest.raises(TypeError, match="requested, received and arrivals"):
        TimeBudget(None, signals=Plain(), signal_lead=60.0, clock=clock, env=NO_ENV)  # type: ignore[arg-type]


def test_what_a_signal_means_is_slurmclocks(clock: Any) -> None:
    flag = StopSignals(("USR2", "TERM"), clock=clock)
    flag.request("SIGUSR2")
    known, unknown = SignalMeaning(300.0), SignalMeaning(None)
    assert known.stop_now(flag) is None and unknown.stop_now(flag) == "SIGUSR2"
    assert SignalMeaning.from_env({"PYRECOVER_SIGNAL_LEAD": "5m"}).lead == 300.0
    assert "warning 300 s before the end" in known.describe()
    assert "SIGUSR2 stops at once" in unknown.describe()
    budget = TimeBudget(Deadline(clock.now + 60, "x"), signals=flag, signal_lead=300.0, env=NO_ENV)
    assert budget.describe_rule() == (
        "stop when left < next step + final save + exit (not measured yet) + 2 s slack; "
        + known.describe()
    )


def test_snapshot_is_json_ready(clock: Any) -> None:
    budget = budget_at(clock, 500.0)
    budget.record_step(1.0)
    snap = json.loads(json.dumps(budget.snapshot()))
    assert snap["seconds_left"] == 500.0 and snap["deadline_source"] == "override"
    assert snap["step_estimate"] == 1.0 and snap["save_estimate"] is None
    assert snap["needed_to_stop"] == 1.0 + 60.0 + 5.0 + 2.0  # step, save guess, exit guess, slack
    assert snap["margin"] is None and snap["exit_estimate"] is None


# -- whole runs on a fake clock -----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    step=st.floats(0.05, 30.0),
    compile_step=st.floats(0.0, 300.0),
    save=st.floats(0.1, 120.0),
    exit_s=st.floats(0.5, 30.0),
    jitter=st.lists(st.floats(0.0, 1.0), min_size=50, max_size=50),
    limit=st.floats(60.0, 4 * 3600.0),
    periodic=st.integers(5, 200),
)
def test_simulated_run_saves_and_exits_before_the_deadline_and_wastes_little(
    step: float,
    compile_step: float,
    save: float,
    exit_s: float,
    jitter: list[float],
    limit: float,
    periodic: int,
) -> None:
    """A training loop on a fake clock with the default settings: steps and saves vary by up to
    +-10 %; the exit after the final save was measured by earlier runs (+-10 %).

    The final save and the exit always end before the deadline, and the time left unused is at
    most what the budget reserved. Periodic saves only start when can_save() says they fit; one
    at the stopping step is the final one.
    """
    now = [0.0]
    budget = TimeBudget(
        Deadline(limit, "override"),
        initial_save_estimate=1.2 * save,
        clock=lambda: now[0],
        env=NO_ENV,
    )
    for k in range(3):
        budget.record_exit(exit_s * (0.9 + 0.1 * k), job="j", restart=k)
    i = 0
    reserved = 0.0
    while True:
        j = jitter[i % len(jitter)]
        with budget.step():
            now[0] += compile_step if i == 0 else step * (0.9 + 0.2 * j)
        i += 1
        saved = i % periodic == 0 and bool(budget.can_save())
        if saved:
            with budget.save():
                now[0] += save * (0.9 + 0.2 * j)
        decision = budget.should_stop()
        if decision:
            reserved = decision.needed or 0.0
            if not saved:  # a periodic save of this very step is the final checkpoint
                with budget.save(final=True):
                    now[0] += save * (0.9 + 0.2 * (1 - j))
            end = now[0] + exit_s * (0.9 + 0.2 * j)
            break
        assert i < 10_000_000
    if compile_step + 1.2 * save + 1.1 * exit_s + 10.0 + 5.0 <= limit:  # the first step fit
        assert end <= limit, budget.snapshot()
        assert limit - end <= reserved + 1e-9


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


def test_uses_more_of_the_allocation_than_the_original_rule_and_the_fixed_margin() -> None:
    """The original PyRecover stopped when left < 6 x slowest step + 2 x slowest save: the 90 s
    compile step alone made it stop 10 minutes early, every job. slurmclock 0.1's fixed 60 s
    margin cost a minute of every allocation; the measured exit costs seconds."""
    limit = 3600.0
    now = [0.0]
    ours = TimeBudget(Deadline(limit, "override"), clock=lambda: now[0], env=NO_ENV)
    ours.record_exit(2.0, job="j", restart=0)  # measured by an earlier allocation
    steps, unused = simulate(limit, ours.should_stop, ours, now)

    now[0] = 0.0
    fixed = TimeBudget(Deadline(limit, "override"), margin=60.0, clock=lambda: now[0], env=NO_ENV)
    fixed_steps, fixed_unused = simulate(limit, fixed.should_stop, fixed, now)

    now[0] = 0.0
    clock = TimeBudget(None, clock=lambda: now[0], env=NO_ENV)  # only the timing harness
    slowest_step = 90.0  # the compile step: the running max never forgets it
    their_steps, their_unused = simulate(
        limit, lambda: limit - now[0] < 6 * slowest_step + 2 * 30.0, clock, now
    )
    assert 0 <= unused <= 1.0 + 45.0 + 2.5 + 5.0  # step + save bound + exit bound + slack
    assert fixed_unused > unused + 50
    assert their_unused > 500  # ~9 minutes of a 1 h job thrown away
    assert steps > fixed_steps + 50 > their_steps + 400
