"""Against a real SLURM (slurmctld + slurmd on 127.0.0.1, from tools/localslurm.py).

All jobs are submitted at once when the module starts (the node has 8 CPUs); each test then
waits for what its job wrote. Skipped where slurm-wlm is absent, unless PYRECOVER_REQUIRE_SLURM=1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from slurmclock import CommandError, Deadline, Slurm, SubprocessRunner, find_deadline

pytestmark = pytest.mark.slurm

README = Path(__file__).resolve().parents[1] / "README.md"
PY = sys.executable

PRELUDE = f"""#!{PY}
import json, os, sys, time
from pathlib import Path

OUT = Path(sys.argv[1])


def write(name, data):
    tmp = OUT / (name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, OUT / name)  # the test never reads half a file
"""

DEADLINE_PROBE = (
    PRELUDE
    + """
import subprocess
from slurmclock import DeadlineWatcher

w = DeadlineWatcher(poll_interval=1.0, background=False)  # polls inside get(): counted
first = w.get()
for _ in range(1000):
    w.get()  # a thousand "steps" inside one poll interval
polls = w.polls
cli = subprocess.run([sys.executable, "-m", "slurmclock", "status", "--json"],
                     capture_output=True, text=True, timeout=60)
write("first.json", {"end": first.end, "source": first.source, "job": first.job_id,
                     "polls": polls, "cli": cli.stdout, "cli_err": cli.stderr})
end = time.monotonic() + 240
while not (OUT / "go").exists() and time.monotonic() < end:
    time.sleep(0.2)
# Let the poll interval pass: 1 s asked, longer when the first squeue was slow (20x its time,
# the watcher's back-off for a loaded controller; CI once saw the old end after a fixed 1.2 s).
interval = w.next_poll_in
time.sleep(interval + 0.2)
second = w.get()
write("second.json", {"end": second.end, "source": second.source, "polls": w.polls,
                      "interval": interval})
"""
)

# The shipped defaults (a background poll every 5 s on rank 0): how soon is a limit cut with
# `scontrol update` seen? Every get() is timed too: the loop's own hiccups on a busy machine.
SHORTENED_PROBE = (
    PRELUDE
    + """
from slurmclock import DeadlineWatcher

w = DeadlineWatcher()
first = w.get()
write("first.json", {"end": first.end, "poll_interval": w.poll_interval,
                     "background": w.background})
limit = time.monotonic() + 400
gap, slowest_get, polls = 0.0, 0.0, []
last = time.monotonic()
while time.monotonic() < limit:
    started = time.monotonic()
    d = w.get()
    slowest_get = max(slowest_get, time.monotonic() - started)
    gap, last = max(gap, started - last), started
    if w.last_poll_seconds is not None:
        polls.append(w.last_poll_seconds)
    if d.end != first.end:
        write("seen.json", {"end": d.end, "seen_at": time.time(), "loop_gap": gap,
                            "slowest_get": slowest_get, "slowest_poll": max(polls),
                            "polls": w.polls})
        break
    time.sleep(0.05)
"""
)

SIGNAL_PROBE = (
    PRELUDE
    + """
from slurmclock import StopSignals

stop = StopSignals().install()
write("ready.json", {"pid": os.getpid()})
stop.wait(timeout=240)
write("result.json", {"received": stop.received, "count": stop.count})
"""
)

# An accepted requeue makes SLURM end this very run: SIGTERM at once, SIGKILL KillWait (5 s)
# later. Ignoring SIGTERM (inherited by scontrol) leaves those 5 s to write first.json; without
# it a busy machine may kill the probe between scontrol's exit and the write.
REQUEUE_PROBE = (
    PRELUDE
    + """
import signal
from slurmclock import requeue, restart_count

n = restart_count()
print(f"run {n}: SLURM_RESTART_COUNT={os.environ.get('SLURM_RESTART_COUNT')}", flush=True)
if n == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    result = requeue()
    write("first.json", {"ok": result.ok, "message": result.message,
                         "env": os.environ.get("SLURM_RESTART_COUNT")})
    print(f"run 0: {result.message}", flush=True)
    if result.ok:
        time.sleep(300)  # SLURM ends this run and starts the job again
else:
    write("second.json", {"restart_count": n, "env": os.environ.get("SLURM_RESTART_COUNT")})
