"""One allocation of a job, with every package on its side of a contract (DESIGN.md,
"Contracts"): pyrecover-train (through slurmclock's loop) writes the job's timeline and exits
with slurmclock's codes; the real ``slurmclock supervise`` reads both and requeues;
``slurmclock timeline`` reads the timeline from a login shell; the checkpoint metadata the app
writes is read by ckptstore's retention and slurmclock's budget."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from train_helpers import make_corpus, tiny_flags

import ckptstore
import ddpkit
import slurmclock
from pyrecover_train import trainer
from slurmclock.supervisor import SuperviseConfig
from slurmclock.supervisor.history import newest_checkpoint
from slurmclock.supervisor.verdict import end_kind

START_S = 300  # a trainer importing torch on a loaded 2-core machine


@pytest.fixture(scope="module")
def allocation(tmp_path_factory: pytest.TempPathFactory, make_job: Any) -> dict[str, Any]:
    """pyrecover-train under the supervisor until its first checkpoints, then SLURM's warning
    (SIGUSR2, no known lead: stop now): the final save, exit 75, a requeue."""
    tmp = tmp_path_factory.mktemp("allocation")
    job = make_job(tmp)
    ckpt = tmp / "ckpt"
    flags = tiny_flags(
        make_corpus(tmp / "corpus.parquet"),
        tmp / "cache",
        ckpt,
        "--training-steps",
        "100000",
        "--checkpoint-frequency",
        "3",
        "--eval-every",
        "3",
        "--eval-batches",
        "1",
        "--keep-last",
        "0",
    )
    step = [sys.executable, "-m", "pyrecover_train", *flags]
    argv = [sys.executable, "-m", "slurmclock", "supervise", "--", *step]
    with subprocess.Popen(
        argv, env=job.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        try:
            wait_for_checkpoints(job.timeline, proc, 2)
            proc.send_signal(signal.SIGUSR2)
            log, _ = proc.communicate(timeout=START_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    return {"job": job, "ckpt": ckpt, "log": log, "rc": proc.returncode}


def wait_for_checkpoints(timeline: Path, proc: subprocess.Popen[str], n: int) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and proc.poll() is None:
        if timeline.exists() and timeline.read_text().count('"checkpoint"') >= n:
            return
        time.sleep(0.2)
    out = proc.stdout.read() if proc.poll() is not None and proc.stdout else "(running)"
    pytest.fail(f"no {n} checkpoints in the job's timeline {timeline}: {out}")


def test_exit_codes_agree_across_the_packages() -> None:
    assert slurmclock.EXIT_PEER_LOST == ddpkit.EXIT_PEER_LOST
    assert slurmclock.EXIT_STOPPED == ddpkit.faults.EXIT_STOPPED  # the code it refuses to use
    assert slurmclock.EXIT_ERROR == trainer.EXIT_ERROR
    assert slurmclock.EXIT_STORE_UNAVAILABLE == trainer.EXIT_STORE_UNAVAILABLE == 74
    assert end_kind(trainer.EXIT_STORE_UNAVAILABLE, None, frozenset()) == "store"  # not a failure
    assert slurmclock.EXIT_USAGE in SuperviseConfig().no_retry  # never retried by default
    with pytest.raises(ddpkit.DistConfigError):  # ddpkit refuses to mean "stopped, resume"
        ddpkit.WatchdogOptions(exit_code=slurmclock.EXIT_STOPPED)
    assert end_kind(slurmclock.EXIT_STOPPED, None, frozenset()) == "stopped"
    assert end_kind(slurmclock.EXIT_PEER_LOST, None, frozenset()) == "failed"


def test_a_usage_error_of_the_app_is_not_retried(job: Any) -> None:
    step = [sys.executable, "-m", "pyrecover_train", "--no-such-flag"]
    argv = [sys.executable, "-m", "slurmclock", "supervise", "--", *step]
    out = subprocess.run(argv, env=job.env, capture_output=True, text=True, timeout=START_S)
    assert out.returncode == slurmclock.EXIT_USAGE, out.stdout + out.stderr
    assert "a usage error, a retry cannot help" in out.stdout
    assert not any(call.startswith("scontrol requeue") for call in job.calls)


def test_the_stopped_app_exits_75_and_the_supervisor_requeues(allocation: dict[str, Any]) -> None:
    log, job = allocation["log"], allocation["job"]
    assert f"training step exited with status {slurmclock.EXIT_STOPPED}" in log, log
    assert "stopped early with steps left: requeueing" in log, log
    assert allocation["rc"] == 0 and "scontrol requeue 4242" in job.calls, log


def test_the_apps_timeline_is_read_by_slurmclock_from_a_login_shell(
    allocation: dict[str, Any],
) -> None:
    job = allocation["job"]
    login = {k: v for k, v in job.env.items() if not k.startswith("SLURM_")}
    argv = [sys.executable, "-m", "slurmclock", "timeline", "--json", job.id]
    out = subprocess.run(argv, env=login, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["path"] == str(job.timeline) and shown["unreadable_lines"] == []
    names = [e["event"] for e in shown["events"]]
    assert names[0] == "start" and names[-3:] == ["saved", "exited", "requeued"], names
    assert {"checkpoint", "signal"} <= set(names), names
    assert set(names) <= set(slurmclock.EVENTS)
    events = [slurmclock.Event(e["event"], e["time"], e["restart"], e) for e in shown["events"]]
    # The supervisor's "newest checkpoint" is the checkpoint ckptstore has as latest.
    store = ckptstore.CheckpointStore(str(allocation["ckpt"]), experiment="default-exp")
    assert newest_checkpoint(events) == store.latest_step(), names
    assert shown["events"][-2]["rc"] == slurmclock.EXIT_STOPPED


def test_the_apps_checkpoint_metadata_is_read_by_the_packages(allocation: dict[str, Any]) -> None:
    store = ckptstore.CheckpointStore(str(allocation["ckpt"]), experiment="default-exp")
    metas = {step: dict(store.manifest(step).metadata) for step in store.steps()}
    assert len(metas) >= 2, metas
    # slurmclock's budget figures: what the next allocation starts from.
    budget = slurmclock.TimeBudget(None)
    budget.load_state_dict(metas[max(metas)]["time_budget"])
    assert budget.has_save_estimate and budget.steps_measured == 0
    # ckptstore's keep_best reads the app's validation loss under the name it expects.
    policy = ckptstore.RetentionPolicy(keep_best=1)
    scored = {s: m[policy.best_metric] for s, m in metas.items() if policy.best_metric in m}
    assert scored and all(math.isfinite(v) for v in scored.values()), metas
    assert policy.best(metas, sorted(metas)) == [min(scored, key=lambda s: (scored[s], -s))]
