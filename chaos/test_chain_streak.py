"""Chaos rows for the crash-loop guard over a chain of successor jobs (issue 35, item 3): every
fault of files_faults.FAULTS at an earlier link's timeline, at the two moments a successor's
supervisor reads the links before it (``slurmclock.chain.earlier``) -- a failure (the failures in
a row, the newest checkpoint) and the hand-over at a stop (the measured start-up for the
successor's --time-min floor); and on a real SLURM, a chain whose trainer crashes at the same
checkpoint in every allocation gives up in its third job instead of submitting a fourth.

Each row asserts: no crash, no block (a bound from this machine's measured read speed), the
readable links counted (a link that cannot be read skipped, named once on one line), and the run
goes on or ends as the verdict says (one ``gave up`` line; no successor after it)."""

from __future__ import annotations

import io
import json
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from files_faults import FAULTS, FORGED, Fault, finishes, localslurm
from test_files import ALLOW, IDS, one_line_each

from slurmclock.chain import CHAIN_ID, CHAIN_INDEX, earlier
from slurmclock.supervisor import SuperviseConfig, Supervisor
from slurmclock.supervisor.history import settled
from slurmclock.timeline import JobTimeline

T = 1.9e9
GAVE_UP = "gave up: the training step failed 3 times in a row at checkpoint step 100"


def line(name: str, at: float, **info: Any) -> bytes:
    return json.dumps({"event": name, "time": T + at, "restart": 0, **info}).encode() + b"\n"


# Links 41 and 52 each failed at checkpoint step 100 and handed over: 63 is the third.
GOOD_41 = b"".join([
    line("start", 0, chain="41", link=0), line("first_step", 40, step=1, seconds=1.0),
    line("checkpoint", 50, step=100), line("exited", 60, rc=134),
    line("failed", 60, step=100, why="exit 134", rc=134), line("requeued", 61, successor="52"),
])  # fmt: skip
GOOD_52 = b"".join([
    line("start", 70, chain="41", link=1), line("exited", 90, rc=134),
    line("failed", 90, step=100, why="exit 134", rc=134), line("requeued", 91, successor="63"),
])  # fmt: skip
LISTED = b'{"job": "41", "link": 0}\n{"job": "52", "link": 1}\n{"job": "63", "link": 2}\n'