"""
)


# Two budgets see the same SLURM warning: one knows the deadline (squeue), one does not.
BUDGET_PROBE = (
    PRELUDE
    + """
from slurmclock import DeadlineWatcher, StopSignals, TimeBudget

stop = StopSignals().install()
small = dict(signals=stop, initial_save_estimate=0.5, initial_exit_estimate=1.0, slack=2.0)
known = TimeBudget(DeadlineWatcher(poll_interval=5.0), **small)
blind = TimeBudget(None, **small)
end = known.deadline().end
write("ready.json", {"end": end, "lead": known.config.signal_lead})
stops = {}
limit = time.monotonic() + 300
while "known" not in stops and time.monotonic() < limit:
    with known.step():
        time.sleep(0.2)
    blind.record_step(0.2)
    for name, budget in (("known", known), ("blind", blind)):
        decision = budget.should_stop()
        if decision and name not in stops:
            stops[name] = {"left": end - time.time(), "reason": decision.reason,
                           "cause": decision.cause}
at = stop.received_at
write("result.json", {"usr2_left": None if at is None else end - at, "stops": stops,
                      "received": stop.received, "lead": known.config.signal_lead})
"""
)

# One job, two runs: the first makes its final save and exits 75, the batch script marks the
# exit and requeues; the second reads what the end of the first took from the job's timeline.
TIMELINE_PROBE = (
    PRELUDE
    + """
from slurmclock import JobTimeline, TimeBudget, restart_count

timeline = JobTimeline()
budget = TimeBudget(None, timeline=timeline)
if restart_count() == 0:
    with budget.save(final=True):
        time.sleep(0.3)
    write("first.json", {"path": str(timeline.path)})
    time.sleep(0.5)  # a trainer's teardown
    sys.exit(75)
write("second.json", {
    "exit_estimate": budget.exit_estimate,
    "samples": [[s.restart, s.seconds, s.exit_s] for s in timeline.exit_samples()],
    "events": [[e.name, e.restart] for e in timeline.events()],
    "state": budget.state_dict()["exits"],
})
"""
)


MPI_RANK = """
import json, os, sys
import slurmclock
said = {"leads": slurmclock.watches_the_clock(), "wrote": slurmclock.JobTimeline().mark("start"),
        "procid": os.environ.get("SLURM_PROCID")}
with open(os.path.join(sys.argv[1], f"said-{os.getpid()}.json"), "w") as f:
    json.dump(said, f)  # a file each: mpirun interleaves its ranks' standard output
"""


def mpirun_job_script(rank: Path) -> str | None:
    """Open MPI's mpirun in the batch script, three ranks (None without mpirun here)."""
    exe = shutil.which("mpirun")
    if exe is None:
        return None
    root = " --allow-run-as-root" if os.geteuid() == 0 else ""
    return f"""#!/bin/bash
export TMPDIR="$1"  # mpirun's session folder: the job's own
{exe} -n 3{root} --oversubscribe {PY} {rank} "$1"
"""


def timeline_job_script(probe: Path) -> str:
    clock = Path(PY).parent / "slurmclock"
    return f"""#!/bin/bash
{clock} mark start
{PY} {probe} "$@"
rc=$?
{clock} mark exited rc=$rc
if [ "$rc" = 75 ]; then
    trap 'exit 0' TERM  # an accepted requeue ends this run at once
    {clock} requeue
fi
exit 0
"""


def readme_forwarding_script(command: str) -> str:
    """The README's bash pattern, verbatim but for the training command."""
    text = README.read_text()
    block = re.search(r"<!-- forward-signal -->\n```bash\n(.*?)```", text, flags=re.DOTALL)
    assert block, "README lost its forward-signal block"
    script = block.group(1)
    assert 'srun python train.py "$@" &' in script
    return script.replace("python train.py", command)


