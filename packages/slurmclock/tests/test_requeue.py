"""requeue(), restart_count(), job_id(): clear answers, never exceptions."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from slurmclock import (
    CommandError,
    RequeueResult,
    array_task,
    in_slurm,
    job_id,
    requeue,
    restart_count,
)

DISABLED = "Requested operation is presently disabled for job 42\n"


def failed(stderr: str) -> CommandError:
    argv = ["scontrol", "requeue", "42"]
    return CommandError(argv, "failed", f"exited with 1: {stderr}", returncode=1, stderr=stderr)


def test_requeue_runs_scontrol_for_this_job(fakes: Any) -> None:
    runner = fakes.Runner(scontrol="")
    result = requeue(env={"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"}, runner=runner)
    assert result and result.ok and result.job_id == "42"
    assert result.message.startswith("requeued job 42 (restart 3)")
    assert runner.calls == [("scontrol", "requeue", "42")]


def test_requeue_of_another_job(fakes: Any) -> None:
    runner = fakes.Runner(scontrol="")
    assert requeue("77", env={}, runner=runner).message.startswith("requeued job 77;")
    assert runner.calls == [("scontrol", "requeue", "77")]


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (failed(DISABLED), "job 42 is not requeueable (submitted with --no-requeue, or "),
        (failed("Invalid job id specified for job 42"), "SLURM does not know job 42"),
        (failed("Access/permission denied for job 42"), "permission denied by SLURM"),
        (failed("Something else entirely"), "not requeued: job 42: Something else entirely"),
        (CommandError(["scontrol"], "missing", "scontrol not found on PATH"), "inside a container"),
        (CommandError(["scontrol"], "timeout", "timed out after 30 s"), "timed out"),
        (RuntimeError("runner bug"), "RuntimeError: runner bug"),
    ],
)
def test_requeue_failures_are_results_with_a_reason(
    fakes: Any, error: BaseException, expected: str
) -> None:
    result = requeue(env={"SLURM_JOB_ID": "42"}, runner=fakes.Runner(scontrol=error))
    assert not result and result.job_id == "42"
    assert expected in result.message
    assert result.message.startswith("not requeued")


def test_scontrol_killed_by_slurms_sigterm_is_unconfirmed(fakes: Any) -> None:
    """An accepted requeue SIGTERMs the job, scontrol included, maybe before it exits 0."""
    argv = ["scontrol", "requeue", "42"]
    killed = CommandError(argv, "failed", "exited with -15: no output", returncode=-15)
    result = requeue(env={"SLURM_JOB_ID": "42"}, runner=fakes.Runner(scontrol=killed))
    assert not result.ok and result.job_id == "42"
    assert result.message.startswith("requeue of job 42 not confirmed: scontrol was killed by")
    assert "SIGTERM" in result.message and "scontrol show job 42" in result.message


def test_not_requeueable_tells_how_to_fix_it(fakes: Any) -> None:
    result = requeue(env={"SLURM_JOB_ID": "42"}, runner=fakes.Runner(scontrol=failed(DISABLED)))
    assert "#SBATCH --requeue" in result.message


def test_requeue_outside_slurm(fakes: Any, caplog: pytest.LogCaptureFixture) -> None:
    runner = fakes.Runner(scontrol="")
    with caplog.at_level(logging.INFO, logger="slurmclock"):
        result = requeue(env={}, runner=runner)
    assert result == RequeueResult(
        False, "not requeued: not in a SLURM job (SLURM_JOB_ID is unset); pass the job id"
    )
    assert runner.calls == []


def test_requeue_with_the_real_runner_and_no_scontrol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    result = requeue(env={"SLURM_JOB_ID": "42"})
    assert not result.ok and "scontrol not found on PATH" in result.message


@pytest.mark.parametrize(
    ("value", "count", "warns"),
    [
        (None, 0, False),
        ("", 0, False),
        ("0", 0, False),
        ("3", 3, False),
        (" 2 ", 2, False),
        ("two", 0, True),
        ("-1", 0, True),
        ("1.5", 0, True),
    ],
)
def test_restart_count(
    value: str | None, count: int, warns: bool, caplog: pytest.LogCaptureFixture
) -> None:
    env = {} if value is None else {"SLURM_RESTART_COUNT": value}
    assert restart_count(env) == count
    assert ("SLURM_RESTART_COUNT" in caplog.text) is warns


def test_job_id_and_array_task(monkeypatch: pytest.MonkeyPatch) -> None:
    assert job_id({}) is None and not in_slurm({})
    assert job_id({"SLURM_JOB_ID": " 123 "}) == "123" and in_slurm({"SLURM_JOB_ID": "1"})
    env = {"SLURM_JOB_ID": "1240", "SLURM_ARRAY_JOB_ID": "1234", "SLURM_ARRAY_TASK_ID": "6"}
    assert job_id(env) == "1240" and array_task(env) == "1234_6"
    assert array_task({"SLURM_JOB_ID": "1"}) is None
    monkeypatch.setenv("SLURM_JOB_ID", "555")
    assert job_id() == "555"  # os.environ by default


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0, -1])
def test_requeue_refuses_a_bad_timeout(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
        requeue("1", timeout=timeout)
