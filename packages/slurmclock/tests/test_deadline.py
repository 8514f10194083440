"""Deadline discovery: source order, parsing, bounded re-polling, fallbacks on bad input."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from slurmclock import (
    CommandError,
    Deadline,
    DeadlineWatcher,
    find_deadline,
    parse_duration,
    parse_time,
    process_start_time,
)
from slurmclock.slurm import parse_limit as _parse_limit

JOB = {"SLURM_JOB_ID": "42"}

# Real `scontrol show job` output from SLURM 22.05 (this machine), with a hostile job name.
SCONTROL = """JobId=42 JobName=EndTime=2001-01-01T00:00:00 my job
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   JobState=RUNNING Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   RunTime=00:00:02 TimeLimit={limit} TimeMin=N/A
   SubmitTime=2026-11-22T10:54:40 EligibleTime=2026-11-22T10:54:40
   StartTime=2026-11-22T10:54:41 EndTime={end} Deadline=N/A
   Command=/tmp/a b/job.sh EndTime=garbage
   WorkDir=/tmp
"""


def scontrol(end: str, limit: str = "01:00:00") -> str:
    return SCONTROL.format(end=end, limit=limit)


def watcher(
    clock: Any, runner: Any, env: dict[str, str] | None = None, **kw: Any
) -> DeadlineWatcher:
    return DeadlineWatcher(env=JOB if env is None else env, runner=runner, clock=clock, **kw)


# -- parsing -----------------------------------------------------------------------------------


def test_parse_time_accepts_epoch_and_iso() -> None:
    assert parse_time(1_900_000_000) == 1_900_000_000.0
    assert parse_time(" 1900000000.5 ") == 1_900_000_000.5
    assert parse_time("2030-03-17T17:46:40Z") == 1_900_000_000.0
    assert parse_time("2030-03-17T19:46:40+02:00") == 1_900_000_000.0
    naive = datetime(2030, 3, 17, 12, 0, 0)  # no offset: local time, like squeue prints
    assert parse_time("2030-03-17T12:00:00") == naive.timestamp()
    assert parse_time("2030-03-17 12:00:00") == naive.timestamp()


@pytest.mark.parametrize("bad", ["", "tomorrow", "2030-13-01T00:00:00", "nan", "-5", "0", True])
def test_parse_time_rejects_garbage_with_a_hint(bad: Any) -> None:
    with pytest.raises(ValueError, match="epoch|valid|not a time"):
        parse_time(bad)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (90, 90.0),
        ("90", 90.0),
        ("1.5h", 5400.0),
        ("15m", 900.0),
        ("30s", 30.0),
        ("2d", 172800.0),
    ],
)
def test_parse_duration_is_the_human_reader(text: Any, seconds: float) -> None:
    assert parse_duration(text) == seconds  # the 0.1 name, kept for compatibility


@pytest.mark.parametrize(
    "bad", ["", "soon", "1:2:3:4", "-5", "5x", float("inf"), -1, "1:30:00", "1-00:00:00"]
)
def test_parse_duration_rejects_garbage(bad: Any) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


def test_deadline_reports_time_left_and_iso() -> None:
    d = Deadline(1_900_000_000.0, "squeue", "42")
    assert d.seconds_left(1_899_999_000.0) == 1000.0
    assert d.seconds_left(1_900_000_010.0) == -10.0
    assert parse_time(d.iso() or "") == d.end  # ISO with offset round-trips exactly
    assert "squeue" in str(d) and "42" in str(d)
    none = Deadline(None, "none")
    assert none.seconds_left(0.0) is None and none.iso() is None
    assert str(none).startswith("no deadline")


def test_process_start_time_is_when_this_process_began() -> None:
    before = time.time()
    code = "import time, slurmclock; print(slurmclock.process_start_time(), time.time())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    started, inside = map(float, out.stdout.split())
    # /proc's boot time has 1 s resolution, so allow that much below the spawn time.
    assert before - 1.0 <= started <= inside
    assert process_start_time() <= time.time()


# -- source order ------------------------------------------------------------------------------


def test_override_beats_everything_and_never_shells_out(clock: Any, fakes: Any) -> None:
    runner = fakes.Runner(squeue=f"{fakes.iso(clock.now + 999)} 1:00:00")
    env = {**JOB, "PYRECOVER_END_TIME": str(clock.now + 50), "SLURM_JOB_END_TIME": "1"}
    w = watcher(clock, runner, env, end_time=clock.now + 10)
    d = w.get()
    assert (d.end, d.source, d.job_id) == (clock.now + 10, "override", "42")
    assert runner.calls == []


def test_env_override_beats_time_limit_and_slurm(clock: Any, fakes: Any) -> None:
    runner = fakes.Runner(squeue=f"{fakes.iso(clock.now + 999)} 1:00:00")
    env = {**JOB, "PYRECOVER_END_TIME": "2030-03-17T17:50:00Z"}
    d = watcher(clock, runner, env, time_limit=20).get()
    assert (d.end, d.source) == (1_900_000_200.0, "PYRECOVER_END_TIME")
    assert runner.calls == []


def test_malformed_env_override_warns_and_falls_back(
    clock: Any, fakes: Any, caplog: pytest.LogCaptureFixture
) -> None:
    runner = fakes.Runner(squeue=f"{fakes.iso(clock.now + 600)} 10:00")
    env = {**JOB, "PYRECOVER_END_TIME": "in an hour"}
    d = watcher(clock, runner, env).get()
    assert (d.end, d.source) == (clock.now + 600, "squeue")
    assert "ignoring PYRECOVER_END_TIME" in caplog.text


def test_time_limit_counts_from_started_at(clock: Any, fakes: Any) -> None:
    runner = fakes.Runner()
    assert watcher(clock, runner, {}, time_limit="1:00:00", started_at=1000.0).get().end == 4600.0
    # With an injected clock and no started_at, the limit counts from the clock's "now".
    d = watcher(clock, runner, {}, time_limit=90).get()
    assert (d.end, d.source, d.job_id) == (clock.now + 90, "time-limit", None)


@pytest.mark.parametrize(
    ("limit", "seconds"),
    [("90", 5400.0), ("0:30", 60.0), ("1-0", 86400.0), ("30s", 30.0), (30, 30.0), (2.5, 2.5)],
)
def test_a_time_limit_string_is_read_as_sbatch_reads_it(
    clock: Any, fakes: Any, limit: Any, seconds: float
) -> None:
    d = watcher(clock, fakes.Runner(), {}, time_limit=limit, started_at=1000.0).get()
    assert (d.end, d.source) == (1000.0 + seconds, "time-limit")


@pytest.mark.parametrize("limit", ["0", "0:00", "UNLIMITED", "infinite", "-1", math.inf])
def test_a_time_limit_of_0_or_unlimited_means_no_deadline(
    clock: Any, fakes: Any, limit: Any
) -> None:
    runner = fakes.Runner(squeue=f"{fakes.iso(clock.now + 60)} 1:00")
    d = watcher(clock, runner, JOB, time_limit=limit).get()
    assert d == Deadline(None, "time-limit", "42") and runner.calls == []


@pytest.mark.parametrize(
    ("limit", "seconds"),
    [("7:00", 420.0), ("1:00:00", 3600.0), ("2-00:00:00", 172800.0), ("59:60", 3600.0)],
)
def test_squeues_time_limit_is_read_as_slurm_prints_it(
    clock: Any, fakes: Any, limit: str, seconds: float
) -> None:
    """squeue prints %l as [D-][H:]MM:SS: "7:00" is 7 minutes, not 7 hours."""
    assert _parse_limit(limit) == seconds
    assert _parse_limit("UNLIMITED") == math.inf
    assert _parse_limit("Partition_Limit") is None and _parse_limit("INVALID") is None


def test_time_limit_counts_from_process_start_by_default() -> None:
    d = DeadlineWatcher(time_limit=3600, env={}).get()
    assert d.end is not None
    assert d.end - 3600 <= time.time()
    assert d.end - 3600 == pytest.approx(process_start_time(), abs=1e-6)


def test_bad_arguments_raise_with_a_fix(clock: Any, fakes: Any) -> None:
    with pytest.raises(ValueError, match="end_time: 'tomorrow' is neither"):
        DeadlineWatcher(end_time="tomorrow")
    with pytest.raises(
        ValueError, match="time_limit: 'forever' is not a time limit: give it as sbatch"
    ):
        DeadlineWatcher(time_limit="forever")
    with pytest.raises(ValueError, match="poll_interval must be >= 1 s"):
        DeadlineWatcher(poll_interval=0.1)
    with pytest.raises(ValueError, match="command_timeout"):
        DeadlineWatcher(command_timeout=0)


def test_outside_slurm_there_is_no_deadline(clock: Any, fakes: Any) -> None:
    runner = fakes.Runner(squeue="should not be asked")
    w = watcher(clock, runner, {})
    assert w.get() == Deadline(None, "none", None)
    assert w.seconds_left() is None
    assert runner.calls == []


def test_squeue_is_asked_for_the_job_and_parsed_as_local_time(clock: Any, fakes: Any) -> None:
    runner = fakes.Runner(squeue=f"{fakes.iso(clock.now + 1234)} 1:00:00\n")
    w = watcher(clock, runner)
    assert w.get() == Deadline(clock.now + 1234, "squeue", "42")
    assert w.seconds_left() == 1234
    assert runner.calls == [("squeue", "-h", "-o", "%e %l", "-j", "42")]


def test_squeue_with_end_only_output_works(clock: Any, fakes: Any) -> None:
    # Someone's wrapper (or a fake) printing only %e is fine too.
    runner = fakes.Runner(squeue=fakes.iso(clock.now + 60))
    assert watcher(clock, runner).get().end == clock.now + 60


@pytest.mark.parametrize(
    "line", ["NONE UNLIMITED", "2027-11-22T10:53:39 365-00:00:00", "Unknown INFINITE"]
)
def test_a_job_without_time_limit_has_no_deadline(clock: Any, fakes: Any, line: str) -> None:
    runner = fakes.Runner(squeue=line, scontrol="must not be needed")
    d = watcher(clock, runner).get()
    assert (d.end, d.source) == (None, "squeue")
    assert runner.count("scontrol") == 0


@pytest.mark.parametrize(
    "squeue",
    [
        "Unknown 1:00:00",
        "N/A 1:00:00",
        "NONE",
        "",
        "\n\n",
        "2026-99-99T00:00:00 1:00:00",
        "squeue: error: slurm_load_jobs",
        CommandError(["squeue"], "failed", "exited with 1: Invalid job id", returncode=1),
        CommandError(["squeue"], "timeout", "timed out after 10 s"),
        CommandError(["squeue"], "missing", "squeue not found on PATH"),
    ],
    ids=repr,
)
def test_unusable_squeue_falls_back_to_scontrol(
    clock: Any, fakes: Any, caplog: pytest.LogCaptureFixture, squeue: Any
) -> None:
    runner = fakes.Runner(squeue=squeue, scontrol=scontrol(fakes.iso(clock.now + 300)))
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        d = watcher(clock, runner).get()
    assert (d.end, d.source) == (clock.now + 300, "scontrol")
    assert runner.calls[-1] == ("scontrol", "show", "job", "42")
    assert "squeue" in caplog.text  # said why squeue was not used


def test_scontrol_reports_unlimited(clock: Any, fakes: Any) -> None:
    runner = fakes.Runner(scontrol=scontrol(fakes.iso(clock.now + 365 * 86400), "UNLIMITED"))
    assert watcher(clock, runner).get() == Deadline(None, "scontrol", "42")


@pytest.mark.parametrize("text", ["", "JobId=42 JobState=RUNNING", "EndTime=garbage TimeLimit=1"])
def test_nothing_usable_means_no_deadline_and_no_crash(
    clock: Any, fakes: Any, caplog: pytest.LogCaptureFixture, text: str
) -> None:
    runner = fakes.Runner(squeue="Unknown 1:00:00", scontrol=text)
    d = watcher(clock, runner).get()
    assert d == Deadline(None, "none", "42")
    assert "scontrol" in caplog.text


def test_missing_binaries_mean_no_deadline_with_a_hint(
    clock: Any, fakes: Any, caplog: pytest.LogCaptureFixture
) -> None:
    d = watcher(clock, fakes.Runner()).get()
    assert d == Deadline(None, "none", "42")
    assert "not found on PATH (inside a container" in caplog.text


def test_a_crashing_custom_runner_is_a_warning_not_a_crash(
    clock: Any, fakes: Any, caplog: pytest.LogCaptureFixture
) -> None:
    runner = fakes.Runner(squeue=RuntimeError("boom"), scontrol=KeyError("bang"))
    assert watcher(clock, runner).get().source == "none"
    assert "RuntimeError: boom" in caplog.text


def test_real_subprocess_runner_with_missing_binaries(clock: Any) -> None:
    # The default runner on a PATH without SLURM: a warning and no deadline.
    from slurmclock import SubprocessRunner

    w = DeadlineWatcher(env=JOB, runner=SubprocessRunner(env={"PATH": "/nonexistent"}), clock=clock)
    assert w.get() == Deadline(None, "none", "42")


# -- SLURM_JOB_END_TIME ------------------------------------------------------------------------


def test_slurm_job_end_time_first_then_live_polls(clock: Any, fakes: Any) -> None:
    env = {**JOB, "SLURM_JOB_END_TIME": str(int(clock.now + 100))}
    live = [f"{fakes.iso(clock.now + 700)} 10:00"]
    runner = fakes.Runner(squeue=lambda argv: live[0])
    w = watcher(clock, runner, env)
    assert w.get() == Deadline(clock.now + 100, "SLURM_JOB_END_TIME", "42")
    assert runner.calls == []  # no subprocess at start-up
    clock.advance(60)
    assert w.get() == Deadline(clock.now - 60 + 700, "squeue", "42")  # the extension is seen
    live[0] = "Unknown 10:00"
    clock.advance(60)
    assert w.get().source == "squeue"  # squeue broke: keep the last good answer
    w2 = watcher(clock, fakes.Runner(), env)
    w2.get()
    clock.advance(60)
    assert w2.get().source == "SLURM_JOB_END_TIME"  # no live answer: the env stays


def test_malformed_slurm_job_end_time_falls_back(clock: Any, fakes: Any) -> None:
    env = {**JOB, "SLURM_JOB_END_TIME": "soon"}
    runner = fakes.Runner(squeue=f"{fakes.iso(clock.now + 60)} 1:00")
    assert watcher(clock, runner, env).get().source == "squeue"


# -- polling -----------------------------------------------------------------------------------


def test_polls_at_most_every_poll_interval_and_sees_extensions(clock: Any, fakes: Any) -> None:
    end = [clock.now + 600]
    runner = fakes.Runner(squeue=lambda argv: f"{fakes.iso(end[0])} 10:00")
    w = watcher(clock, runner, poll_interval=30)
    for _ in range(1000):  # a thousand training steps within one interval
        assert w.get().end == end[0]
        clock.advance(0.02)
    assert runner.count("squeue") == 1
    assert w.polls == 1
    end[0] += 3600  # scontrol update TimeLimit=+60
    clock.advance(10.1)
    assert w.get().end == end[0]
    assert runner.count("squeue") == 2
    assert w.refresh().end == end[0]  # a forced poll
    assert runner.count("squeue") == 3


def test_a_failed_poll_keeps_the_last_good_deadline(
    clock: Any, fakes: Any, caplog: pytest.LogCaptureFixture
) -> None:
    answers = [f"{fakes.iso(clock.now + 600)} 10:00"]
    runner = fakes.Runner(squeue=lambda argv: answers[0])
    w = watcher(clock, runner)
    first = w.get()
    answers[0] = "slurm_load_jobs error: Socket timed out"
    for _ in range(5):
        clock.advance(61)
        assert w.get() == first
    assert caplog.text.count("keeping the last known deadline") == 1  # warned once, not per poll
    assert caplog.text.count("cannot read squeue") == 1


def test_clock_going_back_forces_a_poll(clock: Any, fakes: Any) -> None:
    runner = fakes.Runner(squeue=lambda argv: f"{fakes.iso(clock.now + 600)} 10:00")
    w = watcher(clock, runner)
    w.get()
    clock.advance(-5)
    w.get()
    assert runner.count("squeue") == 2


def test_clock_skew_far_in_the_past_is_ignored(
    clock: Any, fakes: Any, caplog: pytest.LogCaptureFixture
) -> None:
    past = fakes.iso(clock.now - 3600)
    runner = fakes.Runner(squeue=f"{past} 1:00:00", scontrol=scontrol(past))
    assert watcher(clock, runner).get() == Deadline(None, "none", "42")
    assert "clock skew" in caplog.text
    # Slightly past (the job is in its grace time): taken, and time left is negative.
    runner = fakes.Runner(squeue=f"{fakes.iso(clock.now - 20)} 1:00:00")
    w = watcher(clock, runner)
    assert w.get().source == "squeue"
    assert w.seconds_left() == -20


def test_find_deadline_is_one_look(clock: Any, fakes: Any) -> None:
    runner = fakes.Runner(squeue=f"{fakes.iso(clock.now + 5)} 1:00")
    assert find_deadline(env=JOB, runner=runner, clock=clock).end == clock.now + 5
    assert find_deadline(env={}) == Deadline(None, "none", None)
    assert find_deadline(end_time="2030-03-17T17:46:40Z").end == 1_900_000_000.0


def test_iso_uses_the_local_offset() -> None:
    d = Deadline(1_900_000_000.0, "override")
    local = datetime.fromtimestamp(1_900_000_000.0, tz=timezone.utc).astimezone()
    assert d.iso() == local.isoformat(timespec="seconds")
    assert datetime.fromisoformat(d.iso() or "").utcoffset() == local.utcoffset() or timedelta(0)
