"""slurmclock.supervisor.verdict: what a SIGTERM meant (from ``scontrol show job -o`` text as
SLURM 22.05 printed it in each case, captured on the local cluster), how a step's exit is sorted,
and the verdict with its one line -- pure functions, no process."""

from __future__ import annotations

from typing import Any

import pytest

from slurmclock.job import JobState
from slurmclock.slurm import parse_job_record
from slurmclock.supervisor.config import SuperviseConfig
from slurmclock.supervisor.history import Streak
from slurmclock.supervisor.verdict import classify_term, decide, describe_status, end_kind
from slurmclock.timeline import Event

# What `scontrol show job -o` said in the batch script's SIGTERM trap (SLURM 22.05.8).
SHOW = {
    "limit": "JobId=2 JobState=COMPLETING Reason=TimeLimit Dependency=(null) Requeue=1 "
    "Restarts=0 BatchFlag=1 EndTime=2026-11-25T18:24:58 Partition=debug NodeList=n1 NumNodes=1",
    "scancel": "JobId=3 JobState=COMPLETING Reason=None Dependency=(null) Requeue=1 Restarts=0 "
    "PreemptEligibleTime=2026-11-25T18:28:38 PreemptTime=None Partition=debug NumNodes=1",
    "stop": "JobId=4 JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0",
    "requeue": "JobId=5 JobState=COMPLETING Reason=None Dependency=(null) Requeue=1 Restarts=1",
    "preempt-cancel": "JobId=3 JobState=COMPLETING Reason=None Requeue=1 Restarts=0 "
    "EndTime=2026-11-25T18:29:12 PreemptTime=2026-11-25T18:29:12",
    "preempt-requeue": "JobId=1 JobState=COMPLETING Reason=None Requeue=1 Restarts=1",
}


@pytest.mark.parametrize(
    ("case", "kind"),
    [
        ("limit", "limit"),
        ("scancel", "cancelled"),
        ("stop", "stop"),
        ("requeue", "requeued"),
        ("preempt-cancel", "preempted"),
        ("preempt-requeue", "requeued"),
    ],
)
def test_what_a_sigterm_meant(case: str, kind: str) -> None:
    assert classify_term(parse_job_record(SHOW[case]), 0, None) == kind


def test_without_scontrol_only_a_passed_deadline_reads_as_the_limit() -> None:
    assert classify_term(None, 0, -3.0) == "limit"
    assert classify_term(None, 0, 120.0) == "stop"
    assert classify_term(None, 0, None) == "stop"


def test_job_view_fields() -> None:
    view = parse_job_record(SHOW["limit"] + " ExcNodeList=n[2-3] NumNodes=4-4")
    assert (
        view.native_state == "COMPLETING"
        and view.state == JobState.TIMED_OUT
        and view.restarts == 0
    )
    assert view.partition == "debug" and view.nodes == "n1" and view.exc_nodes == "n[2-3]"
    assert view.num_nodes == 1  # the first NumNodes= wins
    assert parse_job_record(SHOW["scancel"]).preempt_time is None
    assert parse_job_record("JobState=RUNNING NumNodes=2-4").num_nodes == 2
    assert parse_job_record("garbage").restarts is None


def ev(event: str, restart: int = 0, **info: Any) -> Event:
    return Event(event, 1.0, restart, info)


def test_describe_status() -> None:
    assert describe_status(1) == "exit 1"
    assert describe_status(137) == "exit 137 (killed by SIGKILL)"
    assert describe_status(None) == "no exit status"


CONFIG = SuperviseConfig(resume_hint="resume with --continue")


@pytest.mark.parametrize(
    ("rc", "term", "kind"),
    [
        (0, None, "finished"),
        (75, None, "stopped"),
        (2, None, "usage"),
        (1, None, "failed"),
        (139, None, "failed"),
        (75, "stop", "requested"),
        (137, "limit", "slurm"),
        (0, "cancelled", "slurm"),
    ],
)
def test_end_kind(rc: int, term: str | None, kind: str) -> None:
    assert end_kind(rc, term, CONFIG.no_retry) == kind


def verdict(kind: str, rc: int, **kw: Any) -> tuple[str, int, str]:
    kw.setdefault("term", None)
    kw.setdefault("streak", Streak())
    kw.setdefault("restarts", 0)
    kw.setdefault("config", CONFIG)
    v = decide(kind, rc, **kw)
    return v.action, v.code, v.message


def test_verdicts() -> None:
    assert verdict("finished", 0) == ("end", 0, "training finished")
    action, code, said = verdict("stopped", 75)
    assert (action, code) == ("requeue", 75) and said.startswith("stopped early with steps left")
    action, code, said = verdict("failed", 139, streak=Streak(2, 40, ev("failed")))
    assert (action, code) == ("requeue", 139)
    assert "failure 2 of 3 in a row at checkpoint step 40" in said
    assert verdict("usage", 2)[:2] == ("end", 2)
    assert verdict("requested", 75, term="stop")[:2] == ("end", 0)
    assert verdict("requested", 143, term="stop")[:2] == ("end", 143)
    assert verdict("slurm", 0, term="cancelled")[:2] == ("end", 0)
    assert verdict("slurm", 137, term="limit", requeued=True)[:2] == ("end", 0)
    assert verdict("slurm", 137, term="limit")[:2] == ("end", 75)  # the requeue was refused


def test_the_budget_gives_up_with_one_line() -> None:
    last = ev("failed", 2, rc=139, step=40, nodes="n3", why="exit 139 (killed by SIGSEGV)")
    action, code, said = verdict("failed", 139, streak=Streak(3, 40, last))
    assert (action, code) == ("give_up", 139)
    assert said == (
        "gave up: the training step failed 3 times in a row at checkpoint step 40 (last: exit "
        "139 (killed by SIGSEGV) on n3); not requeueing. Fix the cause, then resume: resume "
        "with --continue"
    )
    assert "\n" not in said


def test_no_requeue_and_the_restart_limit() -> None:
    chained = SuperviseConfig(requeue=False, next_job_resumes=True)
    action, code, said = verdict("stopped", 75, config=chained)
    assert (action, code) == ("end", 0) and "next array task / chained job resumes" in said
    assert verdict("failed", 1, config=chained, streak=Streak(1, None, None))[:2] == ("end", 1)
    # A plain job with requeue off (issue 30): no successor to speak of, and an unfinished run
    # ends with its status (the job is not COMPLETED), saying how to go on.
    plain = SuperviseConfig(requeue=False, resume_hint="submit again with --continue")
    action, code, said = verdict("stopped", 75, config=plain)
    assert (action, code) == ("end", 75) and "next array task" not in said
    assert said == (
        "stopped early with steps left; not requeueing (requeue is off); to go on: submit "
        "again with --continue"
    )
    action, code, said = verdict("stopped", 75, restarts=50)
    assert (action, code) == ("end", 75) and "already restarted 50 times" in said
