"""The command line about a job this shell is not in (a login node), and a timeline that reads
true: found by the job id alone, the job's facts from SLURM, details that cannot fake a line, a
run of checkpoints summarized."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from slurmclock import JobTimeline
from slurmclock.cli import main

SHOW_36 = "JobId=36 JobName=train JobState=RUNNING Reason=None Restarts=1 NodeList=n1 NumNodes=1"


def cli(
    capsys: pytest.CaptureFixture[str], *argv: str, env: dict[str, str], runner: Any = None
) -> tuple[int, str, str]:
    code = main(list(argv), env=env, runner=runner)
    out, err = capsys.readouterr()
    return code, out, err


def write(path: Path, *events: dict[str, Any]) -> None:
    path.write_text("".join(json.dumps({"restart": 0, **e}) + "\n" for e in events))


def no_slurm(fakes: Any) -> Any:
    """A login shell without SLURM's commands."""
    return fakes.Runner()


# -- the timeline of a job, from a login shell ----------------------------------------------------


def test_the_timeline_is_found_without_the_cluster_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fakes: Any
) -> None:
    """The job wrote ci-36.jsonl (SLURM_CLUSTER_NAME=ci in the job); a login shell has no
    SLURM_CLUSTER_NAME. It said "(no events yet)" about job-36.jsonl."""
    write(tmp_path / "ci-36.jsonl", {"event": "start", "time": 1e9})
    write(tmp_path / "ci-360.jsonl", {"event": "start", "time": 1e9})  # not job 36's
    env = {"SLURMCLOCK_DIR": str(tmp_path)}
    for argv in (["timeline", "--job-id", "36"], ["timeline", "36"], ["timeline", "036"]):
        code, out, _ = cli(capsys, *argv, env=env, runner=no_slurm(fakes))
        assert code == 0 and f"timeline of job 36: {tmp_path / 'ci-36.jsonl'}" in out, out
        assert "start" in out and "(no events yet)" not in out


def test_a_job_without_a_timeline_yet(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fakes: Any
) -> None:
    code, out, _ = cli(capsys, "timeline", "37", env={"SLURMCLOCK_DIR": str(tmp_path)})
    assert code == 0 and "(no events yet)" in out and "job-37.jsonl" in out


def test_timelines_of_several_clusters_are_told_apart_by_slurm(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fakes: Any
) -> None:
    write(tmp_path / "ci-36.jsonl", {"event": "start", "time": 1e9})
    write(tmp_path / "prod-36.jsonl", {"event": "exited", "time": 1e9, "rc": 0})
    env = {"SLURMCLOCK_DIR": str(tmp_path)}
    config = fakes.Runner(scontrol="ClusterName             = prod\n")
    code, out, _ = cli(capsys, "timeline", "36", env=env, runner=config)
    assert code == 0 and "prod-36.jsonl" in out and "exited" in out
    assert config.calls == [("scontrol", "show", "config")]
    code, out, _ = cli(capsys, "timeline", "36", env={**env, "SLURM_CLUSTER_NAME": "ci"})
    assert code == 0 and "ci-36.jsonl" in out and "start" in out
    code, out, err = cli(capsys, "timeline", "36", env=env, runner=no_slurm(fakes))
    assert code == 2 and out == ""
    assert "ci-36.jsonl, prod-36.jsonl" in err and "set SLURM_CLUSTER_NAME" in err
    assert err.count("\n") == 1


def test_the_job_once_as_a_word_or_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys, "timeline", "36", "--job-id", "37", env={})
    assert code == 2 and "JOBID '36' and --job-id '37' name two jobs" in err
    code, _, err = cli(capsys, "status", "x/../1", env={})
    assert code == 2 and "JOBID 'x/../1' is not a SLURM job id" in err
    assert cli(capsys, "timeline", "36", "--job-id", "036", env={})[0] == 0


# -- another job's facts come from SLURM ------------------------------------------------------


