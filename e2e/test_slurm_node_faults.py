"""Scenario 11: nodes lost mid-run, on local multi-node SLURMs with SLURM's default
SlurmdTimeout (300 s). The shipped sbatch script with ``--distributed`` (one rank per node):
its second node killed for good (slurmd, slurmstepd and the rank), frozen, cut off the network,
or only its rank killed. The job log names the node within seconds of ddpkit's report, the
stuck step is ended, and training goes on in the same allocation long before SLURM would mark
the node DOWN: on a hot spare (bitwise equal to a straight two-node run), on the node left (the
data position exact across the change of world size), or on both nodes when only the rank died
(bitwise). A job on a two-node partition that lost a node for good is requeued at its limit
asking for the one node left, instead of pending for ever. Drivers: node_faults.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import Background, one, runs
from faults import first_step_again, log_lines
from node_faults import BATCH, BY_NAME, CASES, REFERENCE, NodeRun, named_at
from train_helpers import assert_bitwise_equal, final_state

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(3600)]

# Fault -> the node named in the job log: ddpkit sees a dead peer in about a second, a cut-off
# one after 6 s without heartbeats, a frozen one after DDPKIT_FROZEN_AFTER (20 s).
NAMED_S = {"kill": 10.0, "rank": 10.0, "cut": 15.0, "freeze": 30.0}
TARGET_AGAIN_S = 60.0  # fault -> first training step again (a node gone for good)
# What the supervisor adds to the trainer's own start-up: a grace for srun, the end of the
# step through SLURM (3 + 3 s), what is left of the probe of the node (10 s), slack.
SUPERVISOR_S = 25.0


def result(bg: Background, name: str) -> NodeRun:
    run: NodeRun = bg.result(name, timeout=3000)
    return run


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_node_fault(name: str, long_node_faults: Background, figures: dict[str, Any]) -> None:
    """11. nodes lost mid-run"""
    run = result(long_node_faults, name)
    case, record = run.case, run.record
    assert record is not None
    log = record.log
    figures["case"] = case.title
    assert record.info["JobState"] == "COMPLETED", log
    assert log_messages(log)[-1] == "training finished", log
    assert run.fault_at is not None
    lines = log_lines(log)
    named = named_at(lines, run.fault_at)
    assert named is not None and named[1] == run.victim, log
    named_s = named[0] - int(run.fault_at)
    figures["named in"] = f"{named_s:.0f} s"
    assert named_s <= NAMED_S[case.fault], f"named {named_s:.0f} s after the fault\n{log}"
    again = first_step_again(log, named[0])
    if again is None:  # only a one-minute allocation may lack the time for a restart in it
        assert case.limited and (no_room(log) or limit_first(lines)), log
        figures["first step again"] = f"{first_step_after(run) - run.fault_at:.0f} s (requeued)"
    else:
        again_s = again - int(run.fault_at)
        said = next(m for _, m in lines if m.startswith("training again: "))
        startup = float(re.search(r"\(start-up (\d+) s\)", said).group(1))  # type: ignore[union-attr]
        figures["first step again"] = f"{again_s:.0f} s (start-up {startup:.0f} s)"
        allowed = max(TARGET_AGAIN_S, named_s + SUPERVISOR_S + startup)
        assert again_s <= allowed, (
            f"first step {again_s:.0f} s after (allowed {allowed:.0f})\n{log}"
        )
    CHECKS[case.name](run, log, figures)


def no_room(log: str) -> bool:
    """The supervisor found no time for a restart in the allocation and requeued."""
    return "s in this allocation: requeueing" in log


def limit_first(lines: list[tuple[float, str]]) -> bool:
    """The step was started again in the allocation (its measured start-up fitted the time
    left) and the limit came before its first step: requeued at SLURM's SIGTERM."""
    said = [m for _, m in lines]
    again = next(
        (i for i, m in enumerate(said) if m.startswith("starting the training step again")), None
    )
    return again is not None and any(
        m.startswith("received SIGTERM at the time limit: requeueing") for m in said[again:]
    )


def first_step_after(run: NodeRun) -> float:
    """When the trainer's first step after the fault was done (the job's timeline)."""
    assert run.fault_at is not None
    folder = run.job.dir / "timelines"
    marks = [
        json.loads(line)
        for path in folder.glob("*.jsonl")
        for line in path.read_text().splitlines()
        if not path.name.endswith(("faults.jsonl", ".chain.jsonl"))  # the timelines only
    ]
    return min(m["time"] for m in marks if m["event"] == "first_step" and m["time"] > run.fault_at)


def log_messages(text: str) -> list[str]:
    return [said for _, said in log_lines(text)]


