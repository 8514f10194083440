"""Scenario 1: a real SLURM time limit with the shipped defaults. `sbatch --time=3` of the shipped
script and nothing else changed: no --stop-margin, no --signal override (its USR2@300 comes at
once in a 3-minute job and is information, not an order). Each allocation reads its end time
from SLURM, trains until the measured stop rule says stop, saves a durable checkpoint and
requeues itself; measured from the job log and a straight run's time per step, every allocation
but the last put >= 85% of its three minutes into steps that persisted (less what a loaded
machine adds to the start-up's calibrated CPU work, see AllocationUse.target); nothing was lost
and the final weights are bitwise those of the straight run."""

from __future__ import annotations

from typing import Any

import pytest
from allocation_use import allocation_use, allocations
from e2e_helpers import (
    GOAL_ALLOCATIONS,
    TIME_LIMIT_MIN,
    LongRuns,
    events,
    iso_to_epoch,
    one,
    pct,
    runs,
)
from train_helpers import assert_bitwise_equal, final_state

from pyrecover_train.metrics import fmt_duration

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(3000)]


def test_time_limit_with_the_shipped_defaults(long: LongRuns, figures: dict[str, Any]) -> None:
    """1. time limit (--time=3, shipped defaults), self-requeue until done"""
    job = long.background.result("time_limit", timeout=2700)
    figures["steps"] = long.steps
    assert job.info["JobState"] == "COMPLETED", job.log
    restarts = int(job.info["RestartCnt"])
    figures["allocations"] = restarts + 1
    assert restarts + 1 >= GOAL_ALLOCATIONS, f"{restarts + 1} allocation(s)\n{job.log}"
    assert "warning signal lead: 300 s" in job.log  # from the script's own #SBATCH line

    rs = runs(long.workdir / "timelimit" / "ckpt" / "timelimit" / "metrics.jsonl")
    assert len(rs) == restarts + 1, f"{len(rs)} trainer runs for {restarts + 1} allocations"
    for i, (run, nxt) in enumerate(zip(rs, rs[1:], strict=False)):
        _assert_stopped_for_time_and_resumed(i, run, nxt)
    last = one(rs[-1], "stop")
    assert last["cause"] == "done" and last["step"] == long.steps, last

    long.background.result("reference", timeout=1200)
    _, want = final_state(long.reference)
    manifest, got = final_state(long.workdir / "timelimit" / "ckpt", "timelimit")
    assert manifest.step == long.steps
    assert_bitwise_equal(want, got)
    figures["bitwise"] = "equal"

    # From outside: the job log's allocations and steps, the straight run's time per step.
    allocs = allocations(job.log)
    assert [a.restart for a in allocs] == list(range(restarts + 1)), job.log
    assert [a.status for a in allocs] == [75] * restarts + [0], job.log
    reference = events(long.reference / "default-exp" / "metrics.jsonl")
    uses = allocation_use(allocs, rs, reference, TIME_LIMIT_MIN * 60.0, long.quiet)
    for use, run in zip(uses, rs, strict=True):  # the log says what the metrics say
        assert use.persisted_steps == one(run, "stop")["step"] - one(run, "start")["step"]
    figures["per allocation"] = " ".join(pct(u.share) for u in uses)
    print("\n".join(u.describe() for u in uses))
    figures["held"] = " ".join(f"{u.held_s:.0f}s" for u in uses)
    figures["start-up"] = " ".join(f"{one(r, 'startup')['seconds']:.1f}s" for r in rs)
    figures["wall"] = fmt_duration(job.seconds)
    short = [u for u in uses[:-1] if u.share < u.target]
    summary = [
        f"{u.describe()}; start-up {_parts(one(r, 'startup'))}; {one(r, 'stop')['reason']}"
        for u, r in zip(uses, rs, strict=True)
    ]
    assert not short, "below target:\n" + "\n".join(summary) + f"\n{job.log}"
    assert all(u.held_s <= TIME_LIMIT_MIN * 60 for u in uses), uses


def _assert_stopped_for_time_and_resumed(i: int, run: list[dict], nxt: list[dict]) -> None:
    start, stop = one(run, "start"), one(run, "stop")
    # The deadline came from SLURM itself (squeue), not from a guess nor from the warning.
    assert start["deadline_source"] == "squeue" and start["restart_count"] == i, start
    assert stop["cause"] == "time" and stop["exit_code"] == 75, stop
    assert "deadline: SIGUSR2" not in stop["reason"], stop  # the warning agreed: information
    # The margin was measured: from the second allocation on, the exit of the earlier ones.
    budget = start["budget"]
    assert budget["margin"] is None and budget["signal_lead"] == 300.0, budget
    assert budget["exits_measured"] == min(i, 5), budget
    # The final checkpoint of the allocation was durable before SLURM's end time ...
    final = [e for e in run if e["event"] == "saved" and e["step"] == stop["step"]]
    assert final, f"allocation {i}: no checkpoint of step {stop['step']}"
    assert final[-1]["durable_at"] < iso_to_epoch(start["deadline"]), (final, start)
    # ... and the next allocation resumed from exactly that step: nothing lost, nothing redone.
    resume = one(nxt, "resume")
    assert resume["step"] == stop["step"] and resume["restart_count"] == i + 1, resume


def _parts(startup: dict[str, Any]) -> str:
    """``37.3 s (launch 0.4, imports 21.0, ...)``: where a slow start-up went, in the failure."""
    parts = ", ".join(f"{p} {s:.1f}" for p, s in (startup.get("parts") or {}).items())
    return f"{startup['seconds']:.1f} s ({parts})"
