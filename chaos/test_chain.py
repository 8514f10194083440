"""Chaos rows for the run's chain of jobs (issue 35, item 3): every fault of
files_faults.FAULTS at the two files ``slurmclock.chain`` keeps beside the timelines -- the
chain's list of jobs and the run's newest link -- at the moment a job joins the chain
(``supervise --continue-run``) and when ``slurmclock status``/``timeline`` walk it.

Each row asserts: no crash, no block (a bound from this machine's measured read speed), the good
line still read (the resubmit goes on as link 2; the walk from any job finds the job asked
about), what is said said once on one line, and the job goes on (join never fails a job)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from files_faults import FAULTS, Fault, finishes
from test_files import ALLOW, IDS, one_line_each

from slurmclock import CommandError
from slurmclock.chain import follow, join
from slurmclock.job import JobFacts
from slurmclock.timeline import JobTimeline

T = 1.9e9
GOOD_LIST = b'{"job": "41", "link": 0}\n{"job": "52", "link": 1}\n'
GOOD_RUN = b'{"chain": "41", "link": 1, "job": "52"}\n'


class Forgotten:
    """A scheduler that no longer lists the chain's jobs (they ended long ago)."""

    def show_job(self, job: str, *, timeout: float = 10.0) -> Any:
        raise CommandError(["scontrol"], "failed", f"show_job {job}: Invalid job id specified")


def timeline(folder: Path, job: str) -> JobTimeline:
    return JobTimeline(JobFacts(job_id=job, restart=None, source="none"), directory=folder)


def two_jobs(folder: Path) -> None:
    for job, link in (("41", 0), ("52", 1)):
        line = {"event": "start", "time": T + link, "restart": 0, "chain": "41", "link": link}
        (folder / f"job-{job}.jsonl").write_text(json.dumps(line) + "\n")


def _join(folder: Path) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        env: dict[str, str] = {}
        tl = timeline(folder, "70")
        return join(env, "70", tl, run="r", resume=True, scheduler=Forgotten())  # type: ignore[arg-type]

    return run


@pytest.mark.parametrize("fault", FAULTS, ids=IDS)
@pytest.mark.parametrize("where", ["job-41.chain.jsonl", "job.run-r.json"])
def test_the_chain_files(
    tmp_path: Path, fault: Fault, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    two_jobs(tmp_path)
    (tmp_path / "job-41.chain.jsonl").write_bytes(GOOD_LIST)
    (tmp_path / "job.run-r.json").write_bytes(GOOD_RUN)
    fault.apply(tmp_path / where, GOOD_LIST if where.endswith("chain.jsonl") else GOOD_RUN)
    with caplog.at_level(logging.WARNING, "slurmclock"):
        joined = finishes(_join(tmp_path), ALLOW)
        walked = finishes(lambda: follow(timeline(tmp_path, "52")), ALLOW)
    said = [r.getMessage() for r in caplog.records]
    one_line_each(said)
    assert len(said) <= 2, said
    if fault.writes or where.endswith("chain.jsonl"):  # the run's record read: link 2
        assert joined == {"chain": "41", "link": 2, "previous": "52"}
    else:  # the run's record is not one (2 GB of holes: its tail, no line): a chain of its own
        assert joined == {"chain": "70", "link": 0}
    assert "52" in walked.jobs  # the job asked about, always
    if fault.writes or where.endswith("run-r.json"):  # the chain's list read: the whole chain
        assert walked.jobs == ["41", "52"]
        assert walked.pending == ("70" if joined["link"] == 2 else None)
