"""Chaos rows for shared files (issue 34, item 8): every fault of files_faults.FAULTS at every
path one process writes and another reads -- ddpkit's fault record, the job's timeline, the
budget's state file, the app's metrics.jsonl -- through the real readers, and at the timeline
and the fault record of a real single-node SLURM job run by the real ``slurmclock supervise``.

Each row asserts: no crash, no block (a bound from this machine's measured read speed), the
bad lines skipped and counted, what is said said once on one line (values quoted), and the run
goes on (the good line is read; the job's step runs to its end).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from files_faults import FAULTS, FORGED, ROOT, Fault, finishes, localslurm

from slurmclock import TimeBudget
from slurmclock.supervisor.faults import FaultWatch, read_faults
from slurmclock.timeline import JobTimeline
from slurmclock.untrusted import MAX_BYTES, read_records

GOOD_FAULT = b'{"time": 5.0, "rank": 1, "host": "n1", "what": "dead", "reporter": 0}\n'
GOOD_EVENT = b'{"event": "start", "time": 5.0, "restart": 0, "host": "n1", "pid": 1}\n'
JOB_ENV = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"}


def _measured_allowance() -> float:
    """Seconds a reader may take: reading a full-size file of good lines on this machine, with
    room for a busy one (x20) and the thread's start (+2 s). A blocked read never returns."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "full.jsonl"
        path.write_bytes(GOOD_EVENT * (MAX_BYTES // len(GOOD_EVENT)))
        start = time.monotonic()
        read_records(path)
        return 2.0 + 20 * (time.monotonic() - start)


ALLOW = _measured_allowance()
IDS = [f.name for f in FAULTS]


def one_line_each(lines: list[str]) -> None:
    assert all("\n" not in line and "\x1b" not in line for line in lines), lines


# -- the real readers, in this process --------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS, ids=IDS)
def test_the_fault_record(tmp_path: Path, fault: Fault) -> None:
    path = tmp_path / "faults.jsonl"
    path.write_bytes(b"")
    watch = FaultWatch(path, 0.0, nodes=lambda: ["n1"])
    fault.apply(path, GOOD_FAULT)
    seen = finishes(watch.new, ALLOW)
    after = finishes(lambda: read_faults(path, 0.0), ALLOW)
    one_line_each(watch.said)
    if not fault.writes:  # refused; 2 GB of holes are read from their tail: one bad "line"
        assert seen == [] and after == [] and len(watch.said) <= 1
    elif fault.name == "forged host":
        assert [f.host for f in seen] == ["n1"] and watch.ignored == 1
        (said,) = watch.said
        assert "'evil\\n[2026-01-01 00:00:00] slurmclock: FORGED\\x1b[2J'" in said
    else:
        assert [f.host for f in seen] == ["n1"] and [f.host for f in after] == ["n1"]
        assert watch.skipped == len(fault.lines or ()) and len(watch.said) == 1


@pytest.mark.parametrize("fault", FAULTS, ids=IDS)
def test_the_timeline(tmp_path: Path, fault: Fault, caplog: pytest.LogCaptureFixture) -> None:
    timeline = JobTimeline(env=JOB_ENV, directory=tmp_path)
    assert timeline.path is not None
    fault.apply(timeline.path, GOOD_EVENT)
    with caplog.at_level(logging.WARNING, "slurmclock"):
        events = finishes(timeline.events, ALLOW)
        finishes(timeline.events, ALLOW)
        finishes(lambda: TimeBudget(timeline=timeline).should_stop(), ALLOW)
        finishes(lambda: timeline.mark("exited", rc=0), ALLOW)
    said = [r.getMessage() for r in caplog.records if "job timeline" in r.getMessage()]
    one_line_each(said)
    if fault.writes:
        assert [e.name for e in events][:1] == ["start"]
        bad = 0 if fault.name == "forged host" else len(fault.lines or ())
        assert len(timeline.unreadable) == bad and len(said) == (1 if bad else 0)
        assert [e.name for e in timeline.events()][-1] == "exited"  # marks go on after it
    else:
        assert events == [] or fault.name == "2 GB sparse file"
        assert len(said) <= 2  # once reading, once writing: each said once


@pytest.mark.parametrize("fault", FAULTS, ids=IDS)
def test_the_budget_state(tmp_path: Path, fault: Fault) -> None:
    path = tmp_path / "time_budget.json"
    good = TimeBudget()
    good.record_save(3.0)
    assert good.save_state_file(path) is None
    fault.apply(path, path.read_bytes())
    budget = TimeBudget()
    problem = finishes(lambda: budget.load_state_file(path), ALLOW)
    assert problem is not None and "\n" not in problem  # said in one line; the guesses stand
    assert budget.save_estimate is None
    finishes(budget.should_stop, ALLOW)


@pytest.mark.parametrize(
    "state",
    [
        {"version": 1, "saves": [10**400]},
        {"version": 1, "saves": [[[[[1.0]]]]]},
        {"version": 1, "saves": [float("nan")]},
        {"version": 10**400},
        {"version": 1, "exits": [{"job": "1\n[x] forged", "restart": 10**400, "seconds": 1}]},
    ],
)
def test_the_budget_state_in_checkpoint_metadata(state: dict[str, Any]) -> None:
    """What ckptstore hands back from a manifest: hostile values are one ValueError line."""
    budget = TimeBudget()
    with pytest.raises(ValueError) as raised:
        budget.load_state_dict(state)
    assert "\n" not in str(raised.value)[:400] and budget.save_estimate is None


@pytest.mark.parametrize("fault", FAULTS, ids=IDS)
def test_the_metrics_file(tmp_path: Path, fault: Fault, capsys: pytest.CaptureFixture[str]) -> None:
    from pyrecover_train import report

    path = tmp_path / "metrics.jsonl"
    start = {"event": "start", "time": 1.0, "run_id": "r1", "step": 0, "pid": 1, "host": "n1"}
    fault.apply(path, json.dumps(start).encode() + b"\n")
    code = finishes(
        lambda: report.main([str(tmp_path), "--metrics", str(path), "--no-plot"]), ALLOW
    )
    out = capsys.readouterr()
    assert code in (0, 2) and "Traceback" not in out.err
    said = out.err.splitlines()
    assert len(said) <= 2 and all(line.startswith("pyrecover-train report:") for line in said)
    if fault.writes and fault.name != "forged host":
        assert "skipped" in out.err


# -- a real SLURM job, the real supervisor ----------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tool = localslurm()
    reason = tool.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    c = tool.LocalCluster(tmp_path_factory.mktemp("slurm"), cpus=len(FAULTS) + 2)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def jobs(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path]]:
    """One job per fault, all submitted at once: fault name -> (job id, its log)."""
    folder = tmp_path_factory.mktemp("files")
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    env = {"SLURMCLOCK_DIR": str(folder / "timelines"), "PATH": path}
    out = {}
    for i, fault in enumerate(FAULTS):
        log = folder / f"job-{i}.log"
        script = (
            f"#!/bin/bash\nexec {sys.executable} {ROOT / 'chaos/files_job.py'} '{fault.name}'\n"
        )
        job = cluster.sbatch(script, "--time=2", f"--output={log}", env=env)
        out[fault.name] = (job, log)
    return out


@pytest.mark.slurm
@pytest.mark.parametrize("fault", FAULTS, ids=IDS)
def test_the_supervised_job(cluster: Any, jobs: dict[str, tuple[str, Path]], fault: Fault) -> None:
    job, log = jobs[fault.name]
    info = cluster.wait_for(job, {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"}, timeout=90)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info.get("ExitCode") == "0:0", text
    assert "stand-in trainer done" in text and "training step exited with status 0" in text, text
    assert "Traceback" not in text, text
    lines = text.splitlines()
    assert not any(line.startswith(FORGED) for line in lines), text
    about_timeline = [line for line in lines if "job timeline" in line]
    assert len(about_timeline) <= 4, text  # two readers (supervisor, trainer), each once
    about_faults = [line for line in lines if "fault record" in line]
    if fault.name == "forged host":
        assert any("ignored a fault record naming 'evil\\n" in line for line in lines), text
    elif fault.writes:
        assert len(about_faults) == 1 and "skipped" in about_faults[0], text
        assert any("skipped" in line for line in about_timeline), text
    else:
        assert about_faults == [], text
