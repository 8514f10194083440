"""How often the deadline is re-read: every 5 s on the rank that watches the clock, less when
SLURM is slow or failing, on a background thread with the real clock, at once on refresh()."""

from __future__ import annotations

import copy
import gc
import logging
import os
import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from slurmclock import CommandError, DeadlineWatcher
from slurmclock.deadline import MAX_BACKOFF

JOB = {"SLURM_JOB_ID": "42"}


def squeue_line(fakes: Any, end: float) -> str:
    return f"{fakes.iso(end)} 10:00"


# -- how often (who polls how often: test_job.py, with who leads) -------------------------------


def test_a_shortened_limit_is_seen_within_5_s(clock: Any, fakes: Any) -> None:
    end = [clock.now + 3600]
    runner = fakes.Runner(squeue=lambda argv: squeue_line(fakes, end[0]))
    w = DeadlineWatcher(env=JOB, runner=runner, clock=clock)
    assert w.get().end == end[0]
    end[0] = clock.now + 20  # scontrol update TimeLimit=...: 20 s left
    clock.advance(4.9)
    assert w.get().end == clock.now - 4.9 + 3600  # not yet due
    clock.advance(0.1)
    assert w.get().end == end[0]
    assert runner.count("squeue") == 2


# -- back-off ------------------------------------------------------------------------------------


def test_a_slow_slurm_is_asked_less_often(clock: Any, fakes: Any) -> None:
    took = [0.0]

    def squeue(argv: Sequence[str]) -> str:
        clock.advance(took[0])  # the poll takes this long
        return squeue_line(fakes, clock.now + 3600)

    w = DeadlineWatcher(env=JOB, runner=fakes.Runner(squeue=squeue), clock=clock)
    w.get()
    assert w.next_poll_in == 5.0 and w.last_poll_seconds == 0.0
    for seconds, interval in ((1.0, 20.0), (2.5, 50.0), (9.0, 60.0), (0.01, 5.0)):
        took[0] = seconds
        w.refresh()
        assert w.last_poll_seconds == pytest.approx(seconds) and w.next_poll_in == interval


def test_failing_polls_back_off_by_doubling_and_keep_the_last_deadline(
    clock: Any, fakes: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ok = [True]

    def squeue(argv: Sequence[str]) -> str:
        if ok[0]:
            return squeue_line(fakes, 1_900_003_600.0)
        raise CommandError(argv, "timeout", "`squeue` timed out after 10 s")

    runner = fakes.Runner(squeue=squeue, scontrol=CommandError(["scontrol"], "timeout", "late"))
    w = DeadlineWatcher(env=JOB, runner=runner, clock=clock)
    first = w.get()
    ok[0] = False
    waits = []
    for _ in range(8):
        clock.advance(w.next_poll_in)
        assert w.get() == first
        waits.append(w.next_poll_in)
    assert waits == [10.0, 20.0, 40.0, 80.0, 160.0, MAX_BACKOFF, MAX_BACKOFF, MAX_BACKOFF]
    assert runner.count("squeue") == 9  # one poll per wait, not one per get()
    ok[0] = True
    clock.advance(w.next_poll_in)
    w.get()
    assert w.next_poll_in == 5.0
    assert caplog.text.count("squeue failed for job 42") == 1


def test_refresh_force_false_polls_only_when_due(clock: Any, fakes: Any) -> None:
    runner = fakes.Runner(squeue=lambda argv: squeue_line(fakes, clock.now + 600))
    w = DeadlineWatcher(env=JOB, runner=runner, clock=clock)
    w.get()
    w.refresh(force=False)
    assert runner.count("squeue") == 1
    w.refresh()  # news from SLURM (a warning signal): ask now
    assert runner.count("squeue") == 2
    clock.advance(5)
    w.refresh(force=False)
    assert runner.count("squeue") == 3


def test_a_deadline_moved_earlier_is_a_warning_later_is_info(
    clock: Any, fakes: Any, caplog: pytest.LogCaptureFixture
) -> None:
    end = [clock.now + 3600]
    w = DeadlineWatcher(
        env=JOB, runner=fakes.Runner(squeue=lambda argv: squeue_line(fakes, end[0])), clock=clock
    )
    caplog.set_level(logging.INFO, logger="slurmclock")
    w.get()
    end[0] -= 3000
    w.refresh()
    earlier = [r for r in caplog.records if "earlier" in r.getMessage()]
    assert len(earlier) == 1 and earlier[0].levelno == logging.WARNING
    assert "moved 3000 s earlier" in earlier[0].getMessage()
    end[0] += 60
    w.refresh()
    assert any(
        r.levelno == logging.INFO and "moved later" in r.getMessage() for r in caplog.records
    )


# -- the background thread (real clock) ----------------------------------------------------------


class ThreadRunner:
    """squeue answers with ``end``; records which thread asked; can be held (a hung controller)."""

    def __init__(self, end: float) -> None:
        self.end = end
        self.threads: list[str] = []
        self.polled = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        self.threads.append(threading.current_thread().name)
        self.release.wait(30)
        self.polled.set()
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.end)) + " 10:00"


