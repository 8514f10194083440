"""The watchdog's decisions, in one process: several Watchdogs on one in-memory store, with real
beacon sockets on 127.0.0.1, a short interval, and the exit recorded instead of taken. Real
processes that are SIGKILLed, SIGSTOPped or stuck with the GIL: test_watchdog_processes.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as tdist

from ddpkit import EXIT_PEER_LOST, DistConfigError, Fault, WatchdogOptions
from ddpkit.beacon import Beacon
from ddpkit.faults import append, check_fault_file
from ddpkit.watchdog import Settings, Watchdog

INTERVAL, FROZEN = 0.1, 0.8
PREFIX = "ddpkit/0/0"


class Ranks:
    """``n`` watchdogs sharing a HashStore; ``exits[r]`` is what rank r would exit with."""

    def __init__(self, n: int, tmp: Path, store: Any = None, **over: Any) -> None:
        self.store = store if store is not None else tdist.HashStore()
        self.exits: dict[int, int] = {}
        self.lines: dict[int, list[str]] = {r: [] for r in range(n)}
        self.fault_file = tmp / "faults.jsonl"
        settings = Settings(
            interval=INTERVAL, frozen_after=FROZEN, fault_file=str(self.fault_file), exit_code=69
        )
        beacons = [Beacon("127.0.0.1", 1) for _ in range(n)]
        for r, b in enumerate(beacons):
            self.store.set(f"{PREFIX}/arrived/{r}", b.record())
        self.dogs = [
            Watchdog(
                rank=r,
                world_size=n,
                store=over.get("stores", {}).get(r, self.store),
                prefix=PREFIX,
                beacon=beacons[r],
                settings=settings,
                job_id="4242",
                exit=self._exit(r),
                write=self.lines[r].append,
            )
            for r in range(n)
        ]
        for dog in self.dogs:
            dog.start(lambda r: bytes(self.store.get(f"{PREFIX}/arrived/{r}")).decode())

    def _exit(self, rank: int) -> Callable[[int], None]:
        def record(code: int) -> None:
            self.exits[rank] = code

        return record

    def kill(self, rank: int) -> None:
        """As SIGKILL would: threads gone, sockets closed by the kernel, no goodbye."""
        dog = self.dogs[rank]
        dog._stop.set()
        dog._store_stop.set()
        for t in dog._threads:
            t.join(2)
        dog._shutdown()

    def freeze(self, rank: int) -> None:
        """As SIGSTOP would: nothing runs, but the sockets stay open."""
        dog = self.dogs[rank]
        dog._stop.set()
        dog._store_stop.set()
        for t in dog._threads:
            t.join(2)

    def wait_exits(self, ranks: set[int], seconds: float = 10.0) -> float:
        t0 = time.monotonic()
        while set(self.exits) < ranks and time.monotonic() - t0 < seconds:
            time.sleep(0.02)
        assert set(self.exits) >= ranks, (self.exits, self.lines)
        return time.monotonic() - t0

    def faults(self) -> list[dict[str, Any]]:
        if not self.fault_file.exists():
            return []
        return [json.loads(line) for line in self.fault_file.read_text().splitlines()]

    def close(self) -> None:
        # Threads first: a watch thread still running would read a link closed under it.
        for rank in range(len(self.dogs)):
            self.kill(rank)


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Callable[..., Ranks]]:
    made: list[Ranks] = []

    def make(n: int, **over: Any) -> Ranks:
        made.append(Ranks(n, tmp_path, **over))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize("victim", [2, 0])
def test_a_dead_rank_is_reported_once_and_everyone_exits(victim: int, ranks: Any) -> None:
    job = ranks(4)
    time.sleep(3 * INTERVAL)
    job.kill(victim)
    survivors = {r for r in range(4) if r != victim}
    took = job.wait_exits(survivors)
    assert took < 3.0  # a closed connection is news at once (bound for a loaded machine)
    assert {job.exits[r] for r in survivors} == {EXIT_PEER_LOST}
    reporter = (victim - 1) % 4
    assert job.faults() == [
        {
            "time": job.faults()[0]["time"],
            "rank": victim,
            "host": job.dogs[victim]._host,
            "what": "dead",
            "reporter": reporter,
            "silent_s": job.faults()[0]["silent_s"],
            "job_id": "4242",
        }
    ]
    (line,) = job.lines[reporter]
    assert f"rank {victim} on " in line and " is dead (its connection closed" in line
    assert "seen by this rank: ending this rank (exit 69)" in line
    assert "recorded in DDPKIT_FAULT_FILE" in line
    for r in survivors - {reporter}:
        (line,) = job.lines[r]
        assert "is dead" in line and f"reported by rank {reporter}" in line, line


@pytest.mark.parametrize("victim", [1, 0])
def test_a_frozen_rank_is_reported_after_frozen_after(victim: int, ranks: Any) -> None:
    job = ranks(3)
    time.sleep(3 * INTERVAL)
    job.freeze(victim)
    t0 = time.monotonic()
    job.wait_exits({r for r in range(3) if r != victim})
    assert time.monotonic() - t0 >= FROZEN - INTERVAL  # not before its silence is long enough
    (fault,) = job.faults()
    assert (fault["rank"], fault["what"], fault["reporter"]) == (victim, "frozen", (victim - 1) % 3)
    assert fault["silent_s"] >= FROZEN - INTERVAL


def test_a_rank_leaving_normally_is_not_dead(ranks: Any) -> None:
    """Rank 2 finishes first (uneven ends are normal); the others go on, then leave too."""
    job = ranks(3)
    time.sleep(3 * INTERVAL)
    job.dogs[2].leave()
    time.sleep(FROZEN + 5 * INTERVAL)  # long past any threshold
    assert job.exits == {} and job.faults() == []
    job.dogs[1].leave()
    t0 = time.monotonic()
    job.dogs[0].leave()  # rank 0 waits at most an interval for the others to hang up
    assert time.monotonic() - t0 < 1.0 + INTERVAL
    assert job.exits == {} and all(lines == [] for lines in job.lines.values())


def test_rank_zero_leaving_ends_the_watch_of_the_others(ranks: Any) -> None:
    job = ranks(3)
    time.sleep(3 * INTERVAL)
    job.dogs[0].leave()
    time.sleep(FROZEN + 5 * INTERVAL)
    assert job.exits == {} and job.faults() == []
    assert all(dog._stop.is_set() for dog in job.dogs)


def test_a_rank_leaving_with_an_error_ends_the_others_without_a_fault_line(ranks: Any) -> None:
    job = ranks(3)
    time.sleep(3 * INTERVAL)
    job.dogs[1].leave("KeyError: 'boom'")
    job.wait_exits({0, 2})
    assert job.faults() == []  # a Python error is not a node to avoid
    for r in (0, 2):
        (line,) = job.lines[r]
        assert "rank 1 on " in line and "ended with an error (KeyError: 'boom')" in line


@pytest.mark.parametrize("victim", [0, 1])
def test_a_collective_failing_as_its_peer_dies_reports_the_death(victim: int, ranks: Any) -> None:
    """SIGKILL of one of two ranks: the other's collective fails at the same moment (gloo:
    "Connection reset by peer") and its ``with`` block ends in that error, often before its
    watch thread has read the closed connection. The death is what the job must hear (exit 69,
    the fault file), not this rank's error."""
    job = ranks(2)
    time.sleep(3 * INTERVAL)
    job.kill(victim)
    survivor = 1 - victim
    job.dogs[survivor].leave("RuntimeError: Read error: Connection reset by peer")
    assert job.exits == {survivor: EXIT_PEER_LOST}, job.lines
    assert [(f["rank"], f["what"], f["reporter"]) for f in job.faults()] == [
        (victim, "dead", survivor)
    ]
    (line,) = job.lines[survivor]
    assert f"rank {victim} on " in line and "seen by this rank" in line, line


