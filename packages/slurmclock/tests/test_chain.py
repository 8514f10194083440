"""One run over many allocations (:mod:`slurmclock.chain`): the links read from the job
timelines of a requeued job and of a chain of successor jobs, what ``slurmclock timeline`` and
``slurmclock status`` show of them, and the chain's identity exported to the step."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from slurmclock.chain import (
    CHAIN_ID,
    CHAIN_INDEX,
    RunRecord,
    chain_id,
    chain_index,
    follow,
    join,
    read_run,
)
from slurmclock.cli import main
from slurmclock.job import JobFacts, JobState, JobView
from slurmclock.supervisor import SuperviseConfig
from slurmclock.supervisor.successor import successor_argv
from slurmclock.timeline import JobTimeline

T = 1.9e9


def write(folder: Path, job: str, lines: list[dict[str, Any]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(x) + "\n" for x in lines)
    (folder / f"job-{job}.jsonl").write_text(text)


def ev(name: str, at: float, restart: int = 0, **info: Any) -> dict[str, Any]:
    return {"event": name, "time": T + at, "restart": restart, **info}


def successor_chain(folder: Path) -> None:
    """Three jobs: 41 (steps 1-100, hands over to 52), 52 (to 200, hands over to 63), 63 runs."""
    write(folder, "41", [
        ev("start", 0, chain="41", link=0), ev("first_step", 20, step=1, seconds=1.0),
        ev("checkpoint", 50, step=50), ev("checkpoint", 100, step=100),
        ev("exited", 101, rc=75), ev("requeued", 102, successor="52"),
    ])  # fmt: skip
    write(folder, "52", [
        ev("start", 105, chain="41", link=1), ev("checkpoint", 200, step=200),
        ev("exited", 201, rc=75), ev("requeued", 202, successor="63"),
    ])  # fmt: skip
    write(folder, "63", [ev("start", 230, chain="41", link=2), ev("checkpoint", 260, step=250)])


def timeline(folder: Path, job: str) -> JobTimeline:
    return JobTimeline(JobFacts(job_id=job, restart=None, source="none"), directory=folder)


@pytest.mark.parametrize("asked", ["41", "52", "63"])
def test_any_job_of_a_successor_chain_shows_the_whole_chain(tmp_path: Path, asked: str) -> None:
    successor_chain(tmp_path)
    chain = follow(timeline(tmp_path, asked))
    assert chain.id == "41" and [k.job for k in chain.links] == ["41", "52", "63"]
    assert [k.verdict for k in chain.links] == ["successor 52", "successor 63", "running"]
    assert [k.steps for k in chain.links] == [100, 100, 50]
    assert chain.waits() == [pytest.approx(3.0), pytest.approx(28.0)]
    t = chain.totals()
    assert (t["allocations"], t["jobs"], t["steps"], t["wait_s"]) == (3, 3, 250, 31.0)
    assert t["last_checkpoint"] == 250 and not chain.cut


def test_a_requeued_job_is_a_chain_of_its_runs(tmp_path: Path) -> None:
    write(tmp_path, "7", [
        ev("start", 0), ev("checkpoint", 10, step=10), ev("exited", 11, rc=75),
        ev("requeued", 12), ev("start", 140, 1), ev("checkpoint", 150, 1, step=30),
        ev("exited", 151, 1, rc=0),
    ])  # fmt: skip
    chain = follow(timeline(tmp_path, "7"))
    assert [(k.job, k.restart, k.verdict) for k in chain.links] == [
        ("7", 0, "requeued"),
        ("7", 1, "done"),
    ]
    assert chain.waits() == [pytest.approx(128.0)] and chain.totals()["steps"] == 30


@pytest.mark.parametrize(
    "pointer",
    ["41", "../../etc/passwd", 52, "", None],  # a loop, a path, not text, empty, none
)
def test_a_bad_successor_pointer_ends_the_walk(tmp_path: Path, pointer: object) -> None:
    write(
        tmp_path, "41", [ev("start", 0, chain="41", link=0), ev("requeued", 1, successor=pointer)]
    )
    chain = follow(timeline(tmp_path, "41"))
    assert [k.job for k in chain.links] == ["41"]


def test_a_missing_link_is_said_and_the_walk_is_bounded(tmp_path: Path) -> None:
    write(tmp_path, "41", [ev("start", 0, chain="41", link=0), ev("requeued", 1, successor="52")])
    waiting = follow(timeline(tmp_path, "41"))  # 52 has no timeline: queued (or it is gone)
    assert waiting.pending == "52" and not waiting.cut and len(waiting.links) == 1
    for n in range(10):
        write(
            tmp_path,
            str(100 + n),
            [ev("start", n, chain="100"), ev("requeued", n, successor=str(101 + n))],
        )
    chain = follow(timeline(tmp_path, "100"), max_jobs=4)
    assert len(chain.links) == 4 and chain.cut


def test_join_exports_the_chain_to_the_step_and_the_successor() -> None:
    env: dict[str, str] = {}
    assert join(env, "41") == {"chain": "41", "link": 0}
    assert env == {CHAIN_ID: "41", CHAIN_INDEX: "0"}
    later = {CHAIN_ID: "41", CHAIN_INDEX: "2"}
    assert join(later, "63") == {"chain": "41", "link": 2}
    assert join({CHAIN_ID: "not a job"}, "5") == {"chain": "5", "link": 0}  # untrusted
    assert join({}, None) == {} and chain_id({}) is None and chain_index({CHAIN_INDEX: "-1"}) == 0
    argv = successor_argv("52", ["j.sh"], index=1, time_min=None, chain="41")
    assert f"--export=ALL,{CHAIN_INDEX}=2,{CHAIN_ID}=41" in argv
    first = successor_argv("41", ["j.sh"], index=0, time_min=None)
    assert f"--export=ALL,{CHAIN_INDEX}=1,{CHAIN_ID}=41" in first


def test_timeline_command_shows_the_links_and_totals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    successor_chain(tmp_path)
    assert main(["timeline", "52"], env={"SLURMCLOCK_DIR": str(tmp_path)}) == 0
    out = capsys.readouterr().out
    assert "chain 41: the run's allocations, oldest first" in out
    assert "link 1: job 52 run 0" in out and "3 s after the one before, 100 steps to 200" in out
    assert "total: 3 allocations in 3 jobs, 250 steps, 31 s between allocations" in out
    assert main(["timeline", "63", "--json"], env={"SLURMCLOCK_DIR": str(tmp_path)}) == 0
    got = json.loads(capsys.readouterr().out)["chain"]
    assert [k["job"] for k in got["links"]] == ["41", "52", "63"]
    assert got["totals"]["allocations"] == 3 and got["waits_s"] == [3.0, 28.0]


def test_status_command_shows_the_chain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    successor_chain(tmp_path)
    env = {
        "SLURMCLOCK_DIR": str(tmp_path),
        "SLURM_JOB_ID": "63",
        "PYRECOVER_END_TIME": str(T + 900),
    }
    assert main(["status"], env=env) == 0
    rows = dict(line.split(":", 1) for line in capsys.readouterr().out.splitlines())
    assert rows["chain"].strip() == "41: 3 allocations, 3 jobs"
    assert rows["steps"].strip() == "250" and "31 s between" in rows["waited"]
    assert main(["status", "--json"], env=env) == 0
    assert json.loads(capsys.readouterr().out)["chain"]["totals"]["jobs"] == 3


# -- a stopped run submitted again with --continue (supervise --run NAME --continue-run) ----------


def resubmit(
    folder: Path, fakes: Any, jobs: dict[str, JobView], job: str = "70"
) -> tuple[dict[str, str], dict[str, object], list[str]]:
    said: list[str] = []
    env: dict[str, str] = {}
    details = join(
        env,
        job,
        timeline(folder, job),
        run="exp 1",
        resume=True,
        scheduler=fakes.Scheduler(jobs),
        log=said.append,
    )
    return env, details, said


def first_two(folder: Path) -> None:
    """Jobs 41 and 52 of run "exp 1" (chain 41), recorded as the supervisor records them."""
    for job, index in (("41", 0), ("52", 1)):
        env = {CHAIN_ID: "41", CHAIN_INDEX: str(index)} if index else {}
        assert join(env, job, timeline(folder, job), run="exp 1")["link"] == index


@pytest.mark.parametrize(
    ("jobs", "link", "said"),
    [
        ({}, 2, "run 'exp 1' goes on: link 2 of chain 41"),  # SLURM forgot 52: long ended
        ({"52": JobView(state=JobState.ENDED)}, 2, "goes on"),
        ({"52": JobView(state=JobState.TIMED_OUT)}, 2, "goes on"),
        ({"52": JobView(state=JobState.ACTIVE)}, 0, "its job 52 is still active; a chain of"),
        ({"52": JobView(state=JobState.QUEUED)}, 0, "its job 52 is still queued"),
    ],
)
def test_a_resubmit_goes_on_with_the_runs_chain_once_its_last_job_ended(
    tmp_path: Path, fakes: Any, jobs: dict[str, JobView], link: int, said: str
) -> None:
    first_two(tmp_path)
    env, details, lines = resubmit(tmp_path, fakes, jobs)
    head = "41" if link else "70"
    assert details["link"] == link and env == {CHAIN_ID: head, CHAIN_INDEX: str(link)}
    assert details.get("previous") == ("52" if link else None)
    assert len(lines) == 1 and said in lines[0]
    assert read_run(timeline(tmp_path, "70"), "exp 1") == RunRecord(head, link, "70")


def test_the_pending_successor_is_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, "41", [ev("start", 0, chain="41", link=0), ev("requeued", 1, successor="52")])
    assert main(["timeline", "41"], env={"SLURMCLOCK_DIR": str(tmp_path)}) == 0
    assert "next: job 52 (no timeline yet: it waits in the queue" in capsys.readouterr().out
    env = {"SLURMCLOCK_DIR": str(tmp_path), "SLURM_JOB_ID": "41", "PYRECOVER_END_TIME": str(T)}
    assert main(["status"], env=env) == 0
    assert "next job:     52 (no timeline yet" in capsys.readouterr().out


def test_a_chain_whose_first_timeline_is_gone_starts_at_the_oldest_left(tmp_path: Path) -> None:
    successor_chain(tmp_path)
    (tmp_path / "job-41.jsonl").unlink()
    lines = [{"job": j, "link": n} for n, j in enumerate(["41", "52", "63"])]
    (tmp_path / "job-41.chain.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert [k.job for k in follow(timeline(tmp_path, "63")).links] == ["52", "63"]


def test_a_resubmitted_link_is_found_without_a_successor_pointer(tmp_path: Path) -> None:
    successor_chain(tmp_path)  # 41 -> 52 -> 63, each named by the one before it
    write(tmp_path, "63", [ev("start", 230, chain="41", link=2), ev("exited", 240, rc=75)])
    write(tmp_path, "70", [ev("start", 900, chain="41", link=3, previous="63")])
    (tmp_path / "job-41.chain.jsonl").write_text(
        "".join(json.dumps({"job": j, "link": n}) + "\n" for n, j in enumerate(["41", "52", "63"]))
        + "not json\n"
        + json.dumps({"job": "../x", "link": 3})
        + "\n"
        + json.dumps({"job": "70", "link": 3})
        + "\n"
    )
    chain = follow(timeline(tmp_path, "52"))
    assert [k.job for k in chain.links] == ["41", "52", "63", "70"]
    assert chain.links[2].verdict == "exited 75" and chain.waits()[-1] == pytest.approx(660.0)


def test_a_run_record_that_is_not_one_is_ignored(tmp_path: Path, fakes: Any) -> None:
    first_two(tmp_path)
    path = next(tmp_path.glob("job.run-*.json"))
    for text in ("", "{", '{"chain": "41", "link": -1, "job": "52"}\n', '{"chain": "x"}\n'):
        path.write_text(text)
        env, details, _ = resubmit(tmp_path, fakes, {})
        assert details == {"chain": "70", "link": 0}


def test_continue_run_needs_the_runs_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="give --run NAME"):
        SuperviseConfig(continue_run=True)
    with pytest.raises(ValueError, match="one line"):
        SuperviseConfig(run="a\nb")
    env = {"SLURM_JOB_ID": "5"}
    assert main(["supervise", "--continue-run", "--", "true"], env=env) == 2
    assert "--run NAME" in capsys.readouterr().err


def test_a_requeued_link_stays_the_link_it_was(tmp_path: Path, fakes: Any) -> None:
    """SLURM starts a requeued job with its submission's environment: without the chain a
    resubmit joined at its first run; the job's own timeline says which it is."""
    first_two(tmp_path)
    env, details, _ = resubmit(tmp_path, fakes, {})
    assert details["link"] == 2
    write(tmp_path, "70", [ev("start", 0, chain="41", link=2, previous="52")])
    again: dict[str, str] = {}
    assert join(again, "70", timeline(tmp_path, "70"), run="exp 1") == {"chain": "41", "link": 2}
    assert again == {CHAIN_ID: "41", CHAIN_INDEX: "2"}


@pytest.mark.parametrize("where", ["job-41.chain.jsonl", "job.run-r.json.{pid}.tmp"])
def test_a_fifo_at_a_record_is_not_written_and_nothing_waits(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / where.format(pid=os.getpid())
    os.mkfifo(path)
    env: dict[str, str] = {}
    assert join(env, "41", timeline(tmp_path, "41"), run="r") == {"chain": "41", "link": 0}
    assert "cannot record link 0 of chain 41" in caplog.text and path.is_fifo()
