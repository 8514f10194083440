"""Files another process writes are untrusted input: every reader of slurmclock survives any
bytes, never blocks on what sits at the path, counts what it skips and quotes what it logs."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurmclock import TimeBudget
from slurmclock.commands import CommandError
from slurmclock.supervisor import SuperviseConfig, Supervisor
from slurmclock.supervisor.faults import Fault, FaultWatch, parse_fault, read_faults
from slurmclock.timeline import JobTimeline
from slurmclock.untrusted import (
    MAX_DEPTH,
    MAX_LINE,
    NotRegularFile,
    Tail,
    parse_record,
    quote,
    read_records,
    safe_text,
)

sys.path.insert(0, str(Path(__file__).parent))
from untrusted_helpers import NONREGULAR, finishes, sparse  # noqa: E402  - shared with chaos/

ENV = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"}

# The lines that killed the supervisor and every trainer before (issue 34).
HOSTILE = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"event": "start", "time": ' + b"9" * 400 + b', "restart": 0}',
    b'{"event": "start", "time": 1' + b"0" * 400 + b'.0, "restart": 0}',
    b'{"event": "start", "time": 1e400, "restart": 0}',
    b'{"event": "start", "time": NaN, "restart": 0}',
    b'{"event": "start", "time": 1.0, "restart": ' + b"9" * 5000 + b"}",
    b'{"a": ' * 5000 + b"1" + b"}" * 5000,
    b'{"event": "start", "time": 1.0, "restart": 0, "x": "' + b"y" * (MAX_LINE + 10) + b'"}',
    b"\xff\xfe\x00garbage",
    b"[1, 2, 3]",
]


FILES = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
FORGED = "n1\n[2026-01-01 00:00:00] slurmclock: forged"


def timeline_at(tmp_path: Path) -> JobTimeline:
    return JobTimeline(env=ENV, directory=tmp_path)


# -- the reader itself -----------------------------------------------------------------------


@pytest.mark.parametrize("line", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_line_is_no_record(line: bytes) -> None:
    assert parse_record(line) is None


def test_records_within_the_bounds_are_read() -> None:
    nested = "[" * (MAX_DEPTH - 1) + "1" + "]" * (MAX_DEPTH - 1)
    assert parse_record(f'{{"a": {nested}}}') == {"a": json.loads(nested)}
    assert parse_record('{"time": 1795632000.25, "n": -12345678901234567890}') == {
        "time": 1795632000.25,
        "n": -12345678901234567890,
    }
    assert parse_record('{"s": "[[[[[[[[[[[[[[[[[[[[[[["}') is None  # counted: a safe excess


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2000))
def test_any_bytes_are_a_record_or_nothing(data: bytes) -> None:
    record = parse_record(data)
    assert record is None or isinstance(record, dict)


@FILES
@given(st.lists(st.one_of(st.binary(max_size=300), st.sampled_from(HOSTILE[1:6])), max_size=8))
def test_any_file_reads_without_raising(tmp_path: Path, lines: list[bytes]) -> None:
    path = tmp_path / "any.jsonl"
    good = b'{"event": "start", "time": 5.0, "restart": 0}'
    path.write_bytes(b"\n".join([*lines, good]) + b"\n")
    found = finishes(lambda: read_records(path))
    assert found.error is None and found.records[-1] == json.loads(good)
    assert len(found.records) + len(found.skipped) <= len(lines) + 1 + sum(
        line.count(b"\n") for line in lines
    )


def test_a_big_file_is_read_from_its_tail(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    lines = [json.dumps({"n": i}).encode() for i in range(2000)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    found = read_records(path, limit=1000)
    assert found.tail and found.records and found.records[-1] == {"n": 1999}
    assert found.records[0]["n"] > 1800 and not found.skipped  # the cut line is not a record


def test_a_sparse_2gb_file_costs_its_bound(tmp_path: Path) -> None:
    path = tmp_path / "sparse.jsonl"
    sparse(path)
    found = finishes(lambda: read_records(path))
    assert found.tail and not found.records and found.skipped == [1]


def nonregular(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.jsonl"
    NONREGULAR[kind](path)
    return path


KINDS = list(NONREGULAR)


@pytest.mark.parametrize("kind", KINDS)
def test_what_is_not_a_regular_file_is_not_read(tmp_path: Path, kind: str) -> None:
    path = nonregular(tmp_path, kind)
    found = finishes(lambda: read_records(path))
    assert found.error and not found.records
    tail = Tail(path)
    assert finishes(tail.new) == [] and tail.error


def test_a_fifo_is_refused_without_opening_it(tmp_path: Path) -> None:
    path = nonregular(tmp_path, "fifo")
    with pytest.raises(NotRegularFile, match="a FIFO"):
        finishes(lambda: __import__("slurmclock.untrusted").untrusted.open_regular(path))


def test_the_tail_reads_lines_as_they_come(tmp_path: Path) -> None:
    path = tmp_path / "grow.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b"')
    tail = Tail(path)
    assert tail.new() == [{"a": 1}]
    with open(path, "ab") as f:
        f.write(b": 2}\n" + b"[" * 100 + b"\n" + b"x" * (MAX_LINE + 1))
    assert tail.new() == [{"b": 2}] and tail.skipped == 2  # too deep; a line that never ends
    with open(path, "ab") as f:
        f.write(b'\n{"c": 3}\n')
    assert tail.new() == [{"c": 3}]


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (FORGED, "'n1\\n[2026-01-01 00:00:00] slurmclock: forged'"),
        ("\x1b[31mred\x1b[0m", "'\\x1b[31mred\\x1b[0m'"),
        ("a'b\\c", "'a\\'b\\\\c'"),
        (12, "12"),
        ("x" * 500, "'" + "x" * 200 + "...'"),
    ],
)
def test_quote_keeps_a_value_on_one_plain_line(value: object, shown: str) -> None:
    assert quote(value) == shown


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_quoted_text_has_no_control_character(value: str) -> None:
    for text in (quote(value), safe_text(value)):
        assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in text)
        assert "\u2028" not in text and "\u2029" not in text


# -- the timeline ----------------------------------------------------------------------------


@pytest.mark.parametrize("line", HOSTILE, ids=range(len(HOSTILE)))
def test_the_timeline_skips_and_counts_a_hostile_line(tmp_path: Path, line: bytes) -> None:
    timeline = timeline_at(tmp_path)
    assert timeline.path is not None
    good = b'{"event": "start", "time": 5.0, "restart": 0, "host": "n1", "pid": 1}'
    timeline.path.write_bytes(good + b"\n" + line + b"\n" + good + b"\n")
    events = finishes(timeline.events)
    assert [e.name for e in events] == ["start", "start"] and timeline.unreadable == [2]


@FILES
@given(st.binary(max_size=3000))
def test_the_timeline_survives_any_bytes(tmp_path: Path, data: bytes) -> None:
    timeline = timeline_at(tmp_path)
    assert timeline.path is not None
    timeline.path.write_bytes(data)
    finishes(timeline.events)
    finishes(timeline.exit_samples)
    finishes(lambda: TimeBudget(timeline=timeline))


@pytest.mark.parametrize("kind", KINDS)
def test_a_timeline_that_is_no_file_is_said_once(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    timeline = timeline_at(tmp_path)
    assert timeline.path is not None
    nonregular(tmp_path, kind).rename(timeline.path) if kind != "loop" else None
    if kind == "loop":
        timeline.path.symlink_to(timeline.path)
    with caplog.at_level(logging.WARNING, "slurmclock"):
        assert finishes(timeline.events) == [] and finishes(timeline.events) == []
        budget = finishes(lambda: TimeBudget(timeline=timeline))
    assert budget.exit_estimate is None and timeline.read_error
    said = [r.getMessage() for r in caplog.records if "job timeline" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0]


def test_a_timeline_marked_after_garbage_still_reads(tmp_path: Path) -> None:
    timeline = timeline_at(tmp_path)
    assert timeline.path is not None
    timeline.path.write_bytes(b'{"event": "start", "time": 1' + b"0" * 400)  # no newline
    assert timeline.mark("start")
    assert [e.name for e in timeline.events()] == ["start"]


# -- the fault record ------------------------------------------------------------------------


def fault_line(host: str = "n1", at: float = 100.0, rank: int = 1) -> bytes:
    record = {"time": at, "rank": rank, "host": host, "what": "dead", "reporter": 0}
    return json.dumps(record).encode() + b"\n"


@pytest.mark.parametrize("line", HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_fault_line_is_skipped(tmp_path: Path, line: bytes) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(line + b"\n" + fault_line())
    assert [f.host for f in read_faults(path, 0.0)] == ["n1"]
    assert parse_fault(line) is None
    path.write_bytes(b"")
    watch = FaultWatch(path, 0.0)
    with open(path, "ab") as f:
        f.write(line + b"\n" + fault_line())
    assert [f.host for f in finishes(watch.new)] == ["n1"]
    assert watch.skipped == 1 and len(watch.said) == 1 and "\n" not in watch.said[0]


@FILES
@given(st.lists(st.binary(max_size=400), max_size=6))
def test_the_fault_watch_survives_any_bytes(tmp_path: Path, chunks: list[bytes]) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"")
    watch = FaultWatch(path, 0.0, nodes=lambda: ["n1"])
    for chunk in chunks:
        with open(path, "ab") as f:
            f.write(chunk)
        for fault in finishes(watch.new):
            assert isinstance(fault, Fault) and fault.host == "n1"
    assert all("\n" not in line and "\x1b" not in line for line in watch.said)
    finishes(lambda: read_faults(path, 0.0))


@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_file_that_is_no_file_is_not_read(tmp_path: Path, kind: str) -> None:
    path = nonregular(tmp_path, kind)
    assert finishes(lambda: read_faults(path, 0.0)) == []
    assert finishes(FaultWatch(path, 0.0).new) == []


def test_a_fault_naming_another_node_is_ignored_and_said_quoted(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(b"")
    watch = FaultWatch(path, 0.0, nodes=lambda: ["n1", "n2"])
    with open(path, "ab") as f:
        f.write(fault_line("evil\n[2026] slurmclock: forged\x1b[2J") + fault_line("n2.cluster"))
        f.write(fault_line("evil\n[2026] slurmclock: forged\x1b[2J"))
    assert [f.host for f in watch.new()] == ["n2.cluster"]  # a fully qualified name is its node
    assert watch.ignored == 2
    (said,) = watch.said  # said once per host
    assert "'evil\\n[2026] slurmclock: forged\\x1b[2J'" in said and "does not end the step" in said


def test_a_fault_describes_itself_on_one_line() -> None:
    fault = Fault(1.0, 1, "n1\nforged", "dead\x1b[0m", 0)
    text = fault.describe()
    assert "\n" not in text and "\x1b" not in text and "n1\\nforged" in text


# -- the budget state ------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=20,
    )
)
def test_any_budget_state_loads_or_is_one_value_error(state: Any) -> None:
    budget = TimeBudget()
    for given_state in (state, {"version": 1, "saves": state}, {"version": 1, "exits": state}):
        load_or_say(budget, given_state)
    budget.should_stop()


def load_or_say(budget: TimeBudget, state: Any) -> None:
    try:
        budget.load_state_dict(state)
    except ValueError as e:
        assert "\n" not in str(e)


def test_a_huge_budget_state_is_bounded() -> None:
    budget = TimeBudget()
    budget.load_state_dict({"version": 1, "saves": [1.0] * 100_000, "steps": [0.1] * 100_000})
    assert len(budget.state_dict()["saves"]) <= 20 and len(budget.state_dict()["steps"]) <= 50


def test_the_budget_reads_through_the_timeline_reader(tmp_path: Path) -> None:
    """The timeline a budget reads at start: hostile lines cost nothing."""
    timeline = timeline_at(tmp_path)
    assert timeline.path is not None
    buf = io.BytesIO()
    for line in HOSTILE:
        buf.write(line + b"\n")
    timeline.path.write_bytes(buf.getvalue())
    start = time.monotonic()
    TimeBudget(timeline=timeline).should_stop()
    assert time.monotonic() - start < 10


@FILES
@given(st.binary(max_size=3000))
def test_any_budget_state_file_loads_or_is_one_line(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "time_budget.json"
    path.write_bytes(data)
    budget = TimeBudget()
    problem = finishes(lambda: budget.load_state_file(path))
    assert problem is None or "\n" not in problem
    budget.should_stop()


@pytest.mark.parametrize("kind", KINDS)
def test_a_budget_state_file_that_is_no_file_is_one_line(tmp_path: Path, kind: str) -> None:
    budget = TimeBudget()
    problem = finishes(lambda: budget.load_state_file(nonregular(tmp_path, kind)))
    assert problem is not None and "\n" not in problem and budget.save_estimate is None


def test_a_budget_state_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "time_budget.json"
    first = TimeBudget()
    first.record_save(3.0)
    first.record_step(0.5)
    assert first.save_state_file(path) is None
    second = TimeBudget()
    assert second.load_state_file(path) is None and second.state_dict() == first.state_dict()
    assert TimeBudget().load_state_file(tmp_path / "missing.json") is None
    assert first.save_state_file(tmp_path / "no" / "such" / "folder.json") is not None


# -- the supervisor: a fault record must name a node of the job -------------------------------

LIMIT_VIEW = (
    "JobId=2 JobState=COMPLETING Reason=TimeLimit Dependency=(null) Requeue=1 Restarts=0 "
    "BatchFlag=1 EndTime=2026-11-25T18:24:58 Partition=debug NodeList=n1,n2 NumNodes=2"
)


class FakeSlurm:
    """scontrol answers the job and its hostnames, sinfo the partition, srun probes time out."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, argv: Any, timeout: float) -> str:
        argv = tuple(argv)
        if argv[:3] == ("scontrol", "show", "job"):
            return LIMIT_VIEW
        if argv[:3] == ("scontrol", "show", "hostnames"):
            return "\n".join(argv[3].split(","))
        if argv[0] == "sinfo":
            return "n1 idle\nn2 idle\nn3 mix\n"
        if argv[0] == "squeue":
            raise CommandError(argv, "missing", "squeue not found")
        self.calls.append(" ".join(argv))
        if argv[0] == "srun":
            raise CommandError(argv, "timeout", "`srun ...` timed out after 10 s")
        return ""


