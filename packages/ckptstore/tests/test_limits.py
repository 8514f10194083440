"""Every wait on the store is bounded: by the caller's bound, by the time left, and by a stop
(within seconds). Real threads and futures, small bounds."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from ckptstore import CallLimits, StoreUnreachableError


def never_done() -> Future[int]:
    return Future()


def test_a_call_that_never_answers_is_given_up_after_its_bound() -> None:
    f = never_done()
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match=r"at put x: given up .*no answer within"):
        CallLimits(call_s=lambda: 0.5, poll_s=0.05).result(f, "put x")
    assert 0.5 <= time.monotonic() - t0 < 2.0
    assert f.cancelled()  # the call is cancelled: its connection is dropped


def test_the_time_left_ends_a_wait() -> None:
    end = time.monotonic() + 0.4
    limits = CallLimits(time_left=lambda: end - time.monotonic(), poll_s=0.05)
    assert 0 < limits.bound() <= 0.4
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match="the time left for it is spent"):
        limits.result(never_done(), "put x")
    assert time.monotonic() - t0 < 1.5


def test_the_time_left_as_a_call_begins_bounds_it() -> None:
    """A caller whose time left never reaches 0 (a floor: a late try costs nothing) still
    bounds each call by what was left as it began."""
    limits = CallLimits(time_left=lambda: 0.4, poll_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match="the time left for it is spent"):
        limits.result(never_done(), "put x")
    assert 0.4 <= time.monotonic() - t0 < 1.5


def test_a_stop_ends_a_wait_that_began_before_it_within_the_grace() -> None:
    stop = threading.Event()
    limits = CallLimits(stopping=stop.is_set, stop_grace_s=0.3, poll_s=0.05)
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match="a stop was asked"):
        limits.result(never_done(), "put x")
    assert 0.6 <= time.monotonic() - t0 < 2.0


def test_a_stop_lets_a_healthy_call_run_its_expected_length() -> None:
    """A save in flight that is not (yet) late is not thrown away for a stop; a late one is."""
    asked = {"n": 0}

    def stopping() -> bool:  # the stop comes just after the call began
        asked["n"] += 1
        return asked["n"] > 1

    limits = CallLimits(stopping=stopping, stop_grace_s=0.1, expected_s=lambda: 0.8, poll_s=0.05)
    f: Future[int] = Future()
    threading.Timer(0.5, f.set_result, args=(3,)).start()
    assert limits.result(f, "put x") == 3
    asked["n"] = 0
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match="a stop was asked"):
        limits.result(never_done(), "put y")
    assert 0.8 <= time.monotonic() - t0 < 2.0


def test_a_call_begun_after_the_stop_has_a_healthy_calls_length() -> None:
    """The final save starts after the stop: it gets what a healthy call takes, plus grace."""
    limits = CallLimits(
        call_s=lambda: 30.0,
        stopping=lambda: True,
        stop_grace_s=0.1,
        expected_s=lambda: 0.7,
        poll_s=0.05,
    )
    f: Future[int] = Future()
    threading.Timer(0.4, f.set_result, args=(7,)).start()
    assert limits.result(f, "put x") == 7
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachableError, match="no answer within 1 s"):
        limits.result(never_done(), "put y")  # a stall: 0.7 + 0.1 s, not 30
    assert time.monotonic() - t0 < 2.0


def test_an_answer_comes_through_and_errors_are_the_calls_own() -> None:
    f: Future[int] = Future()
    f.set_exception(ConnectionResetError("reset"))
    with pytest.raises(ConnectionResetError):
        CallLimits().result(f, "x")


@pytest.mark.parametrize(("field", "value"), [("stop_grace_s", 120.0), ("poll_s", 0.0)])
def test_bad_limits_say_how_to_fix(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        CallLimits(**{field: value})  # type: ignore[arg-type]