class Job:
    def __init__(
        self,
        cluster: Any,
        root: Path,
        name: str,
        script: str,
        args: Sequence[str],
        env: dict[str, str] | None = None,
    ):
        self.cluster, self.name = cluster, name
        self.dir = root / name
        self.dir.mkdir()
        path = self.dir / "job"
        path.write_text(script)
        path.chmod(0o755)
        self.log = self.dir / "slurm.log"
        self.id = cluster.sbatch(
            path,
            *args,
            "-o",
            str(self.log),
            "--open-mode=append",  # a requeued run must not erase the first run's output
            "-J",
            name,
            script_args=[str(self.dir)],
            env={"PYRECOVER_END_TIME": "", "SLURMCLOCK_DIR": str(self.dir), **(env or {})},
            cwd=self.dir,
        )

    def wait(self, name: str, timeout: float = 200.0) -> dict[str, Any]:
        path = self.dir / name
        end = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > end:
                pytest.fail(
                    f"job {self.name} ({self.id}) wrote no {name} in {timeout:.0f} s; "
                    + self.diagnostics()
                )
            time.sleep(0.3)
        data: dict[str, Any] = json.loads(path.read_text())
        return data

    def diagnostics(self) -> str:
        """What SLURM and the job said, for a failure message."""
        try:
            info = self.cluster.job(self.id)
        except Exception as e:  # the controller itself may be the problem
            info = {"error": f"scontrol show job failed: {e}"}
        keys = ("JobState", "Reason", "ExitCode", "Restarts", "RunTime", "StartTime", "EndTime")
        state = " ".join(f"{k}={info[k]}" for k in (*keys, "error") if k in info)
        files = sorted(p.name for p in self.dir.iterdir())
        log = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        return f"{state}; files {files}; log:\n{log or '(empty)'}\n{self.cluster.logs(15)}"

    def end_time(self) -> float:
        """scontrol's EndTime (local time), as epoch seconds."""
        return datetime.fromisoformat(self.cluster.job(self.id)["EndTime"]).timestamp()