def test_with_the_real_clock_polls_run_on_a_thread_and_get_never_waits() -> None:
    runner = ThreadRunner(time.time() + 3600)
    w = DeadlineWatcher(env=JOB, runner=runner, poll_interval=1.0)
    try:
        assert w.background and w.get().end == int(runner.end)
        assert runner.threads == [threading.current_thread().name]  # the first answer, inline
        runner.release.clear()  # the controller hangs from now on
        runner.polled.clear()
        runner.end = time.time() + 20  # and the limit was cut
        slowest = 0.0
        while len(runner.threads) < 2:
            started = time.perf_counter()
            w.get()
            slowest = max(slowest, time.perf_counter() - started)
            time.sleep(0.01)
        assert set(runner.threads[1:]) == {"slurmclock-deadline"}
        for _ in range(100):  # steps go on while squeue hangs on the thread
            started = time.perf_counter()
            w.get()
            slowest = max(slowest, time.perf_counter() - started)
        assert slowest < 1.0, slowest  # not the 30 s squeue hangs: get() never waited for it
        runner.release.set()
        assert runner.polled.wait(30)
        deadline = time.monotonic() + 30
        while w.get().end != int(runner.end) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.get().end == int(runner.end)
    finally:
        runner.release.set()
        w.close()


def test_close_and_a_dropped_watcher_end_the_thread() -> None:
    def threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "slurmclock-deadline"]

    before = len(threads())
    runner = ThreadRunner(time.time() + 3600)
    w = DeadlineWatcher(env=JOB, runner=runner, poll_interval=1.0)
    w.get()
    w.get()
    assert len(threads()) == before + 1
    w.close()
    _wait_for(lambda: len(threads()) == before)
    assert not w.background  # after close(), get() polls inline again, when due
    dropped = DeadlineWatcher(env=JOB, runner=runner, poll_interval=1.0)
    dropped.get()
    dropped.get()
    assert len(threads()) == before + 1
    del dropped
    gc.collect()
    _wait_for(lambda: len(threads()) == before)  # ends at its next wake-up (<= 1 s)


def test_no_thread_outside_a_job_or_with_a_fixed_deadline() -> None:
    for w in (DeadlineWatcher(env={}), DeadlineWatcher(env=JOB, time_limit="1:00:00")):
        w.get()
        w.get()
        assert not any(t.name == "slurmclock-deadline" for t in _threads_of(w))


def test_a_forked_child_polls_without_the_parents_thread_or_lock() -> None:
    """The parent's poll is in flight (its lock held) when a DataLoader-style fork happens:
    the child's refresh() must not wait for a lock nobody in the child will release."""
    runner = ThreadRunner(time.time() + 3600)
    w = DeadlineWatcher(env=JOB, runner=runner, poll_interval=1.0)
    w.get()
    runner.release.clear()
    runner.polled.clear()
    w.get()  # starts the thread, which will block in squeue holding the poll lock
    _wait_for(lambda: len(runner.threads) >= 2)
    pid = os.fork()
    if pid == 0:  # the child: a watcher that works on its own
        code = 1
        try:
            runner.release.set()  # the child's copy: its own polls are not held
            code = 0 if w.refresh().end == int(runner.end) else 3
        finally:
            os._exit(code)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                assert os.waitstatus_to_exitcode(status) == 0
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's refresh() hung on the parent's lock")
    finally:
        runner.release.set()
        w.close()


def _threads_of(w: DeadlineWatcher) -> list[threading.Thread]:
    thread = w._poller._thread
    return [] if thread is None else [thread]


def _wait_for(condition: Any, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_a_copied_watcher_has_its_own_thread() -> None:
    """Trainers deep-copy and pickle callbacks; a lock or a thread cannot be copied."""
    w = DeadlineWatcher(env=JOB, runner=FixedSqueue(time.time() + 3600), poll_interval=1.0)
    w.get()
    w.get()
    try:
        for twin in (copy.deepcopy(w), pickle.loads(pickle.dumps(w))):
            assert twin.get() == w.get()
            assert twin._poller is not w._poller and twin._poller._ref() is twin
            twin.close()
    finally:
        w.close()


class FixedSqueue:
    def __init__(self, end: float) -> None:
        self.end = end

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.end)) + " 10:00"


class CallTimeSqueue(ThreadRunner):
    """Answers with the end as it was when squeue was called (a real poll's snapshot)."""

    delay = 0.0  # every poll takes this long: the next poll's answer is not there at once

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        end = self.end
        self.threads.append(threading.current_thread().name)
        self.release.wait(30)
        time.sleep(self.delay)
        self.polled.set()
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(end)) + " 10:00"


def test_refresh_on_the_thread_answers_with_a_poll_started_after_it() -> None:
    runner = CallTimeSqueue(time.time() + 3600)
    w = DeadlineWatcher(env=JOB, runner=runner, poll_interval=1.0)
    try:
        w.get()
        runner.release.clear()
        w.get()  # the thread starts; its first poll (due in 1 s) will hang, holding the old end
        _wait_for(lambda: len(runner.threads) >= 2)
        runner.end = time.time() + 20  # the limit is cut while that poll is in flight
        runner.delay = 0.5
        threading.Timer(0.3, runner.release.set).start()
        d = w.refresh(wait=20)  # must not take the in-flight poll's stale answer
        assert (
            d.end == int(runner.end) and threading.current_thread().name not in runner.threads[1:]
        )
    finally:
        runner.release.set()
        w.close()


def test_refresh_waits_at_most_wait_seconds_for_a_hung_controller() -> None:
    runner = ThreadRunner(time.time() + 3600)
    w = DeadlineWatcher(env=JOB, runner=runner, poll_interval=60.0)
    try:
        first = w.get()
        w.get()  # the thread starts and sleeps 60 s
        runner.release.clear()  # the controller hangs
        runner.end = time.time() + 20
        started = time.monotonic()
        assert w.refresh(wait=0.3) == first  # the old answer, after ~0.3 s, not 30 s
        assert time.monotonic() - started < 10
        runner.release.set()
        _wait_for(lambda: w.get().end == int(runner.end))  # the thread's answer comes later
        runner.end = time.time() + 10
        assert w.refresh().end == int(runner.end)  # a healthy controller: the fresh answer
    finally:
        runner.release.set()
        w.close()
