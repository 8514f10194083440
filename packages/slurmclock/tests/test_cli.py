"""The slurmclock command line, in-process (fake SLURM) and as a real subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import slurmclock
from slurmclock import CommandError
from slurmclock.cli import main

JOB = {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1", "PATH": os.environ.get("PATH", "")}


def run(capsys: pytest.CaptureFixture[str], *argv: str, **kw: Any) -> tuple[int, str, str]:
    if kw.get("env") is not None:  # the test's own timeline directory (conftest)
        kw["env"] = {"SLURMCLOCK_DIR": os.environ["SLURMCLOCK_DIR"], **kw["env"]}
    code = main(list(argv), **kw)
    out, err = capsys.readouterr()
    return code, out, err


def squeue_in(fakes: Any, seconds: float) -> Any:
    return fakes.Runner(squeue=lambda argv: f"{fakes.iso(_now() + seconds)} 1:00:00")


def _now() -> float:
    import time

    return time.time()


def test_status_json_for_scripts(capsys: pytest.CaptureFixture[str], fakes: Any) -> None:
    code, out, _ = run(capsys, "status", "--json", env=JOB, runner=squeue_in(fakes, 600))
    info = json.loads(out)
    assert code == 0
    assert info["job_id"] == "42" and info["restart_count"] == 1 and info["source"] == "squeue"
    assert 590 < info["seconds_left"] <= 600
    assert slurmclock.parse_time(info["deadline"]) == info["end_time"]
    assert set(info) == {
        "job_id",
        "array_task",
        "restart_count",
        "deadline",
        "end_time",
        "seconds_left",
        "source",
        "chain",  # slurmclock.chain: the run's allocations (test_chain.py)
    }


def test_status_for_humans(capsys: pytest.CaptureFixture[str], fakes: Any) -> None:
    env = {**JOB, "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "2"}
    code, out, _ = run(capsys, "status", env=env, runner=squeue_in(fakes, 600))
    assert code == 0
    lines = dict(line.split(":", 1) for line in out.splitlines())
    assert lines["job"].strip() == "42 (array task 40_2)"
    assert lines["source"].strip() == "squeue" and lines["restarts"].strip() == "1"
    assert 590 <= int(lines["seconds left"]) <= 600


def test_seconds_left_and_end_time(capsys: pytest.CaptureFixture[str], fakes: Any) -> None:
    code, out, _ = run(capsys, "seconds-left", env=JOB, runner=squeue_in(fakes, 600))
    assert code == 0 and 590 <= int(out) <= 600
    code, out, _ = run(capsys, "end-time", "--epoch", "--end-time", "2030-03-17T17:46:40Z", env={})
    assert (code, out) == (0, "1900000000\n")
    code, out, _ = run(capsys, "end-time", "--end-time", "1900000000", env={})
    assert code == 0 and slurmclock.parse_time(out.strip()) == 1_900_000_000


def test_no_deadline_is_exit_1_with_a_reason(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "seconds-left", env={})
    assert (code, out) == (1, "")
    assert "no deadline (source: none)" in err
    code, out, _ = run(capsys, "status", "--json", env={})
    assert code == 0 and json.loads(out)["source"] == "none"


def test_broken_slurm_warns_and_still_answers(
    capsys: pytest.CaptureFixture[str], fakes: Any
) -> None:
    runner = fakes.Runner(squeue="garbage here", scontrol=CommandError(["x"], "timeout", "slow"))
    code, out, err = run(capsys, "status", "--json", env=JOB, runner=runner)
    assert code == 0 and json.loads(out)["source"] == "none"
    assert "squeue" in err and "scontrol" in err  # one warning line each, on stderr


def test_time_limit_and_job_id_options(capsys: pytest.CaptureFixture[str], fakes: Any) -> None:
    code, out, _ = run(capsys, "seconds-left", "--time-limit", "1h", env={})
    assert code == 0 and 3590 <= int(out) <= 3600
    runner = squeue_in(fakes, 100)
    code, out, _ = run(capsys, "status", "--json", "--job-id", "99", env={}, runner=runner)
    assert json.loads(out)["job_id"] == "99"
    assert runner.calls[0][-1] == "99"


def test_requeue_exit_codes(capsys: pytest.CaptureFixture[str], fakes: Any) -> None:
    code, out, _ = run(capsys, "requeue", env=JOB, runner=fakes.Runner(scontrol=""))
    assert code == 0 and out.startswith("requeued job 42")
    error = CommandError(["scontrol"], "failed", "x", returncode=1, stderr="presently disabled")
    code, out, err = run(capsys, "requeue", env=JOB, runner=fakes.Runner(scontrol=error))
    assert code == 1 and out == "" and "not requeueable" in err
    code, _, err = run(capsys, "requeue", env={})
    assert code == 1 and "not in a SLURM job" in err


def test_requeue_ignores_sigterm_while_it_runs(
    capsys: pytest.CaptureFixture[str], fakes: Any
) -> None:
    seen = []

    def scontrol(argv: Any) -> str:
        seen.append(signal.getsignal(signal.SIGTERM))
        return ""

    before = signal.getsignal(signal.SIGTERM)
    code, out, _ = run(capsys, "requeue", env=JOB, runner=fakes.Runner(scontrol=scontrol))
    assert code == 0 and out.startswith("requeued job 42")
    assert seen == [signal.SIG_IGN]  # scontrol inherits it
    assert signal.getsignal(signal.SIGTERM) == before  # and it is put back


def test_requeue_command_survives_the_sigterm_slurm_sends(tmp_path: Path) -> None:
    """A fake scontrol does what SLURM does on an accepted requeue: SIGTERM to the caller (and
    itself) before the answer arrives. The command still prints it and exits 0."""
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\nkill -TERM "$PPID" "$$"\nsleep 0.5\nexit 0\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(SLURM_JOB_ID="42", SLURM_RESTART_COUNT="0")
    out = subprocess.run(
        [sys.executable, "-m", "slurmclock", "requeue"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out
    assert out.stdout.startswith("requeued job 42 (restart 1)")


@pytest.mark.parametrize(
    "argv",
    [[], ["frobnicate"], ["status", "--jsn"], ["seconds-left", "--timeout", "soon"]],
)
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv, env={})
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slurmclock"), err  # one line, no usage block
    assert "error: " in err[0] and err[0].endswith("--help)"), err


def test_bad_override_values_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "status", "--end-time", "someday", env={})
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("slurmclock: error: --end-time: 'someday'")
    code, _, err = run(capsys, "seconds-left", "--time-limit", "a while", env={})
    assert code == 2 and "--time-limit: 'a while' is not a time limit: give it as sbatch" in err


@pytest.mark.parametrize(
    ("limit", "left"), [("90", 5400), ("0:30", 60), ("30s", 30), ("1:00:00", 3600)]
)
def test_time_limit_is_read_as_sbatch_time(
    capsys: pytest.CaptureFixture[str], limit: str, left: int
) -> None:
    code, out, _ = run(capsys, "seconds-left", "--time-limit", limit, env={})
    assert code == 0 and left - 2 <= int(out) <= left


def test_time_limit_0_is_no_deadline(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "seconds-left", "--time-limit", "0", env={})
    assert (code, out) == (1, "") and "no deadline (source: time-limit)" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"slurmclock {slurmclock.__version__}"


def test_python_dash_m_runs_the_cli() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYRECOVER_END_TIME"] = str(int(_now()) + 1000)
    out = subprocess.run(
        [sys.executable, "-m", "slurmclock", "status", "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    )
    info = json.loads(out.stdout)
    assert info["source"] == "PYRECOVER_END_TIME" and 900 < info["seconds_left"] <= 1000
    bad = subprocess.run(
        [sys.executable, "-m", "slurmclock", "seconds-left"],
        capture_output=True,
        text=True,
        env={**env, "PYRECOVER_END_TIME": "not a time"},
        timeout=60,
    )
    # Asked about it, the CLI refuses a malformed variable with one line (training skips it).
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("slurmclock: error: PYRECOVER_END_TIME: 'not a time' is neither")
    assert bad.stderr.count("\n") == 1


def test_huge_slurm_job_end_time_is_one_line_and_exit_2() -> None:
    """Issue 14: SLURM_JOB_END_TIME=99999999999999999999999 slurmclock status printed a
    traceback. Asked about it, the CLI names the variable and the fix in one line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYRECOVER_"))}
    env.update(SLURM_JOB_ID="42", SLURM_JOB_END_TIME="99999999999999999999999")
    for command in ("status", "seconds-left", "end-time"):
        out = subprocess.run(
            [sys.executable, "-m", "slurmclock", command],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert out.returncode == 2 and out.stdout == "", out
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
        assert out.stderr.startswith("slurmclock: error: SLURM_JOB_END_TIME: '9999")
        assert "before the year 10000; unset it or give epoch seconds / ISO-8601" in out.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_timeout_must_be_finite_and_positive(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    code, out, err = run(capsys, "status", "--timeout", value, env={})
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("slurmclock: error: --timeout must be a finite number of seconds > 0")


def test_mark_and_timeline(capsys: pytest.CaptureFixture[str], tmp_path: Path, fakes: Any) -> None:
    env = {**JOB, "SLURMCLOCK_DIR": str(tmp_path), "SLURM_RESTART_COUNT": "0"}
    assert run(capsys, "mark", "saved", env=env)[0] == 0
    assert run(capsys, "mark", "exited", "rc=75", "why=time", env=env)[0] == 0
    code, out, _ = run(capsys, "requeue", env=env, runner=fakes.Runner(scontrol=""))
    assert code == 0 and out.startswith("requeued job 42")
    code, out, _ = run(capsys, "timeline", "--json", env={**env, "SLURM_RESTART_COUNT": "1"})
    info = json.loads(out)
    assert code == 0 and info["job_id"] == "42" and info["path"] == str(tmp_path / "job-42.jsonl")
    assert [e["event"] for e in info["events"]] == ["saved", "exited", "requeued"]
    assert info["events"][1]["rc"] == 75 and info["events"][1]["why"] == "time"
    assert info["events"][2]["confirmed"] is True
    (sample,) = info["exits"]
    assert sample["restart"] == 0 and 0 <= sample["exit_s"] <= sample["seconds"] < 30
    code, out, _ = run(capsys, "timeline", env=env)
    assert code == 0 and "run 0: " in out and "s from the final save to the end" in out


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["mark", "done"], None, "invalid choice: 'done'"),
        (["mark", "saved", "rc"], 2, "'rc' is not KEY=VALUE (e.g. rc=75)"),
        (["mark", "saved", "time=3"], 2, "'time' is reserved: every timeline line has event"),
    ],
)
def test_mark_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], code: int | None, message: str
) -> None:
    if code is None:
        with pytest.raises(SystemExit) as e:
            main(argv, env=JOB)
        assert e.value.code == 2 and message in capsys.readouterr().err
        return
    got, out, err = run(capsys, *argv, env=JOB)
    assert (got, out) == (code, "") and message in err