@pytest.fixture(scope="module")
def jobs(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("jobs")
    probe = root / "signal_probe.py"
    probe.write_text(SIGNAL_PROBE)
    budget_probe = root / "budget_probe.py"
    budget_probe.write_text(BUDGET_PROBE)
    timeline_probe = root / "timeline_probe.py"
    timeline_probe.write_text(TIMELINE_PROBE)
    with_lead = readme_forwarding_script(f"{PY} {budget_probe}")
    without_lead = "\n".join(
        line for line in with_lead.splitlines() if "PYRECOVER_SIGNAL_LEAD" not in line
    )
    # W=60 s of a 120 s job: the warning comes 60-90 s before the end.
    budget_args = ["--time=2", "--signal=B:USR2@60"]
    extra = {
        "lead_known": (with_lead, budget_args, {"PYRECOVER_SIGNAL_LEAD": "60"}),
        "lead_unknown": (without_lead, budget_args, {"PYRECOVER_SIGNAL_LEAD": ""}),
        "timeline": (timeline_job_script(timeline_probe), ["--time=5", "--requeue"], {}),
    }
    specs: dict[str, tuple[str, list[str]]] = {
        "deadline": (DEADLINE_PROBE, ["--time=3"]),
        "shortened": (SHORTENED_PROBE, ["--time=30"]),
        # W=45 s of a 60 s job: the warning comes 15-45 s after the start (30 s timer).
        "batch_signal": (
            readme_forwarding_script(f"{PY} {probe}"),
            ["--time=1", "--signal=B:USR2@45"],
        ),
        "step_signal": (
            f'#!/bin/bash\nsrun {PY} {probe} "$@"\n',
            ["--time=1", "--signal=USR2@45"],
        ),
        "scancel_signal": (SIGNAL_PROBE, []),  # no --time: no limit
        "requeue": (REQUEUE_PROBE, ["--time=5", "--requeue"]),
        "norequeue": (REQUEUE_PROBE, ["--time=5", "--no-requeue"]),
    }
    mpi_rank = root / "mpi_rank.py"
    mpi_rank.write_text(MPI_RANK)
    if (mpi := mpirun_job_script(mpi_rank)) is not None:
        specs["mpirun"] = (mpi, ["--time=5"])
    made = {name: Job(cluster, root, name, script, args) for name, (script, args) in specs.items()}
    for name, (script, args, env) in extra.items():
        made[name] = Job(cluster, root, name, script, args, env)
    return made


def test_deadline_in_a_job_equals_scontrol_and_sees_an_extension(
    cluster: Any, jobs: dict[str, Job]
) -> None:
    job = jobs["deadline"]
    first = job.wait("first.json")
    end = job.end_time()
    assert first["end"] == end and first["source"] == "squeue" and first["job"] == job.id
    assert first["polls"] == 1  # a thousand get() calls, one squeue
    cli = json.loads(first["cli"])
    assert cli["end_time"] == end and cli["source"] == "squeue" and cli["job_id"] == job.id, first

    # From outside the job: squeue, and scontrol when squeue is missing, say the same.
    runner = SubprocessRunner(env=cluster.env)
    env = {"SLURM_JOB_ID": job.id}
    assert find_deadline(env=env, runner=runner) == Deadline(end, "squeue", job.id)

    def no_squeue(argv: Sequence[str], timeout: float) -> str:
        if argv[0] == "squeue":
            raise CommandError(argv, "missing", "squeue not found on PATH")
        return runner(argv, timeout)

    assert find_deadline(env=env, runner=no_squeue) == Deadline(end, "scontrol", job.id)

    cluster.run(["scontrol", "update", f"JobId={job.id}", "TimeLimit=10"])
    extended = job.end_time()
    assert extended == end + 7 * 60
    (job.dir / "go").touch()
    second = job.wait("second.json")
    assert second["end"] == extended and second["source"] == "squeue", second
    assert second["polls"] == 2


def test_a_shortened_limit_is_seen_within_the_poll_interval(
    cluster: Any, jobs: dict[str, Job]
) -> None:
    """scontrol update TimeLimit= cuts a running job to under 2 minutes: the watcher with the
    shipped defaults sees the new end within its 5 s poll interval, plus what was measured on
    the way (the update command itself, the slowest squeue, the probe loop's longest gap)."""
    job = jobs["shortened"]
    first = job.wait("first.json")
    assert first["background"] and first["poll_interval"] == 5.0, first
    started = datetime.fromisoformat(cluster.job(job.id)["StartTime"]).timestamp()
    minutes = int((time.time() - started + 40) // 60) + 1  # ends 40-100 s from now
    before = time.time()
    cluster.run(["scontrol", "update", f"JobId={job.id}", f"TimeLimit={minutes}"])
    updated = time.time()
    new_end = job.end_time()
    assert new_end == started + minutes * 60 and new_end < first["end"], job.diagnostics()
    seen = job.wait("seen.json", timeout=120)
    latency = seen["seen_at"] - before
    interval = max(5.0, 20 * seen["slowest_poll"])  # the watcher waits longer after a slow poll
    allowance = interval + (updated - before) + seen["slowest_poll"] + 2 * seen["loop_gap"]
    print(
        f"limit cut to {new_end - updated:.0f} s left: seen {latency:.2f} s after the update "
        f"(allowed {allowance:.2f} s; slowest squeue {seen['slowest_poll']:.3f} s, slowest "
        f"get() {seen['slowest_get'] * 1000:.2f} ms, {seen['polls']} polls)"
    )
    assert seen["end"] == new_end, seen
    assert latency <= allowance, seen
    cluster.run(["scancel", job.id])


def test_a_job_without_time_limit_has_no_deadline(cluster: Any, jobs: dict[str, Job]) -> None:
    job = jobs["scancel_signal"]
    job.wait("ready.json")
    runner = SubprocessRunner(env=cluster.env)
    assert find_deadline(env={"SLURM_JOB_ID": job.id}, runner=runner) == Deadline(
        None, "squeue", job.id
    )


def test_scancel_batch_signal_reaches_the_python_flag(cluster: Any, jobs: dict[str, Job]) -> None:
    job = jobs["scancel_signal"]
    job.wait("ready.json")
    cluster.run(["scancel", "--batch", "--signal=USR2", job.id])
    assert job.wait("result.json") == {"received": "SIGUSR2", "count": 1}
    assert cluster.wait_for(job.id, {"COMPLETED"}, timeout=60)["ExitCode"] == "0:0"


def test_batch_signal_is_forwarded_to_the_srun_step_by_the_readme_pattern(
    cluster: Any, jobs: dict[str, Job]
) -> None:
    job = jobs["batch_signal"]
    assert job.wait("result.json")["received"] == "SIGUSR2", job.diagnostics()
    # The step's exit status became the job's: the pattern does not turn success into failure.
    assert cluster.wait_for(job.id, {"COMPLETED"}, timeout=60)["ExitCode"] == "0:0"


def test_signal_without_b_reaches_every_step(cluster: Any, jobs: dict[str, Job]) -> None:
    job = jobs["step_signal"]
    assert job.wait("result.json")["received"] == "SIGUSR2", job.diagnostics()


def test_requeue_brings_the_job_back_with_restart_count_1(
    cluster: Any, jobs: dict[str, Job]
) -> None:
    job = jobs["requeue"]
    first = job.wait("first.json")
    assert first["ok"], f"{first}; {job.diagnostics()}"
    assert first["message"].startswith(f"requeued job {job.id} (restart 1)"), first
    assert first["env"] in (None, "0"), first
    second = job.wait("second.json")
    assert second == {"restart_count": 1, "env": "1"}, f"{second}; {job.diagnostics()}"
    info = cluster.wait_for(job.id, {"COMPLETED"}, timeout=60)
    assert info["RestartCnt"] == "1", job.diagnostics()
    # --open-mode=append: the requeued run did not erase the first run's output.
    log = job.log.read_text()
    assert "run 0: SLURM_RESTART_COUNT=" in log and "run 1: SLURM_RESTART_COUNT=1" in log, log


def test_requeue_of_a_no_requeue_job_says_why(jobs: dict[str, Job]) -> None:
    first = jobs["norequeue"].wait("first.json")
    assert not first["ok"]
    assert "is not requeueable" in first["message"] and "#SBATCH --requeue" in first["message"]
    assert not (jobs["norequeue"].dir / "second.json").exists()


def test_the_helper_runs_a_second_cluster_beside_the_first(
    cluster: Any, localslurm: Any, tmp_path: Path
) -> None:
    """Per-instance ports and state: a second cluster (CLI up/status/down) next to the session's."""
    script = str(localslurm.__file__)
    d = tmp_path / "second"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PY, script, *args, "--dir", str(d)], capture_output=True, text=True, timeout=180
        )

    up = cli("up", "--cpus", "2")
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.strip() == f"export SLURM_CONF={d / 'slurm.conf'}"
        status = cli("status")
        assert status.returncode == 0 and "idle" in status.stdout, status.stdout
        assert cli("up").returncode == 1  # refuses to start twice in one directory
        conf = (d / "slurm.conf").read_text()
        assert conf != cluster.conf_path.read_text()
        ports = {line for line in conf.splitlines() if line.startswith("Slurm") and "Port" in line}
        own = {line for line in cluster.conf_path.read_text().splitlines() if line in ports}
        assert len(ports) == 2 and not own
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert cli("status").returncode == 1
    assert not (d / "state").exists()