@pytest.mark.parametrize(
    ("host", "counts"),
    [("n2", True), ("n9", False), ("n2\n[2026-01-01 00:00:00] slurmclock: forged", False)],
)
def test_only_a_fault_of_a_node_of_the_job_ends_the_step_and_excludes_it(
    tmp_path: Path, host: str, counts: bool
) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK"))},
        "SLURM_JOB_ID": "42",
        "SLURM_RESTART_COUNT": "0",
        "SLURMCLOCK_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": "n1,n2",
    }
    env.pop("PYRECOVER_SIGNAL_LEAD", None)
    slurm, out = FakeSlurm(), io.StringIO()
    config = SuperviseConfig(restart_here=False)
    sup = Supervisor(config, env=env, runner=slurm, out=out, here="n1")
    report = {"time": 4e9, "rank": 1, "host": host, "what": "dead", "reporter": 0}
    code = (
        "import json, os; f = open(os.environ['DDPKIT_FAULT_FILE'], 'a'); "
        f"f.write(json.dumps({report!r}) + '\\n'); f.close(); raise SystemExit(3)"
    )
    assert sup.run([sys.executable, "-c", code]) == 0  # requeued: exit 3 is a crash
    said = out.getvalue()
    assert "training step exited with status 3" in said
    assert not any(line.startswith("[2026-01-01 00:00:00]") for line in said.splitlines())
    if counts:
        assert "rank 1 on node n2 was dead (reported by rank 0)" in said
        assert "scontrol update JobId=42 ExcNodeList=n2" in slurm.calls
    else:
        assert f"ignored a fault record naming {quote(host)}, not a node of this job" in said
        assert not any("ExcNodeList" in c or c.startswith("srun") for c in slurm.calls)
