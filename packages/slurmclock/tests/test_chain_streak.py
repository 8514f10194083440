"""The crash-loop guard over a chain of successor jobs (issue 35, item 3): each link is a new job
id with a new timeline, and the failures in a row at one checkpoint step are counted over the
chain's links (:func:`slurmclock.chain.earlier`), not restarted in each -- a trainer that crashes
once per allocation at the same step gives up at the ``--max-failures``-th, it is not resubmitted
up to ``--max-restarts`` times. A damaged or missing predecessor timeline is skipped (one line);
a requeued job (one job id) counts as before. A fake SLURM (its sbatch hands out the next job id
and the exports the successor gets) and real steps (child processes that mark the timeline)."""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from slurmclock.chain import CHAIN_ID, CHAIN_INDEX, EARLIER_EVENTS, chain_path, earlier
from slurmclock.job import JobFacts
from slurmclock.supervisor import SuperviseConfig, Supervisor
from slurmclock.supervisor.history import settled
from slurmclock.timeline import JobTimeline

GAVE_UP = "gave up: the training step failed 3 times in a row at checkpoint step"

# The step: marks a durable checkpoint at STEP ("-": none in this allocation), then crashes
# with RC -- a trainer that dies late in every allocation, after its resume.
STEP = """
import sys
from slurmclock import JobTimeline
at, rc = sys.argv[1], int(sys.argv[2])
if at != "-":
    JobTimeline().mark("checkpoint", step=int(at))
sys.exit(rc)
"""


class Slurm:
    """A fake SLURM for the supervisor: ``sbatch`` answers the next of ``ids`` and records
    what it was asked; the job is RUNNING on node n1."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.ids, self.calls = list(ids), []  # type: list[str], list[list[str]]

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        argv = list(argv)
        self.calls.append(argv)
        if argv[0] == "sbatch":
            return self.ids.pop(0) + "\n"
        if argv[:3] == ["scontrol", "show", "hostnames"]:
            return "n1\n"
        if argv[:3] == ["scontrol", "show", "job"]:
            return f"JobId={argv[3]} JobState=RUNNING Reason=None Restarts=0 NodeList=n1"
        return ""

    def said(self, word: str) -> list[list[str]]:
        return [c for c in self.calls if c[0] == word]


def exports(sbatch: list[str]) -> dict[str, str]:
    """What the successor's sbatch exports (``--export=ALL,K=V,...``)."""
    spec = next(a for a in sbatch if a.startswith("--export="))
    return dict(item.split("=", 1) for item in spec.removeprefix("--export=").split(",")[1:])


def link(
    tmp_path: Path,
    job: str,
    exported: dict[str, str],
    *,
    at: str,
    rc: int = 134,
    left: float = 45.0,
    restart: int = 0,
    **config: Any,
) -> tuple[int, str, Slurm]:
    """One allocation of the chain: job ``job`` (with what its predecessor ``exported``) runs
    the step once (``left`` seconds: too few for a restart in it); its exit status, log, SLURM."""
    env = {
        "PATH": str(Path(sys.executable).parent),
        "SLURM_JOB_ID": job,
        "SLURM_RESTART_COUNT": str(restart),
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURMCLOCK_DIR": str(tmp_path / "timelines"),
        "PYRECOVER_END_TIME": str(time.time() + left),
        **exported,
    }
    slurm = Slurm([str(int(job) + 11)])
    config.setdefault("successor", ("-t", "60", "job.sh"))
    sup = Supervisor(SuperviseConfig(**config), env=env, runner=slurm, out=io.StringIO())
    script = tmp_path / "step.py"
    script.write_text(STEP)
    code = sup.run([sys.executable, str(script), at, str(rc)])
    assert isinstance(sup.out, io.StringIO)
    return code, sup.out.getvalue(), slurm


