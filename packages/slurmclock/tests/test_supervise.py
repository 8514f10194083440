"""slurmclock.supervisor's Supervisor: its settings, and its loop with real child processes and
a fake SLURM. The decisions it takes are tested where they live: test_verdict.py,
test_history.py, test_placement.py, test_fault_reading.py."""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from slurmclock import CommandError, JobTimeline
from slurmclock.cli import main
from slurmclock.supervisor.config import SuperviseConfig
from slurmclock.supervisor.supervise import Supervisor

# What `scontrol show job -o` said in the batch script's SIGTERM trap (SLURM 22.05.8); every
# case in test_verdict.py.
SHOW = {
    "limit": "JobId=2 JobState=COMPLETING Reason=TimeLimit Dependency=(null) Requeue=1 "
    "Restarts=0 BatchFlag=1 EndTime=2026-11-25T18:24:58 Partition=debug NodeList=n1 NumNodes=1",
    "stop": "JobId=4 JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0",
}


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


def supervisor(
    tmp_path: Path, job: Job, restart: int = 0, nodelist: str = "n1", **config: Any
) -> Supervisor:
    """The supervisor of job 42 on node n1 (of ``nodelist``), with the fake SLURM ``job``."""
    env = {
        **os.environ,
        "SLURM_JOB_ID": "42",
        "SLURM_RESTART_COUNT": str(restart),
        "SLURMCLOCK_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": nodelist,
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
    two_nodes = SHOW["limit"].replace("NodeList=n1 NumNodes=1", "NodeList=n1,n2 NumNodes=2")
    job = Job(show=two_nodes, sinfo="n1 idle\nn2 idle\nn3 mix\n")
    # n2 is one of the job's nodes: a record naming a node outside the job is ignored
    sup = supervisor(tmp_path, job, nodelist="n1,n2", restart_here=False)
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
        "scontrol update JobId=42 NodeList=n1",  # the lost node given back to SLURM
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
