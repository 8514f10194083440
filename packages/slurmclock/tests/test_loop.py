"""TimeLoop: the time-aware loop protocol every trainer drives -- the stop, periodic saves, extra
saves and their abandon, the exit codes, the job timeline's marks -- on a fake clock. The
watchdog's process exit is injected (a list), so an abandon is seen without ending the test."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from slurmclock import (
    EXIT_FINISHED,
    EXIT_STOPPED,
    STOP_SIGNALS,
    Action,
    Deadline,
    DeadlineWatcher,
    JobTimeline,
    StopSignals,
    TimeBudget,
    TimeLoop,
)

STEP, SAVE = 1.0, 3.0  # fake seconds of a step and of every save


class Run:
    """One process's loop on a fake clock: ``left`` seconds to a deadline, saves of SAVE s
    measured before (so extra saves can be planned), a stop flag raised by hand."""

    def __init__(self, clock: Any, tmp_path: Path, left: float, **kw: Any) -> None:
        self.clock, self.exits = clock, []  # codes the watchdog's exit was called with
        self.flag = StopSignals(STOP_SIGNALS, clock=clock)
        self.timeline = JobTimeline("7", directory=tmp_path, env={}, clock=clock)
        budget = TimeBudget(
            Deadline(clock.now + left, "override"),
            signals=self.flag,
            timeline=self.timeline,
            margin=kw.pop("margin", 2.0),
            warmup_steps=0,
            clock=clock,
            env={},
        )
        for _ in range(kw.pop("saves_before", 5)):
            budget.record_save(SAVE)
        kw.setdefault("launch", lambda: None)
        self.loop = TimeLoop(budget, exit=self.exits.append, **kw)
        self.step = 0
        self.loop.begin()

    def train(self, *, due: bool = False, last: bool = False) -> Action:
        self.clock.advance(STEP)
        self.step += 1
        return self.loop.after_step(self.step, seconds=STEP, save_due=due, last=last)

    def save(self, act: Action, seconds: float = SAVE) -> None:
        with self.loop.saving(act):
            self.clock.advance(seconds)
            self.loop.saved(self.step, seconds)

    def until_save(self, limit: int = 1000) -> Action:
        for _ in range(limit):
            act = self.train()
            if act.save or not self.loop.training:
                return act
        raise AssertionError("the loop never asked for a save")

    def events(self) -> list[tuple[str, dict[str, Any]]]:
        """The timeline after the first step's mark (test_the_first_step_is_marked_once)."""
        return [(e.name, e.info) for e in self.timeline.events() if e.name != "first_step"]


def test_the_first_step_is_marked_once(clock: Any, tmp_path: Path) -> None:
    """The start-up a restart in the allocation costs: from the supervisor's launch to here."""
    run = Run(clock, tmp_path, left=3600.0)
    for _ in range(3):
        run.train()
    marks = [(e.name, e.time, e.info["step"], e.info["seconds"]) for e in run.timeline.events()]
    assert marks == [("first_step", clock.now - 2 * STEP, 1, STEP)]
    follower = Run(clock, tmp_path / "rank1", left=3600.0, leader=False)
    follower.train()
    assert follower.timeline.events() == []  # only the leader writes


def test_one_more_final_try_fits_while_the_time_left_holds_a_save_and_the_exit(
    clock: Any, tmp_path: Path
) -> None:
    """The question a trainer whose final save failed asks before each try again."""
    run = Run(clock, tmp_path, left=60.0)
    budget = run.loop.budget
    room = run.loop.final_try_time()
    assert room is not None and budget.save_estimate is not None
    after = budget.needed_after_save()
    assert room == pytest.approx(60.0 - after - budget.save_estimate)
    clock.advance(room + 1.0)  # past it: no try fits any more
    assert run.loop.final_try_time() == pytest.approx(-1.0)
    unbounded = Run(clock, tmp_path / "none", left=60.0)
    unbounded.loop.budget.deadline = lambda: None  # type: ignore[method-assign]
    assert unbounded.loop.final_try_time() is None


