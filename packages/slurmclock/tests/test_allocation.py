"""allocation_start: when the current allocation began (for the start-up cost report)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from slurmclock import CommandError, allocation_start, process_start_time


def test_slurm_job_start_time_wins(fakes: Any) -> None:
    runner = fakes.Runner(squeue="2026-01-01T00:00:00\n")
    got = allocation_start(
        env={"SLURM_JOB_ID": "5", "SLURM_JOB_START_TIME": "1800000000"}, runner=runner
    )
    assert (got.at, got.source) == (1800000000.0, "SLURM_JOB_START_TIME") and runner.calls == []


def test_squeue_start_time_of_this_run(fakes: Any) -> None:
    runner = fakes.Runner(squeue=f"{fakes.iso(1_800_000_100)}\n")
    got = allocation_start(env={"SLURM_JOB_ID": "5"}, runner=runner)
    assert (got.at, got.source) == (1_800_000_100, "squeue")
    assert runner.calls == [("squeue", "-h", "-o", "%S", "-j", "5")]
    assert got.seconds_since(1_800_000_112.5) == 12.5


@pytest.mark.parametrize(
    "answer", ["N/A\n", "garbage\n", "", CommandError(["squeue"], "timeout", "timed out")]
)
def test_anything_unusable_falls_back_to_the_process_start(
    fakes: Any, answer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        got = allocation_start(
            env={"SLURM_JOB_ID": "5", "SLURM_JOB_START_TIME": "yesterday"},
            runner=fakes.Runner(squeue=answer),
        )
    assert got.source == "process" and got.at == pytest.approx(process_start_time(), abs=1e-6)
    assert "ignoring SLURM_JOB_START_TIME" in caplog.text


def test_outside_slurm_it_is_the_process_start(fakes: Any) -> None:
    runner = fakes.Runner()
    got = allocation_start(env={}, runner=runner)
    assert got.source == "process" and runner.calls == []


def test_a_broken_runner_does_not_raise(fakes: Any) -> None:
    def boom(argv: Any, timeout: float) -> str:
        raise RuntimeError("bug")

    assert allocation_start(env={"SLURM_JOB_ID": "5"}, runner=boom).source == "process"
