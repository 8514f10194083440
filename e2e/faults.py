"""The fault matrix's drivers: each submits the shipped sbatch script (apps/train/slurm/
submit-training-simple.sh) with only ``--time`` and the fault changed, injects the fault from
outside, waits until the job is over and records what it saw; test_slurm_faults.py asserts.

The faults act on the task's own pid, which TRAIN_CMD=e2e/fault_wrapper.py writes to the job's
folder before it becomes pyrecover-train: SIGKILL, SIGSTOP kept up (SLURM sends SIGCONT with its
SIGTERM, a hung file system would not wake up), a duty cycle of SIGSTOP/SIGCONT (a slow machine,
so that a 300-step run is still training when the fault comes), SIGSEGV at a fixed step.

Each driver runs in a background thread from the session's start (see conftest), on one of three
local clusters: ``faults`` (KillWait=5, the cases that do not interfere with each other),
``kw30`` (KillWait=30, a site's default) and ``preempt`` (partition-based preemption on one node:
``requeue`` and ``cancel`` partitions under an ``urgent`` one).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from e2e_helpers import Job, JobRecord, last_step, runs, short_flags, wait_until

E2E = Path(__file__).resolve().parent
WRAPPER = E2E / "fault_wrapper.py"
CRASH_AT = 101  # checkpoints every 5 steps: every crash comes with step 100 the newest durable
MAX_FAILURES = 3  # the shipped default
# Partition-based preemption on one node (SLURM 22.05): jobs of the tier-2 partition preempt
# those of the tier-1 ones, each in its partition's mode; `debug` is never preempted.
PREEMPT_PARTITIONS = {
    "debug": "Default=YES PriorityTier=1 PreemptMode=OFF",
    "requeue": "PriorityTier=1 PreemptMode=REQUEUE",
    "cancel": "PriorityTier=1 PreemptMode=CANCEL",
    "urgent": "PriorityTier=2 PreemptMode=OFF",
}
PREEMPT_CONF = {"PreemptType": "preempt/partition_prio", "PreemptMode": "REQUEUE"}
# PYRECOVER_E2E_SLURM_DEFAULTS=1 runs the matrix at SLURM's own defaults where the test clusters
# differ (a requeued job starts cred_expire + 1 s after it ended: 121 s instead of 11 s; KillWait
# 30 s; SlurmdTimeout 300 s): the figures a user of a stock cluster meets (e2e/README.md).
SLURM_DEFAULTS = (
    {"AuthInfo": "cred_expire=120", "KillWait": "30", "SlurmdTimeout": "300"}
    if os.environ.get("PYRECOVER_E2E_SLURM_DEFAULTS") == "1"
    else {}
)
REQUEUE_EXTRA_S = 110.0 if SLURM_DEFAULTS else 0.0  # what a requeue takes more than at 10 s
# At most this many of the matrix's jobs start up (import torch, build the model) at once: the
# machine has two cores, and the time-limit scenario's allocations measure their start-up.
_STARTING = threading.Semaphore(3)


@dataclass
class Case:
    """One row of the matrix."""

    name: str
    title: str
    cluster: str  # faults | kw30 | preempt
    reference: str  # short | two-ranks | none
    fault_line: str  # the job-log line that marks the fault (its first match after `at`)


CASES = [
    Case("limit-frozen-kw5", "1a. time limit, step frozen, KillWait=5", "faults", "short",
         "received SIGTERM at the time limit"),
    Case("limit-frozen-kw30", "1b. time limit, step frozen, KillWait=30", "kw30", "short",
         "received SIGTERM at the time limit"),
    Case("limit-cut", "1c. limit cut with scontrol update", "faults", "short",
         "received SIGTERM at the time limit|training step exited"),
    Case("kill-mid-run", "2a. SIGKILL of the trainer mid-run", "faults", "short",
         "training step exited"),
    Case("kill-mid-save", "2b. SIGKILL of the trainer mid-save", "faults", "short",
         "training step exited"),
    Case("rank-killed", "3a. one of two ranks SIGKILLed", "faults", "two-ranks",
         "training step exited"),
    Case("rank-frozen", "3b. one of two ranks frozen (SIGSTOP)", "faults", "two-ranks",
         "training step exited|received SIGTERM at the time limit"),
    Case("crash-at-step", f"4. crash at step {CRASH_AT}, every time", "faults", "none",
         "training step exited"),
    Case("scancel", "5a. scancel: not requeued", "faults", "none", "received SIGTERM"),
    Case("stop", "5b. slurmclock stop, then --continue", "faults", "short", "received SIGTERM"),
    Case("preempt-requeue", "5c. preempted, PreemptMode=REQUEUE", "preempt", "short",
         "received SIGTERM"),
    Case("preempt-cancel", "5d. preempted, PreemptMode=CANCEL", "preempt", "short",
         "received SIGTERM"),
]  # fmt: skip
# Not a row: the straight 2-rank run the rank cases are compared with, on the same cluster.
TWO_RANK_REFERENCE = Case("two-rank-reference", "2 ranks, straight", "faults", "none", "")
BY_NAME = {c.name: c for c in [*CASES, TWO_RANK_REFERENCE]}


@dataclass
class FaultRun:
    """What a driver saw: the job(s), the fault's own time and facts, the final state."""

    case: Case
    job: Job
    records: list[JobRecord] = field(default_factory=list)
    fault_at: float | None = None  # epoch seconds, when the test injected the fault
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def log(self) -> str:
        return "".join(r.log for r in self.records)

    @property
    def info(self) -> dict[str, str]:
        return self.records[-1].info


