"""slurmclock.supervisor: what ended an allocation, the failure budget, the verdict -- from
``scontrol show job -o`` text as SLURM 22.05 printed it in each case (captured on the local
cluster), fake runners and clocks; and the supervisor's loop with real child processes."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from slurmclock import CommandError, JobTimeline
from slurmclock.cli import main
from slurmclock.job import JobState
from slurmclock.slurm import parse_job_record
from slurmclock.supervisor.config import SuperviseConfig
from slurmclock.supervisor.faults import Fault, read_faults
from slurmclock.supervisor.history import Streak, failure_streak, newest_checkpoint, vanished_run
from slurmclock.supervisor.supervise import Supervisor
from slurmclock.supervisor.verdict import classify_term, decide, describe_status, end_kind
from slurmclock.timeline import Event

# What `scontrol show job -o` said in the batch script's SIGTERM trap (SLURM 22.05.8).
SHOW = {
    "limit": "JobId=2 JobState=COMPLETING Reason=TimeLimit Dependency=(null) Requeue=1 "
    "Restarts=0 BatchFlag=1 EndTime=2026-11-25T18:24:58 Partition=debug NodeList=n1 NumNodes=1",
    "scancel": "JobId=3 JobState=COMPLETING Reason=None Dependency=(null) Requeue=1 Restarts=0 "
    "PreemptEligibleTime=2026-11-25T18:28:38 PreemptTime=None Partition=debug NumNodes=1",
    "stop": "JobId=4 JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0",
    "requeue": "JobId=5 JobState=COMPLETING Reason=None Dependency=(null) Requeue=1 Restarts=1",
    "preempt-cancel": "JobId=3 JobState=COMPLETING Reason=None Requeue=1 Restarts=0 "
    "EndTime=2026-11-25T18:29:12 PreemptTime=2026-11-25T18:29:12",
    "preempt-requeue": "JobId=1 JobState=COMPLETING Reason=None Requeue=1 Restarts=1",
}


@pytest.mark.parametrize(
    ("case", "kind"),
    [
        ("limit", "limit"),
        ("scancel", "cancelled"),
        ("stop", "stop"),
        ("requeue", "requeued"),
        ("preempt-cancel", "preempted"),
        ("preempt-requeue", "requeued"),
    ],
)
def test_what_a_sigterm_meant(case: str, kind: str) -> None:
    assert classify_term(parse_job_record(SHOW[case]), 0, None) == kind


def test_without_scontrol_only_a_passed_deadline_reads_as_the_limit() -> None:
    assert classify_term(None, 0, -3.0) == "limit"
    assert classify_term(None, 0, 120.0) == "stop"
    assert classify_term(None, 0, None) == "stop"


def test_job_view_fields() -> None:
    view = parse_job_record(SHOW["limit"] + " ExcNodeList=n[2-3] NumNodes=4-4")
    assert (
        view.native_state == "COMPLETING"
        and view.state == JobState.TIMED_OUT
        and view.restarts == 0
    )
    assert view.partition == "debug" and view.nodes == "n1" and view.exc_nodes == "n[2-3]"
    assert view.num_nodes == 1  # the first NumNodes= wins
    assert parse_job_record(SHOW["scancel"]).preempt_time is None
    assert parse_job_record("JobState=RUNNING NumNodes=2-4").num_nodes == 2
    assert parse_job_record("garbage").restarts is None


def ev(event: str, restart: int = 0, **info: Any) -> Event:
    return Event(event, 1.0, restart, info)


def test_failure_streak_counts_failures_at_one_checkpoint() -> None:
    events = [ev("checkpoint", step=100), ev("failed", rc=1, step=100)]
    assert failure_streak(events) == Streak(1, 100, events[-1])
    events += [ev("start", 1), ev("failed", 1, rc=1, step=100), ev("failed", 2, rc=9, step=100)]
    assert failure_streak(events).count == 3
    # progress: a failure at a newer checkpoint starts again at 1
    newer = ev("failed", 3, step=200)
    assert failure_streak([*events, newer]) == Streak(1, 200, newer)
    # a clean end, or the user resuming after the chain stopped, ends the streak
    for end in (ev("exited", rc=75), ev("exited", rc=0), ev("gave_up", why="x")):
        assert failure_streak([*events, end]).count == 0
    # a crash's own exit, a limit or a preemption neither counts nor ends it
    more = [ev("exited", rc=1), ev("signal", name="TERM", kind="limit"), ev("requeued")]
    assert failure_streak([*events, *more]).count == 3


def test_before_any_checkpoint_the_step_is_none() -> None:
    assert failure_streak([ev("failed"), ev("failed")]).count == 2
    assert newest_checkpoint([ev("checkpoint", step=5), ev("checkpoint", step=7)]) == 7
    assert newest_checkpoint([ev("checkpoint", step="x"), ev("start")]) is None


def test_a_run_that_vanished() -> None:
    assert vanished_run([]) is None
    lost = ev("start", 2)
    assert vanished_run([ev("start"), ev("exited", rc=75), lost, ev("checkpoint", 2, step=9)])
    assert vanished_run([lost]) == lost
    for end in (
        ev("exited", 2, rc=137),
        ev("gave_up", 2),
        ev("signal", 2, name="TERM", kind="limit"),
        ev("signal", 2, name="TERM", kind="requeued"),
    ):
        assert vanished_run([lost, end]) is None
    # a user's stop request is not SLURM ending the run: without an exit the run vanished
    assert vanished_run([lost, ev("signal", 2, name="TERM", kind="stop")]) == lost


def test_read_faults_keeps_this_runs_readable_lines(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    lines = [
        {"time": 5.0, "rank": 1, "host": "old", "what": "dead", "reporter": 0},
        {"time": 20.0, "rank": 1, "host": "n7", "what": "frozen", "reporter": 0},
        "not json",
        {"time": "never"},
    ]
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines))
    (fault,) = read_faults(path, since=10.0)
    assert fault == Fault(20.0, 1, "n7", "frozen", 0)
    assert fault.describe() == "rank 1 on node n7 was frozen (reported by rank 0)"
    assert read_faults(tmp_path / "missing", 0.0) == [] and read_faults(None, 0.0) == []


def test_read_faults_takes_epoch_seconds_and_iso_text(tmp_path: Path) -> None:
    """ddpkit wrote ISO-8601 text and every line was dropped (float("2026-...")): epoch seconds
    now, and the older form still read."""
    path = tmp_path / "f.jsonl"
    record = {"rank": 1, "host": "n2", "what": "dead", "reporter": 0, "silent_s": 1.2}
    path.write_text(
        json.dumps({"time": "2026-11-25T18:47:47.387+00:00", **record, "job_id": "7"})
        + "\n"
        + json.dumps({"time": 1795632468.5, **record, "job_id": None})
        + "\n"
        + json.dumps({"time": None, **record})
        + "\n"
    )
    old, new = read_faults(path, since=1795632000.0)
    assert old == Fault(1795632467.387, 1, "n2", "dead", 0, 1.2, "7")
    assert new == Fault(1795632468.5, 1, "n2", "dead", 0, 1.2, None)
    assert read_faults(path, since=1795632468.0) == [new]


def test_describe_status() -> None:
    assert describe_status(1) == "exit 1"
    assert describe_status(137) == "exit 137 (killed by SIGKILL)"
    assert describe_status(None) == "no exit status"


CONFIG = SuperviseConfig(resume_hint="resume with --continue")


@pytest.mark.parametrize(
    ("rc", "term", "kind"),
    [
        (0, None, "finished"),
        (75, None, "stopped"),
        (2, None, "usage"),
        (1, None, "failed"),
        (139, None, "failed"),
        (75, "stop", "requested"),
        (137, "limit", "slurm"),
        (0, "cancelled", "slurm"),
    ],
)
def test_end_kind(rc: int, term: str | None, kind: str) -> None:
    assert end_kind(rc, term, CONFIG.no_retry) == kind


def verdict(kind: str, rc: int, **kw: Any) -> tuple[str, int, str]:
    kw.setdefault("term", None)
    kw.setdefault("streak", Streak())
    kw.setdefault("restarts", 0)
    kw.setdefault("config", CONFIG)
    v = decide(kind, rc, **kw)
    return v.action, v.code, v.message


def test_verdicts() -> None:
    assert verdict("finished", 0) == ("end", 0, "training finished")
    action, code, said = verdict("stopped", 75)
    assert (action, code) == ("requeue", 75) and said.startswith("stopped early with steps left")
    action, code, said = verdict("failed", 139, streak=Streak(2, 40, ev("failed")))
    assert (action, code) == ("requeue", 139)
    assert "failure 2 of 3 in a row at checkpoint step 40" in said
    assert verdict("usage", 2)[:2] == ("end", 2)
    assert verdict("requested", 75, term="stop")[:2] == ("end", 0)
    assert verdict("requested", 143, term="stop")[:2] == ("end", 143)
    assert verdict("slurm", 0, term="cancelled")[:2] == ("end", 0)
    assert verdict("slurm", 137, term="limit", requeued=True)[:2] == ("end", 0)
    assert verdict("slurm", 137, term="limit")[:2] == ("end", 75)  # the requeue was refused


def test_the_budget_gives_up_with_one_line() -> None:
    last = ev("failed", 2, rc=139, step=40, nodes="n3", why="exit 139 (killed by SIGSEGV)")
    action, code, said = verdict("failed", 139, streak=Streak(3, 40, last))
    assert (action, code) == ("give_up", 139)
    assert said == (
        "gave up: the training step failed 3 times in a row at checkpoint step 40 (last: exit "
        "139 (killed by SIGSEGV) on n3); not requeueing. Fix the cause, then resume: resume "
        "with --continue"
    )
    assert "\n" not in said


def test_no_requeue_and_the_restart_limit() -> None:
    chained = SuperviseConfig(requeue=False, next_job_resumes=True)
    action, code, said = verdict("stopped", 75, config=chained)
    assert (action, code) == ("end", 0) and "next array task / chained job resumes" in said
    assert verdict("failed", 1, config=chained, streak=Streak(1, None, None))[:2] == ("end", 1)
    # A plain job with requeue off (issue 30): no successor to speak of, and an unfinished run
    # ends with its status (the job is not COMPLETED), saying how to go on.
    plain = SuperviseConfig(requeue=False, resume_hint="submit again with --continue")
    action, code, said = verdict("stopped", 75, config=plain)
    assert (action, code) == ("end", 75) and "next array task" not in said
    assert said == (
        "stopped early with steps left; not requeueing (requeue is off); to go on: submit "
        "again with --continue"
    )
    action, code, said = verdict("stopped", 75, restarts=50)
    assert (action, code) == ("end", 75) and "already restarted 50 times" in said


@pytest.mark.parametrize(
    ("kw", "problem"),
    [
        ({"max_failures": 0}, "max_failures must be a whole number >= 1"),
        ({"max_restarts": -1}, "max_restarts must be a whole number >= 0"),
        ({"max_failures": True}, "max_failures"),
        ({"no_retry": frozenset({75})}, "cannot be a failure status"),
        ({"no_retry": frozenset({300})}, "cannot be a failure status"),
        ({"name": "a\nb"}, "one non-empty line"),
        ({"command_timeout": 0}, "command_timeout"),
        ({"min_nodes": 0}, "min_nodes must be a whole number >= 1"),
        ({"spare_nodes": -1}, "spare_nodes must be a whole number >= 0"),
        ({"step_nodes": 1, "min_nodes": 2}, "step_nodes 1 is fewer than min_nodes 2"),
        ({"probe_timeout": float("nan")}, "probe_timeout must be > 0 seconds"),
    ],
)
def test_bad_config_is_one_line(kw: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        SuperviseConfig(**kw)


# -- the loop, with real child processes ---------------------------------------------------------


class Job:
    """A fake SLURM for the supervisor: scontrol answers ``show``, records the rest."""

    def __init__(self, show: str = SHOW["stop"], sinfo: str = "") -> None:
        self.show, self.sinfo = show, sinfo
        self.calls: list[tuple[str, ...]] = []
        self.on_scancel: Any = None

    def __call__(self, argv: Any, timeout: float) -> str:
        argv = tuple(argv)
        self.calls.append(argv)
        if argv[:2] == ("scontrol", "show"):
            return self.show if argv[2] == "job" else "\n".join(argv[3].split(","))
        if argv[0] == "sinfo":
            return self.sinfo
        if argv[0] == "scancel" and self.on_scancel is not None:
            self.on_scancel()
        if argv[0] == "squeue":
            raise CommandError(argv, "missing", "squeue not found")
        if argv[0] == "srun":  # a probe of a reported node: it does not answer
            raise CommandError(argv, "timeout", "`srun ...` timed out after 10 s")
        return ""

    def acting(self) -> list[str]:
        return [
            " ".join(c) for c in self.calls if c[:2] != ("scontrol", "show") and c[0] != "sinfo"
        ]


def supervisor(tmp_path: Path, job: Job, restart: int = 0, **config: Any) -> Supervisor:
    """The supervisor of job 42 on node n1, with the fake SLURM ``job``."""
    env = {
        **os.environ,
        "SLURM_JOB_ID": "42",
        "SLURM_RESTART_COUNT": str(restart),
        "SLURMCLOCK_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": "n1",
    }
    for key in ("SLURM_CLUSTER_NAME", "RANK", "SLURM_PROCID", "PYRECOVER_SIGNAL_LEAD"):
        env.pop(key, None)
    return Supervisor(SuperviseConfig(**config), env=env, runner=job, out=io.StringIO(), here="n1")


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def said(sup: Supervisor) -> str:
    out = sup.out
    assert isinstance(out, io.StringIO)
    return out.getvalue()


def events(tmp_path: Path) -> list[str]:
    timeline = JobTimeline("42", directory=tmp_path, env={})
    return [e.name for e in timeline.events()]


def test_finished(tmp_path: Path) -> None:
    job = Job()
    sup = supervisor(tmp_path, job)
    assert sup.run(py("pass")) == 0
    assert "training finished" in said(sup) and job.acting() == []
    assert events(tmp_path) == ["start", "exited"]


def test_a_crash_is_requeued_and_the_fault_file_read(tmp_path: Path) -> None:
    """Without restarts in the allocation: the requeue, with the lost node excluded."""
    job = Job(show=SHOW["limit"], sinfo="n1 idle\nn2 idle\nn3 mix\n")
    sup = supervisor(tmp_path, job, restart_here=False)
    report = {"time": 4e9, "rank": 1, "host": "n2", "what": "dead", "reporter": 0}
    code = (
        "import json, os; f = open(os.environ['DDPKIT_FAULT_FILE'], 'a'); "
        f"f.write(json.dumps({report!r}) + '\\n'); raise SystemExit(3)"
    )
    assert sup.run(py(code)) == 0
    out = said(sup)
    assert "training step exited with status 3" in out
    assert "rank 1 on node n2 was dead (reported by rank 0)" in out
    assert "failure 1 of 3 in a row before any checkpoint" in out
    assert "node n2 does not answer (`srun ...` timed out after 10 s): left out" in out
    assert "the next allocation avoids node(s) n2 (ExcNodeList)" in out
    probe = "srun --jobid=42 --overlap --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=n2"
    assert job.acting() == [
        f"{probe} --job-name=slurmclock-probe --quiet true",
        "scontrol requeue 42",
        "scontrol update JobId=42 ExcNodeList=n2",
    ]
    assert events(tmp_path) == ["start", "fault", "exited", "failed", "requeued"]


def test_the_only_node_is_never_excluded(tmp_path: Path) -> None:
    """A rank frozen on the supervisor's own node: the node is there, not lost."""
    job = Job(show=SHOW["limit"], sinfo="n1 idle\n")
    sup = supervisor(tmp_path, job, restart_here=False)
    code = (
        "import json, os; open(os.environ['DDPKIT_FAULT_FILE'], 'a').write(json.dumps("
        "{'time': 4e9, 'rank': 0, 'host': 'n1', 'what': 'frozen', 'reporter': 1}) + '\\n');"
        "raise SystemExit(1)"
    )
    assert sup.run(py(code)) == 0
    assert "rank 0 on node n1 was frozen (reported by rank 1)" in said(sup)
    assert job.acting() == ["scontrol requeue 42"]