def test_a_failed_start_shows_the_daemon_logs_and_leaves_nothing(
    cluster: Any, localslurm: Any, tmp_path: Path
) -> None:
    bad = localslurm.LocalCluster(tmp_path / "bad", extra_conf={"SelectType": "select/nope"})
    with pytest.raises(localslurm.SlurmError) as e:
        bad.start()
    assert "slurmctld exited" in str(e.value)
    assert "Can't find plugin for select/nope" in str(e.value)  # the log's tail
    assert not bad._procs and not (tmp_path / "bad" / "state").exists()


def test_a_warning_that_agrees_with_the_known_deadline_does_not_stop_the_job(
    jobs: dict[str, Job],
) -> None:
    """--signal=B:USR2@60 in a 2-minute job, the lead exported by the batch script: the
    warning arrives 60-90 s before the end; the budget that knows the end time (squeue) trains
    on until its own rule stops it seconds before the end; the one without a deadline takes the
    warning's word for it (receipt + 60 s)."""
    job = jobs["lead_known"]
    result = job.wait("result.json", timeout=260)
    assert result["received"] == "SIGUSR2" and result["lead"] == 60.0, result
    assert 50 <= result["usr2_left"] <= 95, result
    known, blind = result["stops"]["known"], result["stops"]["blind"]
    print(
        f"USR2 {result['usr2_left']:.1f} s before the end; stopped {known['left']:.1f} s "
        f"(deadline known) and {blind['left']:.1f} s (signal only) before it"
    )
    assert known["cause"] == "time" and known["reason"].startswith("stop: "), result
    assert 0 < known["left"] < 10, result  # seconds before the end, not at the warning
    assert blind["cause"] == "time" and "(deadline: SIGUSR2 + lead 60.0 s)" in blind["reason"]
    assert 0 <= blind["left"] <= result["usr2_left"] - 60 + 10, result