def test_a_peer_error_read_while_leaving_with_one_changes_nothing(ranks: Any) -> None:
    """Rank 0 and 1 raise in the same step; rank 1, waiting a look for a verdict before it
    leaves, reads rank 0's E line meanwhile: that is no reason to end it with 69, its own error
    stands (rank 0's E is sent as its leave() does it, from its beacon)."""
    job = ranks(2)
    time.sleep(3 * INTERVAL)
    leaving = threading.Thread(target=job.dogs[1].leave, args=("KeyError: 'boom 1'",))
    leaving.start()
    while not job.dogs[1]._leaving_with_error:
        time.sleep(0.001)
    error = Fault(rank=0, host="n0", what="error", reporter=0, detail="KeyError: 'boom 0'")
    job.dogs[0]._beacon.send(f"E {error.to_json()}\n")
    leaving.join(10)
    # Rank 1 is not ended by rank 0's error (rank 0, still watching, is by rank 1's E: fine).
    assert 1 not in job.exits and job.lines[1] == [] and job.faults() == [], job.lines


class HangingStore:
    """Rank 0's store as seen from another rank when rank 0 is stopped: calls never return."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.hang = threading.Event()
        self.broken = threading.Event()

    def _call(self, name: str, *args: Any) -> Any:
        if self.broken.is_set():
            raise RuntimeError("Connection reset by peer")
        if self.hang.is_set():
            threading.Event().wait(3600)  # the thread is abandoned (a daemon)
        return getattr(self.inner, name)(*args)

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", key))

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)


def test_a_stopped_store_host_is_frozen(ranks: Any) -> None:
    """SIGSTOP on rank 0 stops its store too: the others' calls hang, their beacon link stays."""
    shared = tdist.HashStore()
    views = {r: HangingStore(shared) for r in (1, 2)}
    job = ranks(3, store=shared, stores=views)
    time.sleep(3 * INTERVAL)
    job.freeze(0)
    for view in views.values():
        view.hang.set()
    job.wait_exits({1, 2})
    (fault,) = job.faults()
    assert (fault["rank"], fault["what"], fault["reporter"]) == (0, "frozen", 2)
    assert "its store stopped answering" in job.lines[2][0]