# -- acting on the trainer ------------------------------------------------------------------------


def pid_of(job: Job, restart: int = 0, rank: int = 0, timeout: float = 600) -> int:
    path = job.dir / f"pid.{restart}.{rank}"
    wait_until(f"{job.name}: task {rank} of run {restart}", path.exists, timeout)
    return int(path.read_text())


def live_pid_at_step(job: Job, step: int, rank: int, timeout: float = 900) -> int:
    """The pid of ``rank`` in the run that is going once step ``step`` is logged by any run.

    A short limit on a loaded machine can end the first run before ``step`` (its deadline
    save, then a requeue): the step counter goes on in the next run, so wait for the step
    there rather than for the first run to reach it."""
    found: list[int] = []

    def ready() -> bool:
        if last_step(job.metrics) < step:
            return False
        files = sorted(job.dir.glob(f"pid.*.{rank}"), key=lambda p: int(p.name.split(".")[1]))
        pid = int(files[-1].read_text()) if files else 0
        if pid and _alive(pid):
            found.append(pid)
            return True
        return False

    wait_until(f"{job.name}: a live rank {rank} at step {step}", ready, timeout)
    return found[-1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Puppet:
    """A thread that keeps a process stopped, or slows it down (stopped ``1 - duty`` of the time),
    until the process is gone or :meth:`release` (which lets it run again)."""

    def __init__(self, pid: int, duty: float = 0.0) -> None:
        self.pid, self.duty = pid, duty
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                if self.duty <= 0:
                    time.sleep(0.02)  # SLURM's SIGCONT must not wake it for long
                    continue
                time.sleep(0.1 * (1 - self.duty))
                os.kill(self.pid, signal.SIGCONT)
                time.sleep(0.1 * self.duty)
        except ProcessLookupError:
            return

    def release(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        if _alive(self.pid):
            os.kill(self.pid, signal.SIGCONT)


@contextmanager
def starting() -> Iterator[None]:
    """Hold one of the start-up slots until the job's first run has logged a step."""
    with _STARTING:
        yield


def submit(job: Job, sbatch: list[str], flags: list[str], **env: str) -> JobRecord:
    env = {"TRAIN_CMD": str(WRAPPER), "FAULT_DIR": str(job.dir),
           "FAULT_METRICS": str(job.metrics), **env}  # fmt: skip
    return job.submit(sbatch, flags, **env)


def launch(job: Job, flags: list[str], *sbatch: str, until: int = 1, **env: str) -> JobRecord:
    """Submit (`--time=10` unless given) and wait, holding a start-up slot, for step ``until``."""
    with starting():
        record = submit(job, list(sbatch) or ["--time=10"], flags, **env)
        at_step(job, until)
    return record


def at_step(job: Job, step: int, run: int = 0, timeout: float = 600) -> int:
    wait_until(
        f"{job.name}: run {run} at step {step}",
        lambda: last_step(job.metrics, run_index=run) >= step,
        timeout,
    )
    return last_step(job.metrics, run_index=run)


def restarts(job: Job) -> int:
    info = job.state()
    return int(info.get("RestartCnt", info.get("Restarts", "0")) or 0)


def finish(run: FaultRun, record: JobRecord, timeout: float = 900) -> FaultRun:
    run.records.append(run.job.finish(record, timeout))
    run.notes["after"] = dict(run.job.state())  # still so a while later: not requeued again
    return run


def settle(run: FaultRun, seconds: float = 20.0) -> None:
    """Wait, then record the state again: a job that is over must stay over."""
    time.sleep(seconds)
    run.notes["settled"] = dict(run.job.state())


# -- the drivers ----------------------------------------------------------------------------------


def drive(case: Case, job: Job, corpus: Path, cache: Path, **kw: Any) -> FaultRun:
    run = FaultRun(case, job)
    flags = short_flags(corpus, cache, Path("ckpt"))
    t0 = time.monotonic()
    DRIVERS[re.sub(r"-kw\d+$", "", case.name)](run, flags, **kw)
    run.notes["wall"] = time.monotonic() - t0
    return run


def limit_frozen(run: FaultRun, flags: list[str], **_: Any) -> None:
    """`--time=1`; at step 20 the task is frozen and kept frozen: SLURM's SIGTERM at the limit
    cannot reach a trainer that saves, its SIGKILL comes KillWait later."""
    job = run.job
    record = launch(job, flags, "--time=1", until=20)
    run.notes["frozen_at_step"] = last_step(job.metrics, run_index=0)
    pid = pid_of(job)
    run.fault_at = time.time()
    puppet = Puppet(pid)
    try:  # frozen until SLURM kills it: a hung file system does not wake up for a signal
        wait_until(f"{job.name}: the frozen task killed", lambda: not _alive(pid), 600)
        run.notes["killed_after"] = time.time() - run.fault_at
    finally:
        puppet.release()
    finish(run, record)


def limit_cut(run: FaultRun, flags: list[str], **_: Any) -> None:
    """`--time=10`; the task slowed to a tenth (it trains on); at step 20 `scontrol update
    TimeLimit=1`: the limit comes ~40 s later, seen by the trainer or not."""
    job = run.job
    record = launch(job, flags)
    puppet = Puppet(pid_of(job), duty=0.1)
    try:
        run.notes["cut_at_step"] = at_step(job, 20)
        run.fault_at = time.time()
        job.cluster.run(["scontrol", "update", f"JobId={job.id}", "TimeLimit=1"])
        wait_until(f"{job.name}: requeued", lambda: restarts(job) >= 1, 600)
    finally:
        puppet.release()
    finish(run, record)


def kill_mid_run(run: FaultRun, flags: list[str], **_: Any) -> None:
    job = run.job
    record = launch(job, flags)
    pid = pid_of(job)
    run.notes["killed_at_step"] = at_step(job, 100)
    run.fault_at = time.time()
    os.kill(pid, signal.SIGKILL)
    finish(run, record)


def kill_mid_save(run: FaultRun, flags: list[str], **_: Any) -> None:
    """The task slowed to a tenth, so a save takes long enough to be seen: SIGKILL as soon as
    a step folder without its manifest appears (a save in flight), after step 50."""
    job = run.job
    record = launch(job, flags)
    pid = pid_of(job)
    puppet = Puppet(pid, duty=0.1)
    exp = job.ckpt / job.name
    try:
        at_step(job, 50)
        end = time.monotonic() + 300
        while time.monotonic() < end and not (saving := in_flight(exp)):
            time.sleep(0.002)
        assert saving, f"{job.name}: no save in flight seen"
        run.fault_at = time.time()
        os.kill(pid, signal.SIGKILL)
    finally:
        puppet.release()
    run.notes["killed_in"] = saving
    run.notes["still_in_flight"] = sorted(p.name for p in in_flight(exp))  # the kill's debris
    finish(run, record)


def in_flight(exp: Path) -> list[Path]:
    """Step folders without a manifest: saves begun and not committed."""
    return [p for p in exp.glob("step-*") if p.is_dir() and not (p / "manifest.json").exists()]


def two_ranks(job: Job, flags: list[str], time_limit: str, master_port: int) -> JobRecord:
    return submit(
        job,
        [f"--time={time_limit}", "--ntasks-per-node=2"],
        ["--distributed", *flags],
        MASTER_ADDR="127.0.0.1",  # the test node's name does not resolve; a real one does
        MASTER_PORT=str(master_port),  # job ids repeat across the session's clusters
    )


def rank_killed(run: FaultRun, flags: list[str], *, master_port: int, **_: Any) -> None:
    job = run.job
    with starting():
        record = two_ranks(job, flags, "10", master_port)
        at_step(job, 1)
    pid = pid_of(job, rank=1)
    run.notes["killed_at_step"] = at_step(job, 100)
    run.fault_at = time.time()
    os.kill(pid, signal.SIGKILL)
    finish(run, record)


def rank_frozen(run: FaultRun, flags: list[str], *, master_port: int, **_: Any) -> None:
    """Rank 1 frozen at step 100 and kept frozen. Its peers notice (ddpkit's heartbeats) and
    exit; without that, the step hangs in a collective until the 2-minute limit, whose SIGTERM
    path brings the job back too."""
    job = run.job
    with starting():
        record = two_ranks(job, flags, "2", master_port)
        at_step(job, 1)
    pid = live_pid_at_step(job, 100, rank=1)
    run.notes["frozen_at_step"] = last_step(job.metrics)
    run.fault_at = time.time()
    puppet = Puppet(pid)
    # An earlier run of the job may have ended already (its deadline save, under load): only
    # a step that exits after the freeze is the frozen one.
    before = job.log().count("training step exited")
    try:
        wait_until(
            f"{job.name}: the step gone",
            lambda: job.log().count("training step exited") > before,
            600,
        )
        run.notes["step_gone_at"] = time.time()
    finally:
        puppet.release()
    finish(run, record)


def two_rank_reference(run: FaultRun, flags: list[str], *, master_port: int, **_: Any) -> None:
    with starting():
        record = two_ranks(run.job, flags, "10", master_port)
        at_step(run.job, 1)
    finish(run, record)


def crash_at_step(run: FaultRun, flags: list[str], **_: Any) -> None:
    job = run.job
    record = launch(job, flags, FAULT_CRASH_AT=str(CRASH_AT))
    run.fault_at = time.time()
    finish(run, record)
    settle(run)


def scancel(run: FaultRun, flags: list[str], **_: Any) -> None:
    job = run.job
    record = launch(job, flags, until=50)
    run.notes["cancelled_at_step"] = last_step(job.metrics, run_index=0)
    run.fault_at = time.time()
    job.cluster.run(["scancel", job.id])
    finish(run, record)
    settle(run)


def stop(run: FaultRun, flags: list[str], **_: Any) -> None:
    job = run.job
    record = launch(job, flags, until=50)
    run.notes["stopped_at_step"] = last_step(job.metrics, run_index=0)
    run.fault_at = time.time()
    run.notes["said"] = job.cluster.run(["slurmclock", "stop", job.id]).stdout
    finish(run, record)
    settle(run, 10)
    run.notes["stopped_job"] = job.id
    run.records.append(job.finish(submit(job, ["--time=10"], ["--continue", *flags]), 900))


DRIVERS: dict[str, Callable[..., None]] = {
    "limit-frozen": limit_frozen,
    "limit-cut": limit_cut,
    "kill-mid-run": kill_mid_run,
    "kill-mid-save": kill_mid_save,
    "rank-killed": rank_killed,
    "rank-frozen": rank_frozen,
    "two-rank-reference": two_rank_reference,
    "crash-at-step": crash_at_step,
    "scancel": scancel,
    "stop": stop,
}


def drive_preemption(cluster: Any, workdir: Path, corpus: Path, cache: Path) -> list[FaultRun]:
    """A job in the `requeue` and one in the `cancel` partition, slowed to a tenth so both still
    train; then an `urgent` job that needs the node's two CPUs preempts both at once."""
    flags = short_flags(corpus, cache, Path("ckpt"))
    out, puppets = [], []
    t0 = time.monotonic()
    for name, partition in (("preempt-requeue", "requeue"), ("preempt-cancel", "cancel")):
        job = Job(cluster, workdir, name)
        with starting():
            record = submit(job, ["--time=10", f"--partition={partition}"], flags)
            at_step(job, 1)
        puppets.append(Puppet(pid_of(job), duty=0.1))
        run = FaultRun(BY_NAME[name], job)
        run.records.append(record)
        out.append(run)
    try:
        for run in out:
            run.notes["preempted_at_step"] = at_step(run.job, 10)
        urgent = cluster.sbatch("#!/bin/bash\nsleep 5\n", "--partition=urgent", "--cpus-per-task=2",
                                f"--output={workdir}/urgent.out")  # fmt: skip
        for run in out:
            run.fault_at = time.time()
            run.notes["urgent"] = urgent
        for run in out:
            wait_until(f"{run.job.name}: preempted", lambda j=run.job: restarts(j) >= 1, 300)
    finally:
        for puppet in puppets:
            puppet.release()
    for run in out:
        finish(run, run.records.pop())
        run.notes["wall"] = time.monotonic() - t0
    return out


# -- reading a job log ----------------------------------------------------------------------------

_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] submit-training-simple: (.*)$")


def log_lines(text: str) -> list[tuple[float, str]]:
    """(epoch seconds, message) of each line the script and its supervisor wrote."""
    out = []
    for line in text.splitlines():
        if m := _LINE.match(line):
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            out.append((at, m.group(2)))
    return out


# Training goes on again: the next allocation's first line (a requeue), or the supervisor's line
# once the trainer it started again in the allocation has done its first step.
BACK = re.compile(r"job \S+, restart \d+|training again: ")


def back_after(log: str, fault: str, since: float | None) -> float | None:
    """Seconds from the job-log line that marks the fault (``fault``: a regex; the first match
    at or after ``since``, to the second) to the next allocation's first line or, when the step
    started again in the allocation, to the line saying its first step was done; None if
    neither came."""
    lines = log_lines(log)
    start = 0.0 if since is None else float(int(since))
    t0 = next((t for t, said in lines if t >= start and re.search(fault, said)), None)
    if t0 is None:
        return None
    t1 = next((t for t, said in lines if t >= t0 and BACK.match(said)), None)
    return None if t1 is None else t1 - t0


def first_step_again(log: str, since: float) -> float | None:
    """Epoch seconds (whole) of the job-log line saying the step started again in the
    allocation has done its first step, the first at or after ``since``; None if none."""
    lines = log_lines(log)
    return next(
        (t for t, said in lines if t >= int(since) and said.startswith("training again: ")), None
    )


def lost_steps(metrics: Path) -> int:
    """Steps trained and not kept: each run's last logged step minus where the next resumed."""
    rs = runs(metrics)
    lost = 0
    for run, nxt in zip(rs, rs[1:], strict=False):
        last = max((e["step"] for e in run if e["event"] == "step"), default=0)
        resume = next((e["step"] for e in nxt if e["event"] == "resume"), 0)
        lost += max(0, last - resume)
    return lost
