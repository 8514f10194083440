"""AbandonAt, the watchdog of an extra save: its logic with a fake exit (the real os._exit is
in test_extra_saves.py)."""

from __future__ import annotations

import threading
import time

from pyrecover_train.abandon import AbandonAt


class Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.said: list[str] = []
        self.exited = threading.Event()

    def exit(self, code: int) -> None:
        self.codes.append(code)
        self.exited.set()


def test_a_body_that_ends_in_time_is_left_alone() -> None:
    e = Exits()
    with AbandonAt(time.time() + 0.5, code=75, on_abandon=e.said.append, exit=e.exit) as w:
        time.sleep(0.05)
    time.sleep(0.6)
    assert e.codes == [] and e.said == [] and w.abandoned is None


def test_a_body_still_running_at_the_time_is_abandoned_with_the_code() -> None:
    e = Exits()
    t0 = time.time()
    with AbandonAt(t0 + 0.2, code=75, on_abandon=e.said.append, exit=e.exit) as w:
        assert e.exited.wait(5)
    assert e.codes == [75] and e.said == ["the exit must begin"] and w.abandoned == e.said[0]
    assert time.time() - t0 >= 0.2


def test_an_interruption_abandons_at_once_and_a_failing_report_still_exits() -> None:
    e = Exits()
    asked: list[str | None] = [None]

    def report(why: str) -> None:
        e.said.append(why)
        raise OSError("the metrics file is gone")

    t0 = time.time()
    with AbandonAt(t0 + 60, code=75, on_abandon=report, interrupted=lambda: asked[0], exit=e.exit):
        time.sleep(0.1)
        asked[0] = "SIGTERM"
        assert e.exited.wait(5)
    assert e.codes == [75] and e.said == ["SIGTERM"] and time.time() - t0 < 5
