"""The sbatch script on a real single-node SLURM (tools/localslurm.py): the batch shell gets
SIGUSR2, forwards it to the training step, the trainer saves and exits 75, the script requeues
the job, and the restarted job resumes from the latest checkpoint and finishes -- no human action.
(The full scenarios -- deadlines, preemption, multi-task steps -- are the e2e suite's.)"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from train_helpers import ROOT, require_tool, tiny_flags

from pyrecover_train.metrics import read_events
from pyrecover_train.report import Liveness, summarize

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SCRIPT = ROOT / "apps" / "train" / "slurm" / "submit-training-simple.sh"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    # The jobs' timelines (the script's `slurmclock mark`) stay in the test's directory.
    monkeypatch.setenv("SLURMCLOCK_DIR", str(tmp_path / "timelines"))
    localslurm = require_tool("localslurm", "local SLURM", "PYRECOVER_REQUIRE_SLURM")
    with localslurm.LocalCluster(tmp_path / "slurm", cpus=4) as c:
        yield c


def test_signal_requeue_resume_until_done(
    cluster: Any, corpus: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    args = tiny_flags(
        corpus, cache_dir, ckpt, "--training-steps", "200", "--checkpoint-frequency", "20"
    )
    job = cluster.sbatch(
        SCRIPT,
        "--time=10",
        "--signal=B:USR2@30",  # SLURM's own warning would come only near the 10-minute limit
        "--cpus-per-task=1",
        f"--output={tmp_path}/job-%j.out",
        cwd=tmp_path,
        # The manual USR2 below stands for SLURM's warning at the deadline itself (lead 0):
        # with a lead, a warning is information for the budget, not an order to stop.
        env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYRECOVER_SIGNAL_LEAD": "0"},
        script_args=["--exp_name=sl", *args],
    )
    metrics = ckpt / "sl" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and any(e["event"] == "step" for e in read_events(metrics))):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)
    # `report` from a login node (another host) while the job runs: SLURM says it is still in
    # the allocation the run started in -- running, not "killed ... lost N" (issue 30).
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    live = summarize(list(read_events(metrics)), Liveness(metrics, time.time(), host="login1"))
    assert (live.runs[-1].outcome, live.runs[-1].reason) == (
        "running",
        f"SLURM job {job} is still in the allocation it started in",
    )
    # What --signal=B:USR2@N does at the deadline: signal the batch shell only.
    cluster.run(["scancel", "--signal=USR2", "--batch", job])
    info = cluster.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=300)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", out
    assert info["RestartCnt"] == "1", out
    assert "received SIGUSR2: forwarding to the training step" in out
    assert "training step exited with status 75" in out
    assert "requeued job" in out and "requeue failed" not in out
    assert "training finished" in out

    events = list(read_events(metrics))
    stops = [e for e in events if e["event"] == "stop"]
    # A warning with lead 0 says "the end is now": a stop for time, with the deadline it set.
    assert [(s["cause"], s["exit_code"]) for s in stops] == [("time", 75), ("done", 0)]
    assert "(deadline: SIGUSR2 + lead 0.00 s)" in stops[0]["reason"], stops[0]
    resume = next(e for e in events if e["event"] == "resume")
    assert resume["restart_count"] == 1 and resume["job_id"] == job
    assert resume["step"] == stops[0]["step"]  # nothing lost: the final save was at the stop
    assert stops[-1]["step"] == 200
    # The trainer read its deadline from SLURM itself.
    start = next(e for e in events if e["event"] == "start")
    assert start["deadline_source"] in ("SLURM_JOB_END_TIME", "squeue", "scontrol")


CHAIN = ROOT / "apps" / "train" / "slurm" / "submit-chain.sh"


def test_array_and_afterany_chain_resume_without_requeue(
    cluster: Any, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """The two documented alternatives for clusters that forbid requeue, side by side: a job
    array run one task at a time (--array=1-4%1) and a chain of 4 jobs (submit-chain.sh,
    --dependency=afterany). Each job trains one step (--time-limit 1s is spent by start-up), stops
    for time (exit 75), is not requeued, and the next one resumes; the 4th finds the training
    done (3 steps) and exits at once."""
    ckpt = tmp_path / "ckpt"
    array_job, chain_jobs = _submit_array_and_chain(
        cluster, [*tiny_flags(corpus, cache_dir, ckpt), *CHAINED], tmp_path
    )
    deadline = time.monotonic() + 420
    while list(cluster.jobs()):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(1)

    logs = {
        "arr": [(tmp_path / f"array-{array_job}_{i}.out").read_text() for i in range(1, 5)],
        "chn": [(tmp_path / f"chain-{j}.out").read_text() for j in chain_jobs],
    }
    for exp, outs in logs.items():
        _assert_resumed_without_requeue(outs, ckpt / exp / "metrics.jsonl")
    for job in chain_jobs:
        info = cluster.job(job)
        assert info["JobState"] == "COMPLETED" and info["RestartCnt"] == "0", info
        assert info.get("Requeue") == "0", info


CHAINED = ["--time-limit", "1s", "--stop-margin", "0", "--training-steps", "3"]


def _submit_array_and_chain(
    cluster: Any, flags: list[str], tmp_path: Path
) -> tuple[str, list[str]]:
    """A job array of 4 (experiment "arr") and a chain of 4 jobs ("chn"); their job ids."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    array_job = cluster.sbatch(
        SCRIPT,
        "--array=1-4%1",
        "--time=10",
        "--cpus-per-task=1",
        f"--output={tmp_path}/array-%A_%a.out",
        cwd=tmp_path,
        env=env,
        script_args=["--continue", "--exp_name=arr", *flags],
    )
    chain = cluster.run(
        [
            "bash",
            str(CHAIN),
            "4",
            "--time=10",
            "--cpus-per-task=1",
            f"--output={tmp_path}/chain-%j.out",
            "--",
            "--exp_name=chn",
            *flags,
        ],
        env=env,
        cwd=tmp_path,
    )
    chain_jobs = [line.split()[2] for line in chain.stdout.splitlines()]
    assert len(chain_jobs) == 4, chain.stdout
    return array_job, chain_jobs