def chain(tmp_path: Path, *plan: str) -> list[tuple[int, str, Slurm]]:
    """Links 41, 52, 63, ... each running the step with the checkpoint step of ``plan``; each
    next link gets what its predecessor's sbatch exported (none submitted: the chain ends)."""
    done, exported, job = [], {}, "41"  # type: list[tuple[int, str, Slurm]], dict[str, str], str
    for at in plan:
        done.append(link(tmp_path, job, exported, at=at))
        submitted = done[-1][2].said("sbatch")
        if not submitted:
            break
        exported, job = exports(submitted[0]), str(int(job) + 11)
    return done


def timelines(tmp_path: Path) -> Path:
    return tmp_path / "timelines"


def test_a_crash_at_the_same_step_in_each_link_gives_up_in_the_third(tmp_path: Path) -> None:
    links = chain(tmp_path, "100", "-", "-", "-")
    assert len(links) == 3, [out for _, out, _ in links]  # no fourth allocation
    for n, (code, out, slurm) in enumerate(links[:2], start=1):
        assert code == 0, out  # handed over: the successor resumes
        assert f"failure {n} of 3 in a row at checkpoint step 100" in out, out
        assert len(slurm.said("sbatch")) == 1 and not slurm.said("scontrol requeue")
    code, out, slurm = links[2]
    assert code == 134, out  # give_up exits with the failed step's status
    assert out.count(GAVE_UP) == 1, out
    assert f"{GAVE_UP} 100 (last: exit 134 (killed by SIGABRT) on n1)" in out
    assert not slurm.said("sbatch"), slurm.calls  # no successor after giving up
    last = JobTimeline(JobFacts(job_id="63", restart=None, source="none"),
                       directory=timelines(tmp_path))  # fmt: skip
    names = [e.name for e in last.events()]
    assert names[-1] == "gave_up" and names.count("failed") == 1


def test_a_crash_at_another_step_starts_the_count_again(tmp_path: Path) -> None:
    links = chain(tmp_path, "100", "200", "-", "-")
    outs = [out for _, out, _ in links]
    assert len(links) == 4, outs
    assert "failure 1 of 3 in a row at checkpoint step 100" in outs[0]
    assert "failure 1 of 3 in a row at checkpoint step 200" in outs[1]
    assert "failure 2 of 3 in a row at checkpoint step 200" in outs[2]
    assert GAVE_UP in outs[3] and "gave up" not in "".join(outs[:3])


@pytest.mark.parametrize("damage", ["missing", "garbage", "directory"])
def test_an_unreadable_predecessor_is_skipped_and_said_once(tmp_path: Path, damage: str) -> None:
    first = chain(tmp_path, "100", "-")  # 41 and 52 failed at step 100; 63 is submitted
    assert len(first) == 2 and "failure 2 of 3" in first[1][1]
    path = timelines(tmp_path) / "job-52.jsonl"
    path.unlink()
    if damage == "garbage":
        path.write_bytes(b'\x00\xff not json\n{"event": 5}\n' + b"x" * 70_000 + b"\n")
    elif damage == "directory":
        path.mkdir()
    exported = exports(first[1][2].said("sbatch")[0])
    code, out, slurm = link(tmp_path, "63", exported, at="-")
    # 52's failure is not seen: 41's and this one's are two in a row at step 100, not three.
    assert code == 0 and "failure 2 of 3 in a row at checkpoint step 100" in out, out
    said = [ln for ln in out.splitlines() if "no readable timeline" in ln]
    assert len(said) == 1 and "job 52" in said[0], out  # once, though read several times
    assert len(slurm.said("sbatch")) == 1


def test_the_chain_list_lost_the_walk_follows_the_successor_pointers(tmp_path: Path) -> None:
    first = chain(tmp_path, "100", "-")
    listed = chain_path(JobTimeline("41", directory=timelines(tmp_path), env={}), "41")
    listed.write_text("not a list\n")
    code, out, _ = link(tmp_path, "63", exports(first[1][2].said("sbatch")[0]), at="-")
    assert code == 134 and out.count(GAVE_UP) == 1, out


