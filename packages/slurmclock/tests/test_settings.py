"""Supervisor settings that contradict each other or the job are refused before anything runs
(one line, exit 2), and srun's refusal of the step's settings is a setting error, never a crash
retried (issue 34, item 6)."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from slurmclock.cli import main
from slurmclock.supervisor import SuperviseConfig, Supervisor
from slurmclock.supervisor.config import contradiction
from slurmclock.supervisor.history import Streak
from slurmclock.supervisor.verdict import CHAIN_GOES_ON, decide, srun_refusal
from slurmclock.timeline import JobTimeline

JOB = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NUM_NODES": "1"}


def never(argv: Any, timeout: float) -> str:
    raise AssertionError(f"nothing may run before the settings are checked: {argv}")


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--no-retry", "74"], {}, "74 is a store outage, never a failure"),
        (["--no-retry", "2,74"], {}, "leave 74 out"),
        (["--no-requeue", "--next-job-resumes"], {}, "neither an array task nor part of a chain"),
        (["--next-job-resumes"], {}, "set PYRECOVER_CHAIN=1"),
        (["--tasks-per-node", "4"], {"SLURM_NTASKS_PER_NODE": "2"}, "more than the job's 2"),
        (["--step-nodes", "2"], {}, "--step-nodes 2 is more than the job's 1 node(s)"),
        (["--min-nodes", "2", "--spare-nodes", "1"], {"SLURM_JOB_NUM_NODES": "2"}, "--nodes 3"),
    ],
)
def test_contradicting_settings_are_one_line_and_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    env: dict[str, str],
    said: str,
) -> None:
    marker = tmp_path / "ran"
    step = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    environment = {**JOB, "SLURMCLOCK_DIR": str(tmp_path), **env}
    code = main(["supervise", *args, "--", *step], env=environment, runner=never)
    err = capsys.readouterr().err
    assert code == 2 and not marker.exists()
    assert err.count("\n") == 1 and err.startswith("slurmclock: error: supervise: ")
    assert said in err


@pytest.mark.parametrize(
    "env",
    [
        {"SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "2"},
        {"PYRECOVER_CHAIN": "1"},
    ],
)
def test_the_next_job_resumes_in_an_array_or_a_chain(env: dict[str, str]) -> None:
    config = SuperviseConfig(requeue=False, next_job_resumes=True)
    assert contradiction(config, {**JOB, **env}) is None


def test_settings_that_fit_the_job_are_taken() -> None:
    env = {**JOB, "SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS_PER_NODE": "4"}
    config = SuperviseConfig(tasks_per_node=4, step_nodes=2, spare_nodes=1, min_nodes=1)
    assert contradiction(config, env) is None
    assert contradiction(SuperviseConfig(next_job_resumes=True), {}) is None  # outside a job


@pytest.mark.parametrize(
    "line",
    [
        "srun: error: Unable to create step for job 42: More processors requested than permitted",
        "srun: error: Unable to allocate resources: Requested node configuration is not available",
        "srun: unrecognized option '--bogus'",
        "srun: invalid option -- 'Z'",
        "srun: error: Invalid generic resource (gres) specification",
    ],
)
def test_srun_refusals_are_recognized(line: str) -> None:
    assert srun_refusal(f"some training output\n{line}\nmore\n") == line


def test_a_trainers_own_words_are_no_refusal() -> None:
    assert srun_refusal("ValueError: More processors requested than permitted\n") is None
    assert srun_refusal("srun: error: n2: task 1: Exited with exit code 1\n") is None


def test_an_srun_refusal_ends_the_run_as_a_setting_error(tmp_path: Path) -> None:
    """A stand-in step prints srun's refusal and exits 1 as srun does: the supervisor reads its
    own job log (its stderr, a file as under sbatch), says one line, exits 2, no failure."""
    log = tmp_path / "job.log"
    step = (
        "import sys; sys.stderr.write('srun: error: Unable to create step for job 42: "
        "More processors requested than permitted\\n'); sys.exit(1)"
    )
    env = {**os.environ, **JOB, "SLURMCLOCK_DIR": str(tmp_path), "SLURM_RESTART_COUNT": "0"}
    for key in ("SLURM_CLUSTER_NAME", "RANK", "SLURM_PROCID", "PYRECOVER_SIGNAL_LEAD"):
        env.pop(key, None)
    out = io.StringIO()
    saved = os.dup(2)
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        sup = Supervisor(SuperviseConfig(), env=env, runner=_slurm, out=out, here="n1")
        code = sup.run([sys.executable, "-c", step])
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    said = out.getvalue()
    assert code == 2 and sup.launches == 1
    assert "srun refused the step's settings ('srun: error: Unable to create step" in said
    assert "not retried" in said and "requeued" not in said
    names = [e.name for e in JobTimeline("42", directory=tmp_path, env={}).events()]
    assert "failed" not in names and names[-1] == "gave_up"


def _slurm(argv: Any, timeout: float) -> str:
    argv = tuple(argv)
    if argv[:3] == ("scontrol", "show", "job"):
        return (
            "JobId=42 JobState=RUNNING Reason=None Restarts=0 BatchFlag=1 "
            "EndTime=2099-01-01T00:00:00 Partition=debug NodeList=n1 NumNodes=1"
        )
    if argv[:3] == ("scontrol", "show", "hostnames"):
        return "\n".join(argv[3].split(","))
    return ""


def test_a_stop_in_a_chain_says_the_rest_still_starts() -> None:
    chained = SuperviseConfig(requeue=False, next_job_resumes=True)
    verdict = decide("requested", 75, term="stop", streak=Streak(), restarts=0, config=chained)
    assert verdict.code == 0 and CHAIN_GOES_ON in verdict.message and "scancel" in verdict.message
    plain = decide(
        "requested", 75, term="stop", streak=Streak(), restarts=0, config=SuperviseConfig()
    )
    assert CHAIN_GOES_ON not in plain.message


def test_slurmclock_stop_says_what_happens_to_a_chain(capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[tuple[str, ...]] = []

    def runner(argv: Any, timeout: float) -> str:
        calls.append(tuple(argv))
        return ""

    assert main(["stop", "1234"], env={}, runner=runner) == 0
    out = capsys.readouterr().out
    assert "asked job 1234 to save and stop" in out
    assert "chain" in out and "still start" in out and "scancel" in out


@pytest.mark.slurm
@pytest.mark.parametrize(
    ("srun_args", "said"),
    [
        (["--ntasks=64"], "More processors requested than permitted"),
        (["--bogus-option"], "unrecognized option"),
    ],
)
def test_a_real_srun_refusal_is_a_setting_error(
    cluster: Any, tmp_path: Path, srun_args: list[str], said: str
) -> None:
    """On a real SLURM: the supervisor's step is an srun asking for what the job does not have
    (or an option srun does not know); the job ends with exit 2 and one line, once, no retry."""
    log = tmp_path / "job.log"
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    script = (
        "#!/bin/bash\n"
        f"exec {sys.executable} -m slurmclock supervise -- srun {' '.join(srun_args)} true\n"
    )
    env = {"SLURMCLOCK_DIR": str(tmp_path / "timelines"), "PATH": path}
    job = cluster.sbatch(script, "--time=2", "--ntasks=1", f"--output={log}", env=env)
    info = cluster.wait_for(job, {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"}, timeout=90)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "FAILED" and info.get("ExitCode") == "2:0", text
    (line,) = [x for x in text.splitlines() if "srun refused the step's settings" in x]
    assert said in line and "not retried" in line, text
    assert "failure 1 of" not in text and "requeued" not in text and "starting the" not in text
