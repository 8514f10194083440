"""Scenario 2: preemption and stopping by hand, with the signals' documented meanings. Mid-run:
`scontrol requeue` (what preemption in REQUEUE mode does: SIGTERM to every process of the job,
SIGKILL 5 s later; the job goes back to the queue); in the requeued run, a SIGUSR2 that says the
end comes earlier than SLURM's end time (a preemption notice: the deadline moves, the run trains
on); then `slurmclock stop JOBID` (save and stop for good: not requeued); then the user resubmits
with --continue. Every stop saved its step and the next run resumed there; the final weights are
bitwise equal to a straight run."""

from __future__ import annotations

from typing import Any

import pytest
from allocation_use import allocations
from e2e_helpers import LongRuns, one, runs
from scenarios import PREEMPT_STEPS
from train_helpers import assert_bitwise_equal, final_state

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_preemption_notice_and_stop_by_hand(long: LongRuns, figures: dict[str, Any]) -> None:
    """2. preemption: scontrol requeue, a USR2 notice, slurmclock stop, --continue"""
    again = long.background.result("preemption", timeout=1500)
    first = again.notes["first"]
    # The first job: requeued by SLURM once, then stopped by hand and not requeued.
    assert first.info["JobState"] == "COMPLETED" and first.info["RestartCnt"] == "1", first.log
    assert f"asked job {first.job_id} to save and stop" in again.notes["stop_said"]
    assert again.info["JobState"] == "COMPLETED" and again.info["RestartCnt"] == "0", again.log

    rs = runs(long.workdir / "preempt" / "ckpt" / "preempt" / "metrics.jsonl")
    assert len(rs) == 3, [one(r, "start")["restart_count"] for r in rs]
    stops = [one(r, "stop") for r in rs]
    assert [(s["cause"], s["exit_code"]) for s in stops] == [
        ("signal", 75),
        ("signal", 75),
        ("done", 0),
    ], stops
    # The notice moved the deadline and the run trained on; SIGTERM stopped it.
    # (SIGTERM may come twice: from SLURM to every process, and forwarded by the script.)
    assert set(stops[0]["signals"]) == {"SIGTERM"}, stops[0]
    assert stops[1]["signals"][0] == "SIGUSR2", stops[1]
    assert set(stops[1]["signals"][1:]) == {"SIGTERM"}, stops[1]
    assert stops[1]["reason"].startswith("stop: received SIGTERM"), stops[1]
    notice, stop_at = again.notes["usr2_after_step"], again.notes["stop_after_step"]
    trained_on = max(e["step"] for e in rs[1] if e["event"] == "step")
    assert trained_on >= stop_at > notice, (notice, stop_at, trained_on)
    # Each stop was graceful: the stop step was saved and the next run resumed there.
    for run, stop, nxt in zip(rs, stops, rs[1:], strict=False):
        assert any(e["event"] == "saved" and e["step"] == stop["step"] for e in run), stop
        assert one(nxt, "resume")["step"] == stop["step"]
    assert stops[0]["step"] >= again.notes["requeue_after_step"]
    assert stops[1]["step"] >= again.notes["stop_after_step"]
    figures["stops at"] = f"{stops[0]['step']} (requeue), {stops[1]['step']} (slurmclock stop)"

    log = first.log
    assert "received SIGTERM: SLURM requeued this job" in log  # scontrol requeue: left alone
    assert "received SIGTERM (slurmclock stop or scancel --batch): forwarding" in log
    assert "received SIGUSR2: forwarding to the training step" in log  # news: not the lead's
    assert "using the earlier end" in log  # the trainer's budget read it as a notice
    assert "stopped on request (SIGTERM" in log and "requeued job" not in log
    # (SLURM ends the batch shell of a requeued job KillWait after its SIGTERM: it may be gone
    # before it logs the step's status.)
    assert [a.status for a in allocations(log)] in ([75, 75], [None, 75]), log
    assert "resumed from step" in again.log and "training finished" in again.log

    long.background.result("preempt_reference", timeout=900)
    assert long.preempt_reference is not None
    _, want = final_state(long.preempt_reference)
    manifest, got = final_state(long.workdir / "preempt" / "ckpt", "preempt")
    assert manifest.step == PREEMPT_STEPS
    assert_bitwise_equal(want, got)
    figures["bitwise"] = "equal"
    figures["wall"] = f"{again.seconds:.0f} s"