class Sbatch:
    """A fake SLURM for the supervisor (the real one is below): sbatch answers job 74."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        self.calls.append(list(argv))
        if argv[0] == "sbatch":
            return "74\n"
        if list(argv[:3]) == ["scontrol", "show", "hostnames"]:
            return "n1\n"
        if list(argv[:3]) == ["scontrol", "show", "job"]:
            return f"JobId={argv[3]} JobState=RUNNING Reason=None Restarts=0 NodeList=n1"
        return ""


def third_link(folder: Path, rc: int) -> tuple[int, str, Sbatch]:
    """Job 63, link 2 of chain 41: its step exits ``rc`` with 45 s left (a restart needs 55 s:
    41's start-up of 40 s, 5 steps of 1 s, a 10 s margin)."""
    env = {
        "PATH": str(Path(sys.executable).parent),
        "SLURM_JOB_ID": "63",
        "SLURM_JOB_NODELIST": "n1",
        "SLURMCLOCK_DIR": str(folder),
        "PYRECOVER_END_TIME": str(time.time() + 45),
        CHAIN_ID: "41",
        CHAIN_INDEX: "2",
    }
    slurm = Sbatch()
    config = SuperviseConfig(successor=("-t", "60", "job.sh"))
    sup = Supervisor(config, env=env, runner=slurm, out=io.StringIO())
    code = sup.run([sys.executable, "-c", f"raise SystemExit({rc})"])
    assert isinstance(sup.out, io.StringIO)
    return code, sup.out.getvalue(), slurm


MOMENTS = {"a failure": 134, "the hand-over": 75}  # the step's exit status


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("fault", FAULTS, ids=IDS)
def test_an_earlier_links_timeline(tmp_path: Path, fault: Fault, moment: str) -> None:
    (tmp_path / "job-41.jsonl").write_bytes(GOOD_41)
    (tmp_path / "job-41.chain.jsonl").write_bytes(LISTED)
    fault.apply(tmp_path / "job-52.jsonl", GOOD_52)
    here = JobTimeline("63", directory=tmp_path, env={})
    found = finishes(lambda: earlier(here, env={CHAIN_ID: "41"}, enough=settled), ALLOW)
    assert found.jobs == (["41", "52"] if fault.writes else ["41"])
    assert found.unread == ([] if fault.writes else ["52"])
    started = time.monotonic()
    code, out, slurm = third_link(tmp_path, MOMENTS[moment])
    assert time.monotonic() - started < ALLOW + 10  # the step itself: a Python start-up
    lines = out.splitlines()
    one_line_each(lines)
    assert "Traceback" not in out and not any(ln.startswith(FORGED) for ln in lines), out
    unread = [ln for ln in lines if "no readable timeline" in ln]
    assert len(unread) == (0 if fault.writes else 1), out  # named once
    submitted = [c for c in slurm.calls if c[0] == "sbatch"]
    if moment == "the hand-over":  # the run goes on, whatever the earlier link's file holds
        assert code == 0 and len(submitted) == 1, out
    elif fault.writes:  # 52's failure read: the third in a row, no successor
        assert code == 134 and out.count(GAVE_UP) == 1 and not submitted, out
    else:  # 52's failure unread: two in a row (41's, 63's); the run goes on
        assert "failure 2 of 3 in a row at checkpoint step 100" in out, out
        assert code == 0 and len(submitted) == 1, out


# -- a real SLURM: three successor jobs, the same crash in each --------------------------------

# The step: the chain's first allocation makes checkpoint 100 durable, then every allocation
# crashes after its resume, before another checkpoint.
STEP = """
import os, sys
from slurmclock import JobTimeline
if os.environ.get("SLURMCLOCK_CHAIN_INDEX", "0") == "0":
    JobTimeline().mark("checkpoint", step=100)
sys.exit(134)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tool = localslurm()
    if (reason := tool.unavailable_reason()) is not None:
        pytest.skip(reason)
    with tool.LocalCluster(tmp_path_factory.mktemp("streak"), cpus=2) as c:
        yield c


@pytest.mark.slurm
def test_a_chain_that_crashes_at_one_step_gives_up_in_its_third_job(
    cluster: Any, tmp_path: Path
) -> None:
    step, script = tmp_path / "step.py", tmp_path / "job.sh"
    step.write_text(STEP)
    succ = f"-o {tmp_path}/out-%j.txt -t 2 {script}"
    script.write_text(
        "#!/bin/bash\n"
        f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH\n"
        f"export SLURMCLOCK_DIR={shlex.quote(str(tmp_path / 'timelines'))}\n"
        f"exec slurmclock supervise --name t --no-restart-here --successor {shlex.quote(succ)} "
        f"-- {shlex.quote(sys.executable)} {step}\n"
    )
    jobs = [cluster.sbatch(str(script), "-o", f"{tmp_path}/out-%j.txt", "-t", "2")]
    ends = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED"}
    while True:  # each job's log names its successor; at most 5 followed (the bug: forever)
        info = cluster.wait_for(jobs[-1], ends, timeout=60)
        out = (tmp_path / f"out-{jobs[-1]}.txt").read_text()
        if "submitted job " not in out or len(jobs) >= 5:
            break
        jobs.append(out.split("submitted job ")[1].split()[0])
    assert len(jobs) == 3, jobs  # no fourth allocation
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "134:0", out  # before the limit
    assert out.count(GAVE_UP) == 1 and "Traceback" not in out, out
    first, second = ((tmp_path / f"out-{j}.txt").read_text() for j in jobs[:2])
    assert "failure 1 of 3 in a row at checkpoint step 100" in first, first
    assert "failure 2 of 3 in a row at checkpoint step 100" in second, second
    assert not list(cluster.jobs())