def test_mark_outside_a_job_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "mark", "start", env={})
    assert code == 1 and "not in a SLURM job" in err
    code, _, err = run(capsys, "timeline", env={})
    assert code == 1 and "pass --job-id" in err


def test_stop_sends_term_to_the_batch_shell(capsys: pytest.CaptureFixture[str], fakes: Any) -> None:
    runner = fakes.Runner(scancel="")
    code, out, _ = run(capsys, "stop", "1234", env={}, runner=runner)
    assert code == 0 and "asked job 1234 to save and stop" in out
    assert runner.calls == [("scancel", "--batch", "--signal=TERM", "1234")]
    code, _, err = run(capsys, "stop", "12;rm", env={}, runner=runner)
    assert code == 2 and "is not a SLURM job id" in err
    failing = fakes.Runner(
        scancel=CommandError(["scancel"], "failed", "Invalid job id", returncode=1)
    )
    code, _, err = run(capsys, "stop", "99", env={}, runner=failing)
    assert code == 1 and "not stopped: Invalid job id" in err


def test_status_into_a_pipe_whose_reader_left() -> None:
    """`slurmclock status | head -1` must not print "Broken pipe": quiet, 141 as with SIGPIPE."""
    closedpipe = Path(__file__).resolve().parents[3] / "tools" / "closedpipe.py"
    status = [sys.executable, "-m", "slurmclock", "status", "--time-limit", "1h"]
    out = subprocess.run([sys.executable, closedpipe, *status], capture_output=True, timeout=60)
    assert (out.returncode, out.stderr) == (141, b"")
