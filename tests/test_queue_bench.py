"""bench/queue_replay.py's logic without a cluster: the Lublin-Feitelson workload it replays
and how it scores a run from the job's events (the replay itself needs SLURM and ~15 minutes:
not in CI)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def workload(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("queue_workload")


@pytest.fixture(scope="module")
def replay(workload: ModuleType, load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("queue_replay")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_workload_is_seeded_sized_and_offers_the_load(workload: ModuleType, seed: int) -> None:
    kw = {"seed": seed, "cluster": 16, "span_s": 18000.0, "load": 1.2, "max_runtime_s": 14400.0}
    jobs = workload.lublin_jobs(**kw)
    assert jobs == workload.lublin_jobs(**kw)
    assert all(1 <= j.size <= 16 and 1 <= j.runtime <= 14400 for j in jobs)
    assert all(j.limit_min * 60 >= j.runtime for j in jobs)  # users ask for at least the runtime
    assert [j.arrival for j in jobs] == sorted(j.arrival for j in jobs)
    assert jobs[-1].arrival == pytest.approx(18000.0)
    offered = sum(j.size * j.runtime for j in jobs) / (16 * 18000.0)
    assert 1.2 <= offered < 1.2 + max(j.size * j.runtime for j in jobs) / (16 * 18000.0) + 1e-9


def test_the_running_allocation_counts_its_steps_and_a_wait_under_way_counts(
    replay: ModuleType,
) -> None:
    ev = [
        ("alloc", 100.0, "1", "StartTime=x"),
        ("first_step", 103.0, "1", ""),
        ("saved", 200.0, "1", "steps=97 here=97"),
        ("stop", 200.5, "1", "requeue"),
        ("alloc", 210.0, "1", "StartTime=x"),
        ("first_step", 213.0, "1", ""),
    ]
    assert replay.trained(ev, 250.0, 1.0) == (97, 97 + 1 + 37)
    assert replay.trained(ev[:4], 250.0, 1.0) == (97, 97)
    allocs = replay._allocations(ev[:4], 90.0, 250.0)
    assert [a["start"] for a in allocs] == [100.0, None]
    assert allocs[-1]["wait_s"] == pytest.approx(49.5)  # pending at the end: at least this


def test_the_scaled_slurm_conf_keeps_slurm_defaults_in_model_time(replay: ModuleType) -> None:
    conf = replay.slurm_conf(20.0)
    assert conf["AuthInfo"] == "cred_expire=5"  # 121 s hold / 20 = 6 s = cred_expire 5 + 1
    assert "bf_interval=2" in conf["SchedulerParameters"]  # 30 s / 20, rounded
    assert conf["PriorityType"] == "priority/multifactor"


def test_a_successor_already_waiting_takes_over_without_a_wait(replay: ModuleType) -> None:
    """successor-early: job 2 starts while job 1 runs; job 1 stops after it (the hand-over)."""
    ev = [
        ("alloc", 100.0, "1", "StartTime=x"),
        ("first_step", 103.0, "1", ""),
        ("alloc", 150.0, "2", "StartTime=x"),
        ("saved", 151.0, "1", "steps=48 here=48"),
        ("stop", 151.5, "1", "successor=2 early handed=1"),
        ("first_step", 155.0, "2", ""),
        ("saved", 200.0, "2", "steps=93 here=45"),
        ("stop", 200.5, "2", "successor=3 early handed=0"),
    ]
    allocs = replay._allocations(ev, 90.0, 210.0)
    assert [a["job"] for a in allocs] == ["1", "2", None]
    assert [a["wait_s"] for a in allocs] == pytest.approx([10.0, 0.0, 9.5])
    assert allocs[1]["first_step_after_ready_s"] == pytest.approx(3.5)  # after job 1 stopped
    assert replay.trained(ev, 210.0, 1.0) == (93, 93)
