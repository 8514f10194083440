"""The dead-rank diagnosis, on a fake store and a fake clock (the real thing is in
test_multiprocess.py, where real processes die)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from ddpkit.health import KEY_PREFIX, Heartbeat, diagnose, heartbeat_interval


class FakeStore:
    """Counters; ``on_sleep`` lets the live ranks beat while the diagnosing rank waits."""

    def __init__(self, live: set[int]) -> None:
        self.counts: dict[str, int] = {}
        self.live = live
        self.broken = False

    def add(self, key: str, amount: int) -> int:
        if self.broken:
            raise RuntimeError("Connection reset by peer")
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def beat(self) -> None:
        for r in self.live:
            self.add(f"{KEY_PREFIX}{r}", 1)


def sleeper(store: FakeStore, slept: list[float]) -> Callable[[float], None]:
    def sleep(s: float) -> None:
        slept.append(s)
        store.beat()

    return sleep


def test_names_the_silent_ranks() -> None:
    store = FakeStore(live={0, 2})
    slept: list[float] = []
    msg = diagnose(store, 4, me=0, interval=1.0, sleep=sleeper(store, slept))
    assert msg.startswith("ranks 1, 3 stopped answering (no heartbeat for 2.5 s)")
    assert slept == [2.5]


def test_one_silent_rank() -> None:
    store = FakeStore(live={0, 1})
    msg = diagnose(store, 3, me=1, interval=2.0, sleep=sleeper(store, []))
    assert msg.startswith("rank 2 stopped answering (no heartbeat for 5.0 s): look at its log")


def test_everyone_alive_means_someone_is_stuck() -> None:
    store = FakeStore(live={0, 1})
    msg = diagnose(store, 2, me=0, interval=1.0, sleep=sleeper(store, []))
    assert msg.startswith("every rank still answers")


def test_store_gone_means_its_host_died() -> None:
    store = FakeStore(live=set())
    store.broken = True
    msg = diagnose(store, 2, me=1, interval=1.0, sleep=lambda s: None)
    assert "rendezvous store is unreachable" in msg and "Connection reset by peer" in msg


def test_interval_scales_with_timeout() -> None:
    assert heartbeat_interval(3) == 0.5
    assert heartbeat_interval(10) == 1.0
    assert heartbeat_interval(180) == 2.0


def test_heartbeat_thread_beats_and_stops() -> None:
    store = FakeStore(live=set())
    hb = Heartbeat(store, rank=3, interval=0.01).start()
    assert store.counts[f"{KEY_PREFIX}3"] >= 1  # the first beat is synchronous
    for _ in range(500):
        if store.counts[f"{KEY_PREFIX}3"] >= 3:
            break
        import time

        time.sleep(0.01)
    hb.stop()
    assert store.counts[f"{KEY_PREFIX}3"] >= 3
    settled = store.counts[f"{KEY_PREFIX}3"]
    hb.stop()  # idempotent
    assert store.counts[f"{KEY_PREFIX}3"] == settled
