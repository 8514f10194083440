"""Scenario 9: the fault matrix. Whatever ends a step -- the time limit while the step is stuck
(KillWait 5 and 30) or after a cut, SIGKILL mid-run or mid-save, a dead or frozen rank,
preemption in REQUEUE and CANCEL mode -- the shipped sbatch script brings the training back (a
crash: started again inside the allocation, no requeue; SLURM's ends: requeued) and it finishes
bitwise equal to a straight run; a crash at the same step every time stops the chain after three
tries with one line; scancel and slurmclock stop are not requeued. Each case is the
shipped script with only ``--time`` and the fault changed (TRAIN_CMD=e2e/fault_wrapper.py writes
the task's pid for the fault, then becomes pyrecover-train). Drivers: faults.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from faults import (
    BY_NAME,
    CASES,
    CRASH_AT,
    MAX_FAILURES,
    REQUEUE_EXTRA_S,
    SLURM_DEFAULTS,
    FaultRun,
    back_after,
    first_step_again,
    log_lines,
)
from faults import lost_steps as count_lost
from train_helpers import assert_bitwise_equal, final_state

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(2400)]

TARGET_BACK_S = 30.0  # fault -> the job running again, on the local SLURM
# SIGKILL of the trainer -> its first step again, inside the allocation on one node; where the
# trainer's own start-up (imports, model, resume: the machine's load) takes longer, what the
# supervisor adds to it must stay under SUPERVISOR_S.
TARGET_AGAIN_S = 20.0
SUPERVISOR_S = 5.0
DEAD_RANK_S = 30.0  # a dead rank: every rank gone within
FROZEN_RANK_S = 60.0  # a frozen rank: every rank gone within


@pytest.fixture
def long_faults(fault_matrix: Any, cluster: Any) -> Any:
    """The matrix (``cluster`` first: without SLURM the tests skip, or fail where required)."""
    assert fault_matrix is not None, "the fault matrix was not started"
    return fault_matrix


def result(matrix: Any, name: str) -> FaultRun:
    if BY_NAME[name].cluster == "preempt":
        runs = matrix.background.result("preemption", timeout=2000)
        return next(r for r in runs if r.case.name == name)
    matrix.background.result("faults", timeout=600)  # the drivers were started
    run: FaultRun = matrix.background.result(name, timeout=2000)
    return run


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_fault(name: str, long_faults: Any, short_reference: Path, figures: dict[str, Any]) -> None:
    """9. fault matrix"""
    run = result(long_faults, name)
    job, log = run.job, run.log
    figures["case"] = run.case.title
    figures["wall"] = f"{run.notes['wall']:.0f} s"
    CHECKS[re.sub(r"-kw\d+$", "", name)](run, log, figures)
    info = run.info
    if run.case.reference == "none":
        return
    # Came back as often as needed, finished, and stayed finished: never requeued once done.
    assert info["JobState"] == "COMPLETED", log
    assert run.notes["after"]["JobState"] == "COMPLETED", run.notes["after"]
    assert "training finished" in log_messages(run.records[-1].log)[-1], log
    allocations = len(runs_of(log))
    assert allocations == sum(int(r.info["RestartCnt"]) + 1 for r in run.records), log
    figures["allocations"] = allocations
    figures["lost steps"] = count_lost(job.metrics)
    back = back_after(log, run.case.fault_line, run.fault_at)
    if name != "stop":  # a user's stop: not back until the user resubmits
        assert back is not None, log
        figures["back in"] = f"{back:.0f} s"
        run.notes["back_s"] = back
    # Bitwise equal to the straight run of the same configuration.
    ref = short_reference if run.case.reference == "short" else reference_of(long_faults)
    _, want = final_state(*ref) if isinstance(ref, tuple) else final_state(ref)
    manifest, got = final_state(job.ckpt, job.name)
    assert manifest.step == 300
    assert_bitwise_equal(want, got)
    figures["bitwise"] = "equal"
    if back is not None and not restarted_here(log):  # then: started_again_in_the_allocation
        kw30 = name == "limit-frozen-kw30" or bool(SLURM_DEFAULTS)
        limit = TARGET_BACK_S + REQUEUE_EXTRA_S + (30.0 if kw30 else 0.0)
        # KillWait=30 and a frozen step: SLURM keeps the job COMPLETING until its SIGKILL, 30 s
        # after the SIGTERM; the requeue, accepted at once, waits for that.
        assert back <= limit, f"back after {back:.0f} s (target {limit:.0f} s)\n{log}"
    if "deferred" in run.notes:  # a timing target, checked once the chain is known to be fine
        ok, why = run.notes["deferred"]
        assert ok, why


def reference_of(matrix: Any) -> tuple[Path, str]:
    run: FaultRun = matrix.background.result("two-rank-reference", timeout=2000)
    assert run.info["JobState"] == "COMPLETED", run.log
    return run.job.ckpt, run.job.name


def restarted_here(log: str) -> bool:
    """Did the supervisor start the step again inside the allocation (no requeue)?"""
    return any("): starting it again in this allocation (" in m for m in log_messages(log))


def log_messages(text: str) -> list[str]:
    return [said for _, said in log_lines(text)]


def runs_of(log: str) -> list[str]:
    """The first line of each allocation."""
    return [said for said in log_messages(log) if re.match(r"job \S+, restart \d+", said)]


def events_of(run: FaultRun) -> list[str]:
    """The job's timeline (what `slurmclock timeline` prints), for the last job of the run."""
    job = run.job
    out = job.cluster.run(
        [sys.executable, "-m", "slurmclock", "timeline", "--job-id", job.id],
        env={
            "SLURMCLOCK_DIR": str(job.dir / "timelines"),
            "SLURM_CLUSTER_NAME": job.cluster.cluster_name,
        },
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


# -- per case --------------------------------------------------------------------------------------


def limit_frozen(run: FaultRun, log: str, figures: dict[str, Any]) -> None:
    msgs = log_messages(log)
    assert any(m.startswith("received SIGTERM at the time limit: requeueing job") for m in msgs)
    assert any(m.startswith(f"requeued job {run.job.id} (restart 1)") for m in msgs), log
    assert any("kind=limit" in line for line in events_of(run))
    assert not re.search(r"stopped at step \d+/300 \(stop: received SIGTERM", run.records[0].log)
    figures["frozen at step"] = run.notes["frozen_at_step"]


def limit_cut(run: FaultRun, log: str, figures: dict[str, Any]) -> None:
    msgs = log_messages(log)
    at_limit = any(m.startswith("received SIGTERM at the time limit: requeueing") for m in msgs)
    stopped = any(m.startswith("stopped early with steps left: requeueing") for m in msgs)
    assert at_limit or stopped, log
    figures["how"] = "SIGTERM at the cut limit" if at_limit else "trainer stopped in time (75)"


def kill_mid_run(run: FaultRun, log: str, figures: dict[str, Any]) -> None:
    kill_mid_run_common(run, log, figures)
    assert count_lost(run.job.metrics) <= 5 + 2  # a save every 5 steps; the kill lands late
    figures["killed at step"] = run.notes["killed_at_step"]


def started_again_in_the_allocation(run: FaultRun, log: str, figures: dict[str, Any]) -> None:
    """A failure with time left: the step starts again at once (no requeue, no queue), and its
    first step comes TARGET_AGAIN_S after the fault (the job log's timestamps)."""
    msgs = log_messages(log)
    assert any("): starting it again in this allocation (" in m for m in msgs), log
    assert not any(m.startswith("requeued job") for m in msgs), log
    assert run.fault_at is not None
    again = first_step_again(log, run.fault_at)
    assert again is not None, log
    seconds = again - int(run.fault_at)
    said = next(m for m in msgs if m.startswith("training again: "))
    startup = float(re.search(r"\(start-up (\d+) s\)", said).group(1))  # type: ignore[union-attr]
    figures["first step again"] = f"{seconds:.0f} s (start-up {startup:.0f} s)"
    allowed = max(TARGET_AGAIN_S, startup + SUPERVISOR_S)
    run.notes["deferred"] = (
        seconds <= allowed,
        f"first step {seconds:.0f} s after the fault (allowed {allowed:.0f} s)\n{log}",
    )


def kill_mid_save(run: FaultRun, log: str, figures: dict[str, Any]) -> None:
    kill_mid_run_common(run, log, figures)
    killed_in = run.notes["killed_in"]
    assert killed_in, "no save was in flight"
    figures["killed in"] = ", ".join(p.name for p in killed_in)
    figures["left"] = ", ".join(run.notes["still_in_flight"]) or "-"
    # The next run resumed from the newest committed checkpoint, before the interrupted one.
    interrupted = min(int(p.name.split("-")[1]) for p in killed_in)
    resumes = [int(m.group(1)) for m in re.finditer(r"resumed from step (\d+)", log)]
    assert resumes and resumes[0] < interrupted, (resumes, interrupted, log)


def kill_mid_run_common(run: FaultRun, log: str, figures: dict[str, Any]) -> None:
    msgs = log_messages(log)
    assert "training step exited with status 137" in msgs, log
    assert any("failure 1 of 3 in a row" in m for m in msgs), log
    started_again_in_the_allocation(run, log, figures)


def rank_killed(run: FaultRun, log: str, figures: dict[str, Any]) -> None:
    lines = log_lines(log)
    assert run.fault_at is not None
    gone = next(t for t, m in lines if t >= int(run.fault_at) and "training step exited" in m)
    figures["ranks gone in"] = f"{gone - int(run.fault_at):.0f} s"
    assert any("failure 1 of 3 in a row" in m for _, m in lines), log
    assert gone - int(run.fault_at) <= DEAD_RANK_S, log
    started_again_in_the_allocation(run, log, figures)


def rank_frozen(run: FaultRun, log: str, figures: dict[str, Any]) -> None:
    assert run.fault_at is not None
    gone = run.notes["step_gone_at"] - run.fault_at
    figures["ranks gone in"] = f"{gone:.0f} s"
    # The chain lives either way (the time limit's SIGTERM brings it back); the target is that
    # ddpkit's heartbeats end the step within a minute, not the collective's timeout or the limit.
    # Then the step starts again in the allocation, or (2-minute limit, a loaded machine's
    # start-up) the job is requeued because the time left does not hold a restart: both right.
    msgs = log_messages(log)
    assert restarted_here(log) or any(
        " in this allocation: requeueing to resume" in m for m in msgs
    ), log
    figures["then"] = "started again here" if restarted_here(log) else "requeued (no time here)"
    run.notes["deferred"] = (
        gone <= FROZEN_RANK_S,
        f"the step ended {gone:.0f} s after rank 1 froze (target {FROZEN_RANK_S:.0f} s: "
        "ddpkit's heartbeat watchdog)\n" + log,
    )


def crash_at_step(run: FaultRun, log: str, figures: dict[str, Any]) -> None:
    info, settled = run.info, run.notes["settled"]
    msgs = log_messages(log)
    gave_up = [m for m in msgs if m.startswith("gave up")]
    assert len(gave_up) == 1, log
    line = gave_up[0]
    assert f"failed {MAX_FAILURES} times in a row at checkpoint step {CRASH_AT - 1}" in line, line
    assert "killed by SIGSEGV" in line and "submit again with --continue" in line, line
    # All three tries in the one allocation (time left for each), then no requeue.
    assert info["JobState"] == "FAILED" and info["RestartCnt"] == "0", info
    assert settled["JobState"] == "FAILED" and settled["RestartCnt"] == info["RestartCnt"]
    assert len(runs_of(log)) == 1 and msgs.count("training step exited with status 139") == 3
    timeline = events_of(run)
    assert sum(bool(re.search(r"run \d+  failed ", t)) for t in timeline) == MAX_FAILURES
    (said,) = [t for t in timeline if "gave_up" in t]
    assert line in said, timeline  # the same one line
    figures["allocations"] = len(runs_of(log))
    figures["gave up"] = line[:90] + "..."
    back = back_after(log, "training step exited", run.fault_at)
    figures["back in"] = "-" if back is None else f"{back:.0f} s (between tries, in the allocation)"


def scancel(run: FaultRun, log: str, figures: dict[str, Any]) -> None:
    info, settled = run.info, run.notes["settled"]
    assert info["JobState"] == "CANCELLED" and info["RestartCnt"] == "0", info
    assert settled["JobState"] == "CANCELLED" and settled["RestartCnt"] == "0", settled
    msgs = log_messages(log)
    assert any(m.startswith("received SIGTERM: the job was cancelled (scancel)") for m in msgs)
    assert not any("requeued job" in m for m in msgs), log
    figures["allocations"] = 1
    figures["requeued"] = "no"


def stop(run: FaultRun, log: str, figures: dict[str, Any]) -> None:
    first, second = run.records
    assert first.info["JobState"] == "COMPLETED" and first.info["RestartCnt"] == "0", first.log
    assert run.notes["settled"]["JobState"] == "COMPLETED", run.notes["settled"]
    assert run.notes["settled"]["JobId"] == first.job_id
    assert f"asked job {first.job_id} to save and stop" in run.notes["said"]
    msgs = log_messages(first.log)
    assert any(m.startswith("stopped on request (SIGTERM to the batch script") for m in msgs)
    assert "resumed from step" in second.log
    figures["requeued"] = "no (resubmitted with --continue)"


def preempt_requeue(run: FaultRun, log: str, figures: dict[str, Any]) -> None:
    msgs = log_messages(log)
    assert any(m.startswith("received SIGTERM: SLURM requeued this job") for m in msgs), log
    assert not any(m.startswith("requeued job") for m in msgs[: _first_restart(msgs)]), log


def preempt_cancel(run: FaultRun, log: str, figures: dict[str, Any]) -> None:
    msgs = log_messages(log)
    said = "received SIGTERM at preemption (PreemptMode=CANCEL): requeueing job"
    assert any(m.startswith(said) for m in msgs), log


def _first_restart(msgs: list[str]) -> int:
    return next(i for i, m in enumerate(msgs) if re.match(r"job \S+, restart 1", m))


CHECKS = {
    "limit-frozen": limit_frozen,
    "limit-cut": limit_cut,
    "kill-mid-run": kill_mid_run,
    "kill-mid-save": kill_mid_save,
    "rank-killed": rank_killed,
    "rank-frozen": rank_frozen,
    "crash-at-step": crash_at_step,
    "scancel": scancel,
    "stop": stop,
    "preempt-requeue": preempt_requeue,
    "preempt-cancel": preempt_cancel,
}