def test_a_vanished_run_counts_and_can_end_the_chain_before_training(tmp_path: Path) -> None:
    timeline = JobTimeline("42", directory=tmp_path, env={})
    for restart in range(2):
        timeline.restart = restart
        timeline.mark("start")
        timeline.mark("failed", rc=1, step=None, why="exit 1")
    timeline.restart = 2
    timeline.mark("start")  # run 2 left no end: its node went away
    job = Job()
    sup = supervisor(tmp_path, job, restart=3)
    assert sup.run(py("raise SystemExit('must not run')")) == 1
    out = said(sup)
    assert "run 2 ended without a word" in out
    assert "gave up: the training step failed 3 times in a row before any checkpoint" in out
    assert events(tmp_path)[-3:] == ["start", "failed", "gave_up"]


def test_sigterm_at_the_limit_requeues_while_the_step_runs(tmp_path: Path) -> None:
    job = Job(show=SHOW["limit"])
    sup = supervisor(tmp_path, job)
    # The step sends its supervisor SIGTERM (SLURM at the limit), then waits to be killed.
    code = (
        "import os, signal, time; os.kill(os.getppid(), signal.SIGTERM); "
        "time.sleep(0.6); raise SystemExit(137)"
    )
    assert sup.run(py(code)) == 0
    out = said(sup)
    assert out.index("requeued job 42") < out.index("training step exited with status 137")
    assert "already requeued at the time limit" in out
    assert job.acting() == ["scontrol requeue 42"]
    assert "failed" not in events(tmp_path)