def left_out(run: NodeRun, log: str) -> None:
    """The node did not answer: left out, given back to SLURM; no requeue for it."""
    msgs = log_messages(log)
    assert any(m.startswith(f"node {run.victim} does not answer") for m in msgs), log
    assert any(m.startswith(f"gave node(s) {run.victim} back to SLURM") for m in msgs), log
    # scontrol writes resize scripts into its cwd when it sees SLURM_JOBID: not into the user's.
    assert not list(run.job.dir.glob("slurm_job_*_resize.*")), "resize scripts in the submit dir"


def positions_exact(metrics: Path, steps: int) -> tuple[list[int], int]:
    """Each run resumed at the global data position its checkpoint holds and took world size x
    batch windows per step from there, to the last step: the world sizes run by run, and the
    position after the last step."""
    segments: list[tuple[int, int, int]] = []  # (first step, position after it, world size)
    for run in runs(metrics):
        world = one(run, "start")["world_size"]
        resumed = [e for e in run if e["event"] == "resume"]
        first = resumed[0]["step"] if resumed else 0
        at = position(segments, first)
        if resumed:
            assert resumed[0]["data_state"]["position"] == at, (resumed[0], segments)
        for e in (e for e in run if e["event"] == "step"):
            assert e["data_position"] == at + (e["step"] - first) * world * BATCH, (e, segments)
        segments.append((first, at, world))
    last = [e for e in runs(metrics)[-1] if e["event"] == "stop"]
    assert last and last[-1]["cause"] == "done" and last[-1]["step"] == steps, last
    return [world for _, _, world in segments], position(segments, steps)


def position(segments: list[tuple[int, int, int]], step: int) -> int:
    """The global data position after ``step`` steps, from the runs so far."""
    pos = 0
    for first, at, world in segments:
        if first <= step:
            pos = at + (step - first) * world * BATCH
    return pos


def on_the_nodes_left(run: NodeRun, log: str, figures: dict[str, Any]) -> None:
    left_out(run, log)
    if "training again: " in log:  # else (case gone) requeued: no time left for a restart
        assert "world size x1/2, the data goes on from its exact position" in log, log
    sizes, end = positions_exact(run.job.metrics, run.steps)
    assert sizes[0] == 2 and sizes[-1] == 1 and sizes == sorted(sizes, reverse=True), sizes
    _, state = final_state(run.job.ckpt, run.job.name)
    assert state["data"]["position"] == end, state["data"]
    figures["world size"] = " -> ".join(map(str, sizes))


def gone(run: NodeRun, log: str, figures: dict[str, Any]) -> None:
    """On with the node left, then requeued at the limit asking for the one node the
    partition still has (it would pend for ever asking for two)."""
    on_the_nodes_left(run, log, figures)
    assert run.record is not None
    restarts = int(run.record.info["RestartCnt"])
    assert restarts >= 1, log
    msgs = log_messages(log)
    assert any("the next allocation asks for 1 instead of 2 (NumNodes)" in m for m in msgs), log
    # It gave the node back (a resize): without accounting, slurmctld holds its updates until
    # the requeue is done, after the batch script -- the rounds sent until then landed.
    assert any(m.startswith("slurmctld holds the updates of job") for m in msgs), log
    assert any(re.match(r"job \S+, restart \d+, 1 node\(s\)", m) for m in msgs), log
    figures["allocations"] = restarts + 1


def straight(run: NodeRun, log: str, figures: dict[str, Any], bg: Background) -> None:
    ref = result(bg, REFERENCE)
    assert ref.record is not None and ref.record.info["JobState"] == "COMPLETED", ref.record
    _, want = final_state(ref.job.ckpt, ref.job.name)
    manifest, got = final_state(run.job.ckpt, run.job.name)
    assert manifest.step == run.steps and manifest.world_size == 2
    assert_bitwise_equal(want, got)
    figures["bitwise"] = "equal"


def spare(run: NodeRun, log: str, figures: dict[str, Any]) -> None:
    left_out(run, log)
    assert re.search(r"without \S+; spare \S+ takes over", log), log
    assert [one(r, "start")["world_size"] for r in runs(run.job.metrics)] == [2, 2]


def rank(run: NodeRun, log: str, figures: dict[str, Any]) -> None:
    msgs = log_messages(log)
    assert f"node {run.victim} answers: its rank failed, not the node" in msgs, log
    assert not any("back to SLURM" in m for m in msgs), log


CHECKS = {
    "gone": gone,
    "spare": spare,
    "frozen": on_the_nodes_left,
    "rank": rank,
    "cut": on_the_nodes_left,
}


@pytest.mark.parametrize("name", [c.name for c in CASES if c.compare == "straight"])
def test_node_fault_bitwise(
    name: str, long_node_faults: Background, figures: dict[str, Any]
) -> None:
    """11. nodes lost mid-run: the world size kept, bitwise equal to a straight two-node run"""
    run = result(long_node_faults, name)
    assert run.record is not None and run.record.info["JobState"] == "COMPLETED", run.record
    figures["case"] = BY_NAME[name].title
    straight(run, run.record.log, figures, long_node_faults)
