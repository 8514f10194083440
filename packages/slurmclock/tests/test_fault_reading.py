"""slurmclock.supervisor.faults: ddpkit's fault records as the supervisor reads them (bad lines
skipped, records of earlier launches left out, both time forms)."""

from __future__ import annotations

import json
from pathlib import Path

from slurmclock.supervisor.faults import Fault, read_faults


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
