"""Scenario 2: preemption. Mid-run, SLURM's warning signal reaches the batch shell (`scancel
--batch --signal=USR2`), and later the job is requeued from outside (`scontrol requeue`: SIGTERM
to every process, SIGKILL 5 s later). Each time the trainer finishes its step, saves, and the job
comes back and resumes; the final weights are bitwise equal to a straight run."""

from __future__ import annotations

from typing import Any

import pytest
from e2e_helpers import LongRuns, allocations, one, runs
from train_helpers import assert_bitwise_equal, final_state

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_signal_and_requeue_mid_step(long: LongRuns, figures: dict[str, Any]) -> None:
    """2. preemption: scancel --batch --signal=USR2, then scontrol requeue"""
    job = long.background.result("preemption", timeout=1500)
    assert job.info["JobState"] == "COMPLETED", job.log
    assert job.info["RestartCnt"] == "2", job.log

    metrics = long.workdir / "preempt" / "ckpt" / "preempt" / "metrics.jsonl"
    rs = runs(metrics)
    assert len(rs) == 3, [one(r, "start")["restart_count"] for r in rs]
    stops = [one(r, "stop") for r in rs]
    assert [(s["cause"], s["exit_code"]) for s in stops] == [
        ("signal", 75),
        ("signal", 75),
        ("done", 0),
    ], stops
    assert [s["signal"] for s in stops[:2]] == ["SIGUSR2", "SIGTERM"], stops
    # Each interruption was graceful: the stop step was saved and the next run resumed there.
    for run, stop, nxt in zip(rs, stops, rs[1:], strict=False):
        assert any(e["event"] == "saved" and e["step"] == stop["step"] for e in run), stop
        assert one(nxt, "resume")["step"] == stop["step"]
    # They came mid-run, after the steps the driver waited for.
    assert stops[0]["step"] >= job.notes["usr2_sent_after_step"]
    assert stops[1]["step"] >= job.notes["requeue_sent_after_step"]
    figures["stops at"] = f"{stops[0]['step']} (USR2), {stops[1]['step']} (requeue)"

    log = job.log
    assert "received SIGUSR2: forwarding to the training step" in log
    assert "received SIGTERM: forwarding to the training step" in log
    assert [a.status for a in allocations(log)] == [75, 75, 0], log

    long.background.result("reference", timeout=900)
    _, want = final_state(long.reference)
    manifest, got = final_state(long.workdir / "preempt" / "ckpt", "preempt")
    assert manifest.step == long.steps
    assert_bitwise_equal(want, got)
    figures["bitwise"] = "equal"
    figures["wall"] = f"{job.seconds:.0f} s"