def test_a_stop_for_time_saves_trains_on_saves_again_and_exits_75(
    clock: Any, tmp_path: Path
) -> None:
    run = Run(clock, tmp_path, left=60.0)
    final = run.until_save()
    assert final == Action("final", final.reason) and final.durable and run.loop.cause == "time"
    assert final.reason.startswith("stop: ") and "s needed" in final.reason
    stop_step = run.step
    run.save(final, seconds=1.0)  # well inside its bound: time left for more training
    assert run.loop.training and run.loop.plan is not None  # rank 0's plan
    extra = run.until_save()
    assert extra.save == "extra" and run.step > stop_step
    run.save(extra, seconds=1.0)
    while run.loop.training:  # plans until no extra save is worth it
        act = run.until_save()
        if act.save:
            run.save(act, seconds=1.0)
    assert (run.loop.exit_code, run.loop.stopped_early, run.exits) == (EXIT_STOPPED, True, [])
    assert run.loop.durable_step == run.step and run.loop.abandoned is None
    names = [(n, i.get("step"), i.get("extra")) for n, i in run.events()]
    assert names[:2] == [("checkpoint", stop_step, None), ("saved", None, None)]
    extras = names[2:]  # each extra save: its checkpoint, and the exit starts again after it
    assert extras and [n for n, _, _ in extras] == ["checkpoint", "saved"] * (len(extras) // 2)
    assert all(e for n, _, e in extras if n == "saved")
    # The extra saves are not save-time samples: only the final one joined the 5 before.
    assert run.loop.budget.saves_measured == 6


def test_an_extra_save_not_durable_in_time_is_abandoned_and_the_final_one_stands(
    clock: Any, tmp_path: Path
) -> None:
    said: list[str] = []
    run = Run(clock, tmp_path, left=60.0, on_abandon=said.append)
    final = run.until_save()
    run.save(final, seconds=1.0)
    kept = run.step
    extra = run.until_save()
    assert run.loop.plan is not None
    with run.loop.saving(extra):
        clock.now = run.loop.plan.abandon_at + 0.01  # the save is still writing: too late
        deadline = time.monotonic() + 10
        while not run.exits and time.monotonic() < deadline:
            time.sleep(0.01)
    assert run.exits == [EXIT_STOPPED]
    message = f"extra save of step {run.step} abandoned (the exit must begin): step {kept} is"
    assert said and said[0].startswith(message) and run.loop.abandoned == said[0]
    assert run.events()[-1] == ("saved", {**run.events()[-1][1], "abandoned": run.step})
    assert run.loop.exit_code == EXIT_STOPPED


def test_a_stop_signal_abandons_an_extra_save_at_once_and_ends_extra_training(
    clock: Any, tmp_path: Path
) -> None:
    run = Run(clock, tmp_path, left=60.0)
    run.save(run.until_save(), seconds=1.0)
    extra = run.until_save()
    with run.loop.saving(extra):
        run.flag.request("SIGTERM")
        deadline = time.monotonic() + 10
        while not run.exits and time.monotonic() < deadline:
            time.sleep(0.01)
    assert run.exits == [EXIT_STOPPED] and "(SIGTERM)" in str(run.loop.abandoned)

    run = Run(clock, tmp_path / "2", left=60.0)
    run.save(run.until_save(), seconds=1.0)
    run.train()
    run.flag.request("SIGTERM")
    act = run.train()  # no save: the final save stands, the exit comes now
    assert act.save is None and not run.loop.training
    assert run.loop.cause == "time" and run.loop.exit_code == EXIT_STOPPED
    assert "then stop: received SIGTERM" in run.loop.reason


def test_a_stop_signal_saves_once_and_exits_75_without_extra_saves(
    clock: Any, tmp_path: Path
) -> None:
    run = Run(clock, tmp_path, left=3600.0)
    assert run.train() == Action()
    run.flag.request("SIGTERM")
    act = run.train()
    assert act.save == "final" and run.loop.cause == "signal"
    assert act.reason.startswith("stop: received SIGTERM")
    run.save(act)
    assert not run.loop.training and run.loop.exit_code == EXIT_STOPPED
    assert "stopping at step 2/9 (stop: received SIGTERM" in run.loop.stop_message(2, 9)
    with pytest.raises(RuntimeError, match="after the loop ended"):
        run.train()


def test_the_last_step_saves_and_exits_0(clock: Any, tmp_path: Path) -> None:
    run = Run(clock, tmp_path, left=3600.0)
    run.train()
    act = run.train(last=True)
    assert act.save == "final"
    run.save(act)
    assert not run.loop.training and run.loop.finished
    assert (run.loop.exit_code, run.loop.stopped_early) == (EXIT_FINISHED, False)


def test_a_periodic_save_starts_only_when_it_fits(
    clock: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = Run(clock, tmp_path, left=3600.0, background_saves=True)
    assert run.train(due=True) == Action("periodic", "due")
    run.loop.saved(run.step, 9.0, background=True)  # durable later, written while training
    assert run.loop.budget.background_save_estimate is not None
    # 9.5 s left after the step: enough for the stop (step + save bound + margin), not for a
    # background save before it.
    run = Run(clock, tmp_path / "2", left=10.5, margin=1.0, background_saves=True)
    with caplog.at_level("INFO", logger="slurmclock"):
        act = run.train(due=True)
    assert act.save is None and act.reason.startswith("periodic save skipped: no time to save")
    assert "periodic save skipped" in caplog.text


def test_rank_0_decides_and_every_rank_follows(clock: Any, tmp_path: Path, fakes: Any) -> None:
    """A rank other than 0 never asks SLURM (its watcher is never polled): rank 0's stop comes
    through the agreement, rank 0's plan through ``share``, and its own signal still counts."""
    runner = fakes.Runner(squeue=lambda argv: f"{fakes.iso(clock.now + 60)} 1:00")
    watcher = DeadlineWatcher(env={"SLURM_JOB_ID": "7"}, runner=runner, clock=clock)
    rank0: list[tuple[int, ...]] = []  # what rank 0 sends to the next agreements
    plans: list[Any] = []

    def agree(*mine: int) -> tuple[int, ...]:
        theirs = rank0.pop(0) if rank0 else (0,) * len(mine)
        return tuple(max(a, b) for a, b in zip(mine, theirs, strict=True))

    flag = StopSignals(STOP_SIGNALS, clock=clock)
    budget = TimeBudget(watcher, signals=flag, warmup_steps=0, clock=clock, env={})
    loop = TimeLoop(budget, leader=False, agree=agree, share=lambda _: plans.pop(0))
    loop.begin()
    assert loop.after_step(1, seconds=1.0) == Action()
    rank0.append((1, 0, 0))  # rank 0: stop for time
    act = loop.after_step(2, seconds=1.0)
    assert act.save == "final" and loop.cause == "time"
    assert loop.reason == "another rank asked to stop"
    plans.append(None)  # rank 0 planned no extra save
    with loop.saving(act):
        pass
    assert not loop.training and loop.exit_code == EXIT_STOPPED
    assert runner.count("squeue") == 0


def test_a_probe_save_measures_the_save_time_once(clock: Any, tmp_path: Path) -> None:
    run = Run(clock, tmp_path, left=3600.0, saves_before=0, probe_saves=True)
    act = run.train()
    assert act.save == "periodic"  # no save time known: measured now, not guessed
    run.save(act)
    assert [run.train().save for _ in range(5)] == [None] * 5
    loaded = Run(clock, tmp_path / "2", left=3600.0, saves_before=1, probe_saves=True)
    assert loaded.train().save is None  # a save time is known (here: loaded)


def test_the_first_allocations_exit_is_guessed_from_its_launch(clock: Any, tmp_path: Path) -> None:
    run = Run(clock, tmp_path, left=3600.0, margin=None, launch=0.7)
    budget = run.loop.budget
    slack = budget.config.slack
    assert budget.needed_after_save() == 5.0 + slack  # the guess, until the launch is known
    run.train()
    assert budget.launch_s == 0.7
    assert budget.needed_after_save() == pytest.approx(1.0 + 2 * 0.7 + slack)
    assert "exit 2.40 s (1 + 2 x launch 0.70 s)" in budget.should_stop().reason
    budget.record_exit(3.0, job="7", restart=0)  # measured: the launch no longer matters
    assert budget.needed_after_save() == pytest.approx(1.25 * 3.0 + slack)


def test_a_loop_given_its_settings_makes_its_budget_and_installs_its_signals() -> None:
    import signal

    loop = TimeLoop(deadline=Deadline(None, "none"), signals=("USR1",), warmup_steps=0)
    assert loop.budget.signals is not None
    before = signal.getsignal(signal.SIGUSR1)
    loop.add_signal("USR2")
    loop.begin()
    try:
        assert signal.getsignal(signal.SIGUSR1) not in (before, signal.SIG_DFL)
        assert loop.after_step(1, seconds=0.1) == Action()
    finally:
        loop.end()
    assert signal.getsignal(signal.SIGUSR1) == before
    with pytest.raises(TypeError, match="either a ready budget or its settings"):
        TimeLoop(loop.budget, margin=3.0)
    # A budget that reads a flag of its own, and a loop given signal names: both are read.
    theirs = StopSignals(("TERM",))
    budget = TimeBudget(Deadline(None, "none"), signals=theirs, env={})
    both = TimeLoop(budget, signals=("USR1",))
    both.request_stop("SIGUSR1")
    assert budget.stop_signal() == "SIGUSR1"


END = """
import atexit, sys, threading, time
from pathlib import Path
from slurmclock import end_process
out = Path(sys.argv[1])
def late():
    time.sleep(0.3)
    (out / "thread").write_text("joined")
threading.Thread(target=late).start()  # not a daemon: the interpreter would wait for it
atexit.register(lambda: (out / "atexit").write_text("ran"))
print("buffered, not yet flushed", end="")
end_process(75)
"""


def test_end_process_keeps_what_an_exit_does_and_skips_the_teardown(tmp_path: Path) -> None:
    script = tmp_path / "end.py"
    script.write_text(textwrap.dedent(END))
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 75, r.stderr
    assert r.stdout == "buffered, not yet flushed"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "atexit").read_text() == "ran"


def _watchdog(at: float, **kw: Any) -> tuple[Any, list[str]]:
    from slurmclock.loop import _Watchdog

    said: list[str] = []
    dog = _Watchdog(
        at,
        on_abandon=kw.pop("on_abandon", said.append),
        interrupted=kw.pop("interrupted", lambda: None),
        clock=time.time,
        exit=kw.pop("exit", lambda: said.append("exit")),
        poll=0.01,
    )
    return dog, said


def test_an_abandon_watchdog_whose_body_ends_in_time_does_nothing() -> None:
    dog, said = _watchdog(time.time() + 0.3)
    dog.start()
    dog.stop()  # the save was durable first
    time.sleep(0.4)  # past its time: nothing happens any more
    assert said == []


def test_an_abandon_watchdog_exits_even_when_its_report_raises() -> None:
    def report(why: str) -> None:
        raise OSError(f"timeline not writable ({why})")

    exited: list[bool] = []
    dog, _ = _watchdog(time.time() + 0.05, on_abandon=report, exit=lambda: exited.append(True))
    dog.start()
    deadline = time.monotonic() + 30  # a busy machine may starve the thread for a while
    while not exited and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exited == [True]


def test_an_abandon_watchdog_acts_at_once_on_an_interruption() -> None:
    dog, said = _watchdog(time.time() + 3600, interrupted=lambda: "received SIGTERM")
    dog.start()
    deadline = time.monotonic() + 30
    while "exit" not in said and time.monotonic() < deadline:
        time.sleep(0.01)
    assert said == ["received SIGTERM", "exit"]