def test_a_requeued_job_counts_its_own_runs_as_before(tmp_path: Path) -> None:
    """One job id, requeued: its own timeline holds every run; no other file is read."""
    folder = timelines(tmp_path)
    stray = JobTimeline("30", directory=folder, env={})  # another job's failures: not counted
    stray.mark("failed", step=100, why="exit 1")
    stray.mark("failed", step=100, why="exit 1")
    own = JobTimeline("7", directory=folder, env={})
    own.mark("start", chain="7", link=0)
    own.mark("checkpoint", step=100)
    own.mark("exited", rc=134)
    own.mark("failed", step=100, why="exit 134", rc=134, nodes="n1")
    own.mark("requeued", confirmed=True)
    code, out, slurm = link(tmp_path, "7", {}, at="-", restart=1, successor=())
    assert code == 0 and "failure 2 of 3 in a row at checkpoint step 100" in out, out
    assert "requeueing to resume from the newest checkpoint" in out
    assert slurm.said("scontrol") and not slurm.said("sbatch") and "no readable" not in out
    code, out, _ = link(tmp_path, "7", {}, at="-", restart=2, successor=())
    assert code == 134 and out.count(GAVE_UP) == 1, out


# -- the walk back, bounded ------------------------------------------------------------------


def write(folder: Path, job: str, lines: list[dict[str, Any]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"job-{job}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def ev(name: str, **info: Any) -> dict[str, Any]:
    return {"event": name, "time": 1.9e9, "restart": 0, **info}


def test_the_walk_back_stops_where_nothing_older_can_count(tmp_path: Path) -> None:
    """Links 100..109; 105 ended cleanly (exit 75) after a checkpoint and a measured start-up:
    links before it are not read."""
    jobs = [str(100 + n) for n in range(10)]
    for n, job in enumerate(jobs):
        clean = [ev("first_step", seconds=1.0), ev("checkpoint", step=n), ev("exited", rc=75)]
        failed = [ev("exited", rc=1), ev("failed", step=n - 1)]
        write(tmp_path, job, [ev("start", chain="100", link=n), *(clean if n == 5 else failed)])
        listed = chain_path(JobTimeline(job, directory=tmp_path, env={}), "100")
        with listed.open("a") as f:
            f.write(json.dumps({"job": job, "link": n}) + "\n")
    here = JobTimeline("109", directory=tmp_path, env={})
    found = earlier(here, env={CHAIN_ID: "100", CHAIN_INDEX: "9"}, enough=settled)
    assert found.jobs == ["105", "106", "107", "108"] and not found.unread
    assert [e.info.get("link") for e in found.events if e.name == "start"] == [5, 6, 7, 8]
    assert len(earlier(here, env={CHAIN_ID: "100"}).jobs) == 9  # without a stop: all before
    cut = earlier(here, env={CHAIN_ID: "100"}, links=2)  # at most 2 files, whatever they hold
    assert cut.jobs == ["107", "108"]
    assert earlier(JobTimeline("100", directory=tmp_path, env={}), env={CHAIN_ID: "100"}).jobs == []
    assert earlier(here, env={}).jobs == []  # not a chain: only its own timeline counts


def test_the_walk_back_ends_at_a_number_of_events(tmp_path: Path) -> None:
    """Timelines that hold more than an allocation writes cost at most EARLIER_EVENTS: the walk
    ends at the file that reaches it."""
    filler = [ev("signal", kind="limit")] * (EARLIER_EVENTS // 2 + 1)
    listed = chain_path(JobTimeline("41", directory=tmp_path, env={}), "41")
    for n, job in enumerate(["41", "52", "63", "74"]):
        write(tmp_path, job, [ev("start", chain="41", link=n), *filler, ev("failed", step=7)])
        with listed.open("a") as f:
            f.write(json.dumps({"job": job, "link": n}) + "\n")
    found = earlier(JobTimeline("74", directory=tmp_path, env={}), env={CHAIN_ID: "41"})
    assert found.jobs == ["52", "63"] and found.events[-1].name == "failed"