def test_status_of_another_job_asks_slurm_for_its_restarts(
    capsys: pytest.CaptureFixture[str], fakes: Any
) -> None:
    """It said `restarts: 0` when SLURM said 1: it read the caller's SLURM_RESTART_COUNT."""
    runner = fakes.Runner(squeue="2099-01-01T00:00:00 1:00:00", scontrol=SHOW_36)
    inside_job_40 = {"SLURM_JOB_ID": "40", "SLURM_RESTART_COUNT": "0", "SLURM_JOB_END_TIME": "5"}
    code, out, _ = cli(
        capsys, "status", "--json", "--job-id", "36", env=inside_job_40, runner=runner
    )
    info = json.loads(out)
    assert code == 0 and (info["job_id"], info["restart_count"]) == ("36", 1)
    assert info["source"] == "squeue"  # not job 40's SLURM_JOB_END_TIME
    code, out, _ = cli(capsys, "status", "36", env={}, runner=runner)
    assert code == 0 and "restarts:     1" in out


def test_status_of_a_job_slurm_does_not_know(
    capsys: pytest.CaptureFixture[str], fakes: Any
) -> None:
    code, out, err = cli(capsys, "status", "36", env={}, runner=no_slurm(fakes))
    assert code == 0 and "restarts:     unknown (SLURM does not say)" in out
    assert "scontrol not found on PATH; the facts of job 36 stay unknown" in err


# -- details that cannot fake a line -------------------------------------------------------------


def test_a_detail_with_a_line_break_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    env = {"SLURM_JOB_ID": "5", "SLURMCLOCK_DIR": str(tmp_path)}
    fake = "x\n  2026-01-01 00:00:00  run 0  exited    rc=0"
    code, _, err = cli(capsys, "mark", "signal", f"why={fake}", env=env)
    assert code == 2 and "why=... holds a line break" in err
    assert not (tmp_path / "job-5.jsonl").exists()


def test_a_line_break_written_by_a_program_is_shown_escaped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    timeline = JobTimeline(directory=tmp_path, env={"SLURM_JOB_ID": "5"})
    fake = "x\n  2026-01-01 00:00:00  run 0  exited    rc=0"
    assert timeline.mark("signal", why=fake, **{"odd\nkey": 1})
    code, out, _ = cli(capsys, "timeline", "--job-id", "5", env={"SLURMCLOCK_DIR": str(tmp_path)})
    assert code == 0 and "exited" not in out.replace("\\n  2026-01-01 00:00:00  run 0  exited", "")
    assert len(out.splitlines()) == 2, out  # the header and the one event
    assert 'why="x\\n  2026' in out and '"odd\\nkey"=1' in out


def test_the_timeline_api_refuses_a_reserved_detail(tmp_path: Path) -> None:
    timeline = JobTimeline(directory=tmp_path, env={"SLURM_JOB_ID": "5"})
    with pytest.raises(ValueError, match="restart: reserved in a timeline line"):
        timeline.mark("saved", restart=9)
    assert timeline.events() == []


# -- a run of checkpoints is one summary --------------------------------------------------------


def test_a_run_of_checkpoints_is_its_first_and_last(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    saves = [{"event": "checkpoint", "time": 1e9 + i, "step": 100 * i} for i in range(1, 51)]
    write(
        tmp_path / "job-7.jsonl",
        {"event": "start", "time": 1e9},
        *saves,
        {"event": "saved", "time": 1e9 + 60, "seconds": 1.0},
        {"event": "checkpoint", "time": 1e9 + 61, "step": 5100},
    )
    env = {"SLURMCLOCK_DIR": str(tmp_path)}
    code, out, _ = cli(capsys, "timeline", "--job-id", "7", env=env)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 1 + 1 + 3 + 1 + 1, out
    assert lines[2].endswith("checkpoint step=100") and lines[4].endswith("checkpoint step=5000")
    assert lines[3].strip() == "... 48 more checkpoints, steps 200 to 4900 (--all shows each)"
    assert lines[6].endswith("checkpoint step=5100")
    code, out, _ = cli(capsys, "timeline", "7", "--all", env=env)
    assert code == 0 and out.count(" checkpoint ") == 51
    code, out, _ = cli(capsys, "timeline", "7", "--json", env=env)
    assert len(json.loads(out)["events"]) == 53  # JSON: every event, as written
