"""Scenario 1: a real SLURM time limit. The job gets SLURM's minimum allocation (one minute) and
enough steps for at least three; it reads its end time from SLURM, saves a committed checkpoint
before the kill, requeues itself, and finishes with weights bitwise equal to a straight run."""

from __future__ import annotations

from typing import Any

import pytest
from e2e_helpers import (
    LongRuns,
    allocations,
    iso_to_epoch,
    one,
    pct,
    runs,
)
from train_helpers import assert_bitwise_equal, final_state

from pyrecover_train.metrics import fmt_duration
from pyrecover_train.report import summarize

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_time_limit_requeue_until_done(long: LongRuns, figures: dict[str, Any]) -> None:
    """1. time limit (--time=1), self-requeue until done"""
    job = long.background.result("time_limit", timeout=1500)
    figures["steps"] = long.steps
    assert job.info["JobState"] == "COMPLETED", job.log
    restarts = int(job.info["RestartCnt"])
    figures["allocations"] = restarts + 1
    assert restarts >= 2, f"only {restarts + 1} allocation(s): the scenario needs >= 3\n{job.log}"

    metrics = long.workdir / "timelimit" / "ckpt" / "timelimit" / "metrics.jsonl"
    rs = runs(metrics)
    assert len(rs) == restarts + 1, f"{len(rs)} trainer runs for {restarts + 1} allocations"
    for i, (run, nxt) in enumerate(zip(rs, rs[1:], strict=False)):
        start, stop = one(run, "start"), one(run, "stop")
        # The deadline came from SLURM itself (squeue), not from a guess.
        assert start["deadline_source"] == "squeue" and start["restart_count"] == i, start
        assert stop["cause"] in ("time", "signal") and stop["exit_code"] == 75, stop
        # The final checkpoint of the allocation was durable before SLURM's end time ...
        final = [e for e in run if e["event"] == "saved" and e["step"] == stop["step"]]
        assert final, f"allocation {i}: no checkpoint of step {stop['step']}"
        assert final[-1]["durable_at"] < iso_to_epoch(start["deadline"]), (final, start)
        # ... and the next allocation resumed from exactly that step: nothing lost, nothing redone.
        resume = one(nxt, "resume")
        assert resume["step"] == stop["step"] and resume["restart_count"] == i + 1, resume
    last = one(rs[-1], "stop")
    assert last["cause"] == "done" and last["step"] == long.steps, last

    long.background.result("reference", timeout=900)
    _, want = final_state(long.reference)
    manifest, got = final_state(long.workdir / "timelimit" / "ckpt", "timelimit")
    assert manifest.step == long.steps
    assert_bitwise_equal(want, got)
    figures["bitwise"] = "equal"

    # Goodput: time in steps that persisted / time the allocations were held.
    allocs = allocations(job.log)
    assert [a.restart for a in allocs] == list(range(restarts + 1)), job.log
    assert [a.status for a in allocs] == [75] * restarts + [0], job.log
    held = sum(a.held_s or 0.0 for a in allocs)
    summary = summarize([e for r in rs for e in r])
    assert summary.lost_steps == 0
    figures["goodput"] = pct(summary.persisted_step_s / held)
    figures["held"] = fmt_duration(held)
    figures["lost steps"] = summary.lost_steps
    gaps = [b.started - a.ended for a, b in zip(allocs, allocs[1:], strict=False) if a.ended]
    figures["requeue gap"] = fmt_duration(max(gaps)) + " max"
    figures["wall"] = fmt_duration(job.seconds)
    assert "requeueing job" in job.log and "training finished" in job.log