def _assert_resumed_without_requeue(outs: list[str], metrics: Path) -> None:
    joined = "\n".join(outs)
    for out in outs[:2]:
        assert "training step exited with status 75" in out, joined
        assert "not requeueing (the next array task / chained job resumes)" in out, joined
    assert "training finished" in outs[2] and "training finished" in outs[3], joined
    assert "requeued job" not in joined
    events = list(read_events(metrics))
    stops = [(e["cause"], e["step"]) for e in events if e["event"] == "stop"]
    assert stops == [("time", 1), ("time", 2), ("done", 3), ("done", 3)], joined
    resumes = [e for e in events if e["event"] == "resume"]
    assert [e["step"] for e in resumes] == [1, 2, 3]
    assert all(e["restart_count"] == 0 for e in resumes)  # never requeued


# A stand-in for pyrecover-train that uses slurmclock as the trainer will (TRAIN_CMD): it checks
# what the script gives it (the signal lead, SLURM's early warning), marks its final save in the
# job's timeline and exits 75; its second run reports what the first run's end took.
SCRIPT_PROBE = f"""#!{sys.executable}
import json, os, sys, time
from pathlib import Path
from slurmclock import DeadlineWatcher, JobTimeline, StopSignals, TimeBudget, restart_count

out = Path(os.environ["PROBE_OUT"])
stop = StopSignals().install()
budget = TimeBudget(DeadlineWatcher(), signals=stop, timeline=JobTimeline(),
                    initial_save_estimate=0.5, initial_exit_estimate=1.0, slack=2.0)
run = restart_count()
info = {{"lead": os.environ.get("PYRECOVER_SIGNAL_LEAD"), "argv": sys.argv[1:]}}
if run == 0:
    limit = time.monotonic() + 120
    if os.environ["PROBE_MODE"] == "requeue":
        time.sleep(40)  # SLURM's USR2@300 comes at its first 30 s tick in a 3-minute job
    decision = budget.should_stop()
    info.update(received=stop.received, stop=bool(decision), reason=decision.reason)
    (out / "ready").touch()
    while os.environ["PROBE_MODE"] == "stop" and not decision and time.monotonic() < limit:
        time.sleep(0.2)  # until `slurmclock stop` arrives
        decision = budget.should_stop()
    info.update(final_reason=decision.reason, final_cause=decision.cause)
    with budget.save(final=True):
        time.sleep(0.3)
    if os.environ["PROBE_MODE"] == "limit":  # an exit too slow for the budget: SLURM's TERM
        (out / f"run{{run}}.json").write_text(json.dumps(info))
        stop.restore()
        time.sleep(300)
else:
    info["samples"] = [[s.restart, s.seconds] for s in JobTimeline().exit_samples()]
(out / f"run{{run}}.json").write_text(json.dumps(info))
sys.exit(75 if run == 0 else 0)
"""


