"""Two things that cross a boundary as data (DESIGN.md, "Environment variables" and "The job's
timeline"), each written by one side and read by the other:

- ``SLURMCLOCK_CHAIN_INDEX``: slurmclock's supervisor exports it to the successor job it
  submits (``sbatch --export=ALL,SLURMCLOCK_CHAIN_INDEX=N``); the app's batch script
  (``submit-training-simple.sh``) is that job and must carry it to ``slurmclock supervise``,
  which bounds the chain by ``MAX_RESTARTS``.
- the timeline's ``node`` event: the supervisor's node-state look writes it from what SLURM's
  commands print; ``slurmclock timeline --json`` reads it from a login shell, and the app's
  time budget (``pyrecover_train.build.budget``) reads the same file at its start: a ``node``
  line is neither unreadable nor an exit of an earlier run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_slurm_scripts import SIMPLE, fake, run_script  # noqa: F401 - fake is a fixture

import slurmclock
from pyrecover_train import build
from pyrecover_train.config import TrainConfig
from slurmclock.chain import CHAIN_ID
from slurmclock.commands import SubprocessRunner
from slurmclock.slurm import Slurm
from slurmclock.supervisor.history import failure_streak, restart_cost
from slurmclock.supervisor.nodestates import NodeStates
from slurmclock.supervisor.successor import CHAIN_INDEX, successor_argv

# -- SLURMCLOCK_CHAIN_INDEX ----------------------------------------------------------------


def exported(argv: list[str]) -> dict[str, str]:
    """The variables slurmclock's sbatch line exports to the successor, as SLURM sets them."""
    (export,) = [a for a in argv if a.startswith("--export=")]
    pairs = export.removeprefix("--export=").split(",")
    return dict(p.split("=", 1) for p in pairs if "=" in p)


@pytest.mark.parametrize(
    "earlier, max_restarts, next_index",
    [(0, 3, 2), (2, 3, None), (5, 50, 7)],
    ids=["first-successor", "chain-at-max", "mid-chain"],
)
def test_the_chain_index_reaches_the_successors_supervisor(
    fake: Path,  # noqa: F811 - the batch-script tests' fixture
    earlier: int,
    max_restarts: int,
    next_index: int | None,
) -> None:
    # slurmclock writes: the job at index `earlier` submits its successor
    sent = exported(successor_argv("4241", [str(SIMPLE)], index=earlier, time_min=None))
    assert sent == {CHAIN_INDEX: str(earlier + 1), CHAIN_ID: "4241"}  # the chain: its first job
    # the app's batch script is that successor; slurmclock supervise in it reads the index
    r = run_script(
        fake,
        SIMPLE,
        FAKE_RC="75",
        REQUEUE="successor",
        MAX_RESTARTS=str(max_restarts),
        SLURM_JOB_NUM_NODES="1",
        **sent,
    )
    said = r.stdout + r.stderr
    submitted = (fake / "sbatch.log").read_text() if (fake / "sbatch.log").exists() else ""
    if next_index is None:
        assert f"the chain already had {earlier + 2} allocations (max restarts)" in said, said
        assert submitted == ""
    else:
        export = f"--export=ALL,{CHAIN_INDEX}={next_index},{CHAIN_ID}=4241"
        assert export in submitted.splitlines(), said


# -- the timeline's node event -------------------------------------------------------------

NODE_KEYS = {"node": str, "state": str, "reason": str, "kind": str, "in_job": int, "spare": int}


def write_node_events(job: Any, tmp: Path) -> list[str]:
    """The supervisor's node-state look over SLURM's (faked) commands: n2 DOWN with a reason
    that has spaces, n3 drained; their lines in the job log."""
    host = job.env["SLURM_JOB_NODELIST"]
    env = dict(job.env)
    env["FAKE_JOB"] = (
        f"JobId=4242 JobState=RUNNING Reason=None Restarts=0 Partition=p "
        f"NodeList={host},n3 NumNodes=2 ExcNodeList=(null)"
    )
    env["FAKE_SINFO"] = f"{host} alloc none\\nn2 down* Not responding\\nn3 drain maint window\\n"
    timeline = slurmclock.JobTimeline(env=env)
    said: list[str] = []
    states = NodeStates(Slurm(SubprocessRunner(env)), "4242", 10.0, said.append, timeline.mark)
    states.look([host, "n2", "n3"], spares=["n3"])
    return said


def test_node_events_are_read_by_the_cli_and_the_apps_budget(
    job: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    said = write_node_events(job, tmp_path)
    assert len(said) == 2 and "n2" in said[0] and "n3" in said[1], said
    # read from a login shell: no SLURM_JOB_ID, the job id names the file
    login = {k: v for k, v in job.env.items() if not k.startswith("SLURM_JOB")}
    argv = [sys.executable, "-m", "slurmclock", "timeline", "--json", job.id]
    out = subprocess.run(argv, env=login, capture_output=True, text=True, timeout=60, check=True)
    listed = json.loads(out.stdout)
    nodes = [e for e in listed["events"] if e["event"] == "node"]
    assert [(e["node"], e["kind"]) for e in nodes] == [("n2", "gone"), ("n3", "drained")]
    for e in nodes:
        assert all(isinstance(e[k], t) for k, t in NODE_KEYS.items()), e
        assert e["in_job"] in (0, 1) and e["spare"] in (0, 1)
    assert nodes[0]["reason"] == "Not responding" and nodes[0]["in_job"] == 0
    assert nodes[1]["spare"] == 1 and listed["unreadable_lines"] == []
    # the supervisor's own reading: a node event is no failure and no start-up
    events = slurmclock.JobTimeline(env=job.env).events()
    assert failure_streak(events).count == 0 and restart_cost(events).startup is None
    # the app's budget reads the file at its start: nothing unreadable, no exit invented
    monkeypatch.setattr("os.environ", dict(job.env))
    flag = slurmclock.AnyFlag(slurmclock.StopSignals(slurmclock.STOP_SIGNALS))
    budget = build.budget(TrainConfig(), torch.nn.Linear(2, 2), flag)
    assert budget.timeline is not None and budget.timeline.unreadable == []
    assert budget.timeline.exit_samples() == []