def test_a_stop_request_is_forwarded_through_slurm_not_srun(tmp_path: Path, fakes: Any) -> None:
    job = Job(show=SHOW["stop"])
    pidfile = tmp_path / "pid"
    job.on_scancel = lambda: os.kill(int(pidfile.read_text()), signal.SIGTERM)
    sup = supervisor(tmp_path, job)
    code = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
        f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
        "os.kill(os.getppid(), signal.SIGTERM)\n"
        "time.sleep(30)\nsys.exit(1)\n"
    )
    assert sup.run(py(code)) == 0
    assert "stopped on request" in said(sup)
    assert job.acting() == ["scancel --signal=TERM 42"]


def test_outside_a_job_it_only_runs_the_command(tmp_path: Path) -> None:
    sup = Supervisor(env={"PATH": os.environ["PATH"]}, runner=Job(), out=io.StringIO())
    assert sup.run(py("raise SystemExit(5)")) == 5
    assert "not in a SLURM job" in said(sup)


def test_cli_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["supervise"]) == 2
    assert "give the step to run after --" in capsys.readouterr().err
    assert main(["supervise", "--no-retry", "x", "--", "true"]) == 2
    assert "--no-retry 'x'" in capsys.readouterr().err
    assert main(["supervise", "--max-failures", "0", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "max_failures must be a whole number >= 1" in err


def test_cli_node_and_restart_settings(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, said in (
        (["--spare-nodes", "-1"], "spare_nodes must be a whole number >= 0"),
        (["--min-nodes", "3", "--step-nodes", "2"], "step_nodes 2 is fewer than min_nodes 3"),
        (["--relaunch-args", '"unbalanced'], "No closing quotation"),
    ):
        assert main(["supervise", *argv, "--", "true"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err


def test_a_bad_job_id_is_refused(tmp_path: Path) -> None:
    sup = Supervisor(env={"SLURM_JOB_ID": "../x"}, runner=Job(), out=io.StringIO())
    assert sup.run(py("pass")) == 2
    assert "is not a SLURM job id" in said(sup)


def test_record_save_with_a_step_marks_the_checkpoint(tmp_path: Path) -> None:
    """The contract with the trainers: a durable checkpoint is a ``checkpoint step=N`` event."""
    from slurmclock import TimeBudget

    timeline = JobTimeline("42", directory=tmp_path, env={})
    budget = TimeBudget(timeline=timeline)
    budget.record_save(1.5, background=True, step=300)
    budget.record_save(1.5)  # no step: nothing to mark
    budget.record_save(2.0, final=True, step=400)
    marks = [(e.name, e.info.get("step")) for e in timeline.events()]
    assert marks == [("checkpoint", 300), ("checkpoint", 400), ("saved", None)]
    assert newest_checkpoint(timeline.events()) == 400