def test_without_a_known_lead_the_warning_stops_at_once(jobs: dict[str, Job]) -> None:
    job = jobs["lead_unknown"]
    result = job.wait("result.json", timeout=260)
    assert result["lead"] is None and result["received"] == "SIGUSR2", result
    known = result["stops"]["known"]
    assert known["cause"] == "signal" and known["reason"].startswith("stop: received SIGUSR2")
    assert known["left"] >= 45, result  # stopped at the warning, a minute before the end


def test_the_end_of_a_run_is_measured_across_a_real_requeue(
    cluster: Any, jobs: dict[str, Job]
) -> None:
    job = jobs["timeline"]
    first = job.wait("first.json")
    assert first["path"].endswith(f"-{job.id}.jsonl"), first
    second = job.wait("second.json", timeout=240)
    events = second["events"]
    assert events[:4] == [["start", 0], ["saved", 0], ["exited", 0], ["requeued", 0]], events
    assert ["start", 1] in events, events
    (sample,) = second["samples"]
    restart, seconds, exit_s = sample
    print(f"final save -> requeue accepted: {seconds:.2f} s (step exited after {exit_s:.2f} s)")
    # From the durable final save to SLURM's answer to the requeue: the probe's 0.5 s teardown,
    # srun-less exit, one `slurmclock mark` and `slurmclock requeue`.
    assert restart == 0 and 0.5 <= exit_s <= seconds < 30, second
    assert second["exit_estimate"] == pytest.approx(1.25 * seconds), second
    assert second["state"] == [{"job": job.id, "restart": 0, "seconds": seconds}]
    info = cluster.wait_for(job.id, {"COMPLETED"}, timeout=60)
    assert info["RestartCnt"] == "1", job.diagnostics()
    from_a_login_shell(cluster, job)


def from_a_login_shell(cluster: Any, job: Job) -> None:
    """After the job, from a shell with none of its variables (no SLURM_CLUSTER_NAME): its
    facts come from SLURM (restart 1, not this shell's 0), its timeline is found by the id."""
    env = {"SLURMCLOCK_DIR": str(job.dir), "SLURM_RESTART_COUNT": "0"}
    clock = [PY, "-m", "slurmclock"]
    status = cluster.run([*clock, "status", "--json", job.id], env=env)
    assert json.loads(status.stdout)["restart_count"] == 1, status.stdout + status.stderr
    shown = cluster.run([*clock, "timeline", job.id], env=env)
    path = job.dir / f"{cluster.cluster_name}-{job.id}.jsonl"
    assert shown.stdout.startswith(f"timeline of job {job.id}: {path}\n"), shown.stdout
    assert " requeued " in shown.stdout and "(no events yet)" not in shown.stdout
    # The scheduler interface against the real SLURM, as the supervisor uses it.
    slurm = Slurm(SubprocessRunner(env=cluster.env))
    view = slurm.show_job(job.id)
    assert (view.native_state, view.restarts, view.num_nodes) == ("COMPLETED", 1, 1), view
    assert slurm.cluster_name() == cluster.cluster_name
    assert slurm.hostnames(view.nodes) == [cluster.node_name]
    nodes = slurm.nodes(view.partition)
    assert [(n.name, n.usable) for n in nodes] == [(cluster.node_name, True)], nodes


def test_one_rank_leads_under_mpirun_in_a_batch_job(jobs: dict[str, Job]) -> None:
    """mpirun inside sbatch: every rank inherits the batch shell's SLURM_PROCID=0. Exactly one
    writes the job's timeline and watches the clock (before: all three)."""
    if "mpirun" not in jobs:
        if os.environ.get("PYRECOVER_REQUIRE_MPI") == "1":
            pytest.fail("PYRECOVER_REQUIRE_MPI=1 but mpirun is not installed")
        pytest.skip("mpirun not installed (apt-get install openmpi-bin)")
    job = jobs["mpirun"]
    info = job.cluster.wait_for(job.id, {"COMPLETED", "FAILED"}, timeout=200)
    assert info["JobState"] == "COMPLETED", job.diagnostics()
    said = [json.loads(p.read_text()) for p in job.dir.glob("said-*.json")]
    assert len(said) == 3 and {s["procid"] for s in said} == {"0"}, job.diagnostics()
    assert sorted((s["leads"], s["wrote"]) for s in said) == [(False, False)] * 2 + [(True, True)]
    (timeline,) = job.dir.glob(f"*-{job.id}.jsonl")
    assert [json.loads(line)["event"] for line in timeline.read_text().splitlines()] == ["start"]