def _probe_env(tmp_path: Path, mode: str, bin_dir: str) -> dict[str, str]:
    """The job environment that runs SCRIPT_PROBE (written once) as the training command."""
    probe = tmp_path / "probe"
    if not probe.exists():
        probe.write_text(SCRIPT_PROBE)
        probe.chmod(0o755)
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "TRAIN_CMD": str(probe),
        "PROBE_OUT": str(tmp_path / mode),
        "PROBE_MODE": mode,
        "SLURMCLOCK_DIR": str(tmp_path / "timelines"),
        "PYRECOVER_SIGNAL_LEAD": "",
    }


def test_the_script_exports_the_lead_marks_the_end_and_honours_slurmclock_stop(
    cluster: Any, tmp_path: Path
) -> None:
    """The real script in two real jobs: (1) SLURM's USR2@300 arrives at once in a 3-minute
    job; it agrees with the end time SLURM gives, so the script does not even forward it (a
    trainer still importing would die of it) and the trainer trains on; the lead comes from the
    script's own #SBATCH line; the end of the run is marked and the next run reads it; (2)
    `slurmclock stop JOBID` makes the trainer save and exit, and the job is not requeued; (3) a
    step that outlives the time limit after its final save is ended by SLURM and requeued."""
    bin_dir = str(Path(sys.executable).parent)  # slurmclock's CLI for the batch script
    jobs = {}
    for name in ("requeue", "stop", "limit"):
        out = tmp_path / name
        out.mkdir()
        env = _probe_env(tmp_path, name, bin_dir)
        jobs[name] = cluster.sbatch(
            SCRIPT,
            "--time=1" if name == "limit" else "--time=3",
            "--cpus-per-task=1",
            f"--output={out}/job.out",
            cwd=tmp_path,
            env=env,
            script_args=["--exp_name", name],
        )
    deadline = time.monotonic() + 120
    while not (tmp_path / "stop" / "ready").exists():
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.2)
    clock = Path(bin_dir) / "slurmclock"
    said = cluster.run([str(clock), "stop", jobs["stop"]]).stdout
    assert f"asked job {jobs['stop']} to save and stop" in said

    info = cluster.wait_for(jobs["requeue"], {"COMPLETED", "FAILED", "TIMEOUT"}, timeout=300)
    log = (tmp_path / "requeue" / "job.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["RestartCnt"] == "1", log
    run0 = json.loads((tmp_path / "requeue" / "run0.json").read_text())
    assert run0["lead"] == "300" and run0["argv"][:2] == ["--experiment_name", "requeue"], run0
    assert run0["received"] is None and not run0["stop"], run0  # agreed: not even forwarded
    run1 = json.loads((tmp_path / "requeue" / "run1.json").read_text())
    ((restart, seconds),) = run1["samples"]
    assert restart == 0 and 0 < seconds < 30, run1
    assert "requeued job" in log and "warning signal lead: 300 s" in log
    assert "received SIGUSR2: agrees with the end time SLURM gives" in log

    info = cluster.wait_for(jobs["stop"], {"COMPLETED", "FAILED", "TIMEOUT"}, timeout=120)
    log = (tmp_path / "stop" / "job.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["RestartCnt"] == "0", log
    stopped = json.loads((tmp_path / "stop" / "run0.json").read_text())
    assert stopped["final_cause"] == "signal", stopped
    assert stopped["final_reason"].startswith("stop: received SIGTERM"), stopped
    assert "received SIGTERM (slurmclock stop or scancel --batch): forwarding" in log
    assert "stopped on request (SIGTERM" in log and "requeued job" not in log

    # (3) the final save is durable but the step outlives the time limit: at SLURM's TERM the
    # script requeues at once, before the step has exited (the next run resumes).
    info = cluster.wait_for(jobs["limit"], {"COMPLETED", "FAILED", "TIMEOUT"}, timeout=240)
    log = (tmp_path / "limit" / "job.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["RestartCnt"] == "1", log
    assert "received SIGTERM at the time limit: requeueing job" in log, log
    assert "already requeued at the time limit" in log, log
