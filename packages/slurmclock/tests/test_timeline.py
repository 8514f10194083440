"""JobTimeline: the per-job file the trainer and the batch script write and the next run reads."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from slurmclock import JobTimeline, timeline_dir


def timeline(tmp_path: Path, clock: Any, restart: int = 0, **env: str) -> JobTimeline:
    base = {"SLURM_JOB_ID": "123", "SLURM_RESTART_COUNT": str(restart), **env}
    return JobTimeline(directory=tmp_path, env=base, clock=clock)


def test_marks_are_json_lines_read_back_in_order(tmp_path: Path, clock: Any) -> None:
    t = timeline(tmp_path, clock)
    assert t.path == tmp_path / "job-123.jsonl"
    assert t.mark("start")
    clock.advance(5)
    assert t.mark("exited", rc=75)
    lines = [json.loads(x) for x in t.path.read_text().splitlines()]
    assert [x["event"] for x in lines] == ["start", "exited"]
    assert lines[1]["rc"] == 75 and lines[1]["restart"] == 0 and "host" in lines[1]
    events = t.events()
    assert [(e.name, e.time - clock.now) for e in events] == [("start", -5.0), ("exited", 0.0)]
    assert events[1].info["rc"] == 75


def test_exit_samples_per_finished_run(tmp_path: Path, clock: Any) -> None:
    for restart, (exit_s, requeue_s) in enumerate(((2.0, 0.5), (3.0, 1.0))):
        t = timeline(tmp_path, clock, restart)
        t.mark("start")
        t.mark("saved")  # a periodic save...
        clock.advance(100)
        t.mark("saved")  # ... and the final one: the measurement starts here
        clock.advance(exit_s)
        t.mark("exited", rc=75)
        clock.advance(requeue_s)
        t.mark("requeued")
        clock.advance(30)
    now = timeline(tmp_path, clock, 2)
    now.mark("start")
    now.mark("saved")  # this run has not ended: no sample from it
    samples = now.exit_samples()
    assert [(s.restart, s.seconds, s.exit_s) for s in samples] == [(0, 2.5, 2.0), (1, 4.0, 3.0)]
    assert all(s.job == "123" for s in samples)


def test_a_run_that_only_exited_counts_its_exit(tmp_path: Path, clock: Any) -> None:
    t = timeline(tmp_path, clock)
    t.mark("saved")
    clock.advance(1.5)
    t.mark("exited", rc=0)
    (sample,) = timeline(tmp_path, clock, 1).exit_samples()
    assert sample.seconds == 1.5 and sample.exit_s == 1.5


def test_unreadable_lines_are_skipped(tmp_path: Path, clock: Any) -> None:
    t = timeline(tmp_path, clock)
    t.mark("saved")
    with open(t.path, "a") as f:  # type: ignore[arg-type]
        f.write('not json\n{"event": 1}\n{"time": 3}\n\n')
    clock.advance(2)
    t.mark("requeued")
    assert [e.name for e in t.events()] == ["saved", "requeued"]
    assert timeline(tmp_path, clock, 1).exit_samples()[0].seconds == 2.0


def test_only_rank_0_writes(tmp_path: Path, clock: Any) -> None:
    assert not timeline(tmp_path, clock, RANK="3").mark("saved")
    assert not timeline(tmp_path, clock, SLURM_PROCID="1").mark("saved")
    assert timeline(tmp_path, clock, RANK="0", SLURM_PROCID="1").mark("saved")
    assert len(timeline(tmp_path, clock).events()) == 1


def test_outside_slurm_nothing_is_written(tmp_path: Path, clock: Any) -> None:
    t = JobTimeline(directory=tmp_path, env={}, clock=clock)
    assert t.path is None and not t.mark("start") and t.events() == []
    assert list(tmp_path.iterdir()) == []


def test_unknown_event_or_bad_time_is_a_value_error(tmp_path: Path, clock: Any) -> None:
    with pytest.raises(ValueError, match="unknown timeline event 'done': use one of start"):
        timeline(tmp_path, clock).mark("done")
    with pytest.raises(ValueError, match="at must be a finite number of seconds"):
        timeline(tmp_path, clock).mark("saved", at=float("nan"))


def test_unwritable_directory_warns_once_and_goes_on(
    tmp_path: Path, clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # A folder under a file: unwritable for root too (a read-only mode bit is not, and CI is root).
    (tmp_path / "file").write_text("")
    t = JobTimeline(directory=tmp_path / "file" / "locked", env={"SLURM_JOB_ID": "1"}, clock=clock)
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        assert not t.mark("start") and not t.mark("saved")
    assert caplog.text.count("cannot write the job timeline") == 1


def test_a_file_in_the_way_warns_and_goes_on(
    tmp_path: Path, clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    t = JobTimeline(directory=blocker / "sub", env={"SLURM_JOB_ID": "1"}, clock=clock)
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        assert not t.mark("start")
    assert "set SLURMCLOCK_DIR" in caplog.text


def test_where_the_file_lives(tmp_path: Path) -> None:
    assert timeline_dir({"SLURMCLOCK_DIR": str(tmp_path)}) == tmp_path
    assert timeline_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/slurmclock")
    assert timeline_dir({"HOME": "/h"}) == Path("/h/.cache/slurmclock")
    t = JobTimeline(env={"SLURM_JOB_ID": "9", "SLURM_CLUSTER_NAME": "daint", "HOME": "/h"})
    assert t.path == Path("/h/.cache/slurmclock/daint-9.jsonl")
    assert JobTimeline("55", directory=tmp_path, env={}).path == tmp_path / "job-55.jsonl"


def test_every_loop_measures_its_exit_like_pyrecover_train(tmp_path: Path, clock: Any) -> None:
    """The TimeLoop (pyrecover-train's, the Lightning and HF callbacks') marks `saved` once the
    stop's checkpoint is durable; with `requeued` after it, the next allocation's budget keeps
    the measured exit free instead of the first guess."""
    from slurmclock import Deadline, TimeBudget, TimeLoop

    def loop(restart: int) -> TimeLoop:
        budget = TimeBudget(
            Deadline(None, "none"), timeline=timeline(tmp_path, clock, restart), env={}
        )
        return TimeLoop(budget, signals=("USR2",), launch=lambda: None)

    first = loop(0)
    assert first.budget.exit_estimate is None  # nothing measured: the initial guess stands
    first.request_stop("SIGTERM")
    act = first.after_step(1, seconds=1.0)
    with first.saving(act):
        first.saved(1, 0.5)
    clock.now += 3.0
    timeline(tmp_path, clock, 0).mark("requeued")
    second = loop(1)
    assert len(second.budget.state_dict()["exits"]) == 1
    assert second.budget.exit_estimate is not None and second.budget.exit_estimate < 10.0