def test_a_broken_store_is_its_dead_host(ranks: Any) -> None:
    shared = tdist.HashStore()
    views = {r: HangingStore(shared) for r in (1, 2)}
    job = ranks(3, store=shared, stores=views)
    time.sleep(3 * INTERVAL)
    job.freeze(0)  # it judges nobody any more ...
    for view in views.values():
        view.broken.set()  # ... and its store went away without a word from its beacon
    job.wait_exits({1, 2})
    assert [f["what"] for f in job.faults()] == ["dead"]
    assert "its store closed: Connection reset by peer" in job.lines[2][0]


def test_a_published_fault_reaches_ranks_not_linked_to_the_reporter(ranks: Any) -> None:
    job = ranks(4)
    time.sleep(3 * INTERVAL)
    fault = Fault(rank=3, host="n9", what="dead", reporter=2, detail="x")
    job.store.set(f"{PREFIX}/fault", fault.to_json())
    job.wait_exits({0, 1, 2, 3})
    assert all("rank 3 on n9 is dead" in job.lines[r][0] for r in range(3))
    assert "this rank was found dead (x), reported by rank 2" in job.lines[3][0]
    # Only the rank named as its reporter records it, however the news reached it.
    assert [(f["rank"], f["reporter"]) for f in job.faults()] == [(3, 2)]


# -- settings ------------------------------------------------------------------------------------


def test_settings_from_the_environment(tmp_path: Path) -> None:
    opts = WatchdogOptions()
    s = opts.settings({}, 2.0)
    assert s is not None and (s.interval, s.frozen_after, s.fault_file) == (2.0, 20.0, None)
    assert s.exit_code == 69 and s.dead_probe_after == 6.0
    path = str(tmp_path / "f.jsonl")
    s = opts.settings({"DDPKIT_FROZEN_AFTER": "45", "DDPKIT_FAULT_FILE": path}, 2.0)
    assert s is not None and (s.frozen_after, s.fault_file) == (45.0, path)
    assert opts.settings({"DDPKIT_WATCHDOG": "0"}, 2.0) is None
    assert WatchdogOptions(enabled=True).settings({"DDPKIT_WATCHDOG": "0"}, 2.0) is not None
    s = WatchdogOptions(frozen_after=9, fault_file=path).settings({"DDPKIT_FROZEN_AFTER": "45"}, 2)
    assert s is not None and s.frozen_after == 9.0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DDPKIT_WATCHDOG": "maybe"}, "DDPKIT_WATCHDOG='maybe' must be 1"),
        ({"DDPKIT_FROZEN_AFTER": "soon"}, "DDPKIT_FROZEN_AFTER='soon' must be a positive"),
        ({"DDPKIT_FROZEN_AFTER": "-1"}, "DDPKIT_FROZEN_AFTER='-1' must be a positive"),
        ({"DDPKIT_FROZEN_AFTER": "5"}, "DDPKIT_FROZEN_AFTER=5 s is shorter than 3 heartbeat"),
        ({"DDPKIT_FAULT_FILE": "/no/such/dir/f.jsonl"}, "folder /no/such/dir does not exist"),
        ({"DDPKIT_FAULT_FILE": "/"}, "is a folder"),
    ],
)
def test_bad_settings_are_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(DistConfigError) as e:
        WatchdogOptions().settings(env, 2.0)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_options_are_one_line() -> None:
    with pytest.raises(DistConfigError, match="frozen_after=0 must be a positive"):
        WatchdogOptions(frozen_after=0)
    with pytest.raises(DistConfigError, match="exit_code=75 must not be used: job scripts read"):
        WatchdogOptions(exit_code=75)
    with pytest.raises(DistConfigError, match="exit_code=0 must be"):
        WatchdogOptions(exit_code=0)


def test_fault_file_lines_are_the_contract(tmp_path: Path) -> None:
    path = str(tmp_path / "faults.jsonl")
    check_fault_file(path)
    assert append(path, Fault(rank=1, host="n1", what="dead", reporter=0, silent_s=0.04)) is None
    assert append(path, Fault(rank=3, host="n2", what="frozen", reporter=2, job_id="7")) is None
    assert append(path, Fault(rank=2, host="n1", what="error", reporter=2)) is None  # not written
    lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert [list(d) for d in lines] == [
        ["time", "rank", "host", "what", "reporter", "silent_s", "job_id"]
    ] * 2
    assert [(d["rank"], d["host"], d["what"], d["reporter"]) for d in lines] == [
        (1, "n1", "dead", 0),
        (3, "n2", "frozen", 2),
    ]
    # Epoch seconds, as the job timeline has them (slurmclock's supervisor reads both)
    assert all(isinstance(d["time"], float) and abs(d["time"] - time.time()) < 600 for d in lines)
    unwritable = append(
        str(tmp_path / "gone" / "f"), Fault(rank=1, host="h", what="dead", reporter=0)
    )
    assert unwritable is not None and "DDPKIT_FAULT_FILE=" in unwritable
