"""slurmclock supervise, inside the allocation: a failure with time left starts the step again
(no requeue, no queue) when the measured start-up fits; the crash-loop guard counts those
restarts and requeues alike; exit 74 (the store unreachable) is tried again after a pause and
never counted; a lost node is left out and the step goes on without it (a spare, or fewer
nodes); a requeue asks for no more nodes than the partition can give. A fake scheduler and a fake
clock (its sleep advances it), real child processes as the step."""

from __future__ import annotations

import io
import json
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from slurmclock import EndTime, JobTimeline, JobView, Node, Step
from slurmclock.job import JobState
from slurmclock.supervisor import SuperviseConfig, Supervisor

JOB = "42"
NOW = float(int(time.time()))  # the steps mark the timeline with the real clock

# The step: each launch records its command line and exits with the next of the given codes;
# "CODE:HOST" writes a fault record naming HOST first (a rank there was dead), "hang" hangs (srun
# waiting on a node that does not answer), "CODE+" marks the trainer's first step first.
STEP = """
import json, os, sys, time
from pathlib import Path
folder, codes = Path(sys.argv[1]), sys.argv[2].split(",")
n = len(list(folder.glob("launch-*")))
(folder / f"launch-{n}").write_text(json.dumps(sys.argv[3:]))
plan = codes[min(n, len(codes) - 1)]
code, _, fault = plan.partition(":")
if code.endswith("+"):
    from slurmclock import JobTimeline
    code = code[:-1]
    JobTimeline().mark("first_step", step=1, seconds=0.5)
if fault:
    record = {"time": 4e9, "rank": 1, "host": fault, "what": "dead", "reporter": 0}
    with open(os.environ["DDPKIT_FAULT_FILE"], "a") as f:
        f.write(json.dumps(record) + "\\n")
if code.endswith("~"):  # a rank of the launch before, cut off, reports this one's as dead
    code = code[:-1]
    earlier = os.environ["DDPKIT_FAULT_FILE"].replace(f"-{n + 1}.faults", f"-{n}.faults")
    record = {"time": 4e9, "rank": 0, "host": "n1", "what": "dead", "reporter": 1}
    with open(earlier, "a") as f:
        f.write(json.dumps(record) + "\\n")
    time.sleep(1)
if code == "limit":  # SLURM's SIGTERM at the time limit to the batch script, then its SIGKILL
    import signal
    os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(1)
    code = "137"
if code == "hang":
    time.sleep(120)
sys.exit(int(code))
"""

# A stand-in for srun: records the options the supervisor put first, runs the rest.
SRUN = """#!{python}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
placed = []
while args and args[0].startswith("--"):
    placed.append(args.pop(0))
with open(Path(sys.argv[0]).with_name("srun.log"), "a") as f:
    f.write(json.dumps(placed) + "\\n")
os.execv(args[0], args)
"""


class TickingClock:
    """Epoch seconds; ``tick`` added at every reading (the supervisor's graces pass quickly),
    ``sleep`` advances it."""

    def __init__(self, now: float = NOW, tick: float = 0.0) -> None:
        self.now, self.tick = now, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def make(
    tmp_path: Path,
    fakes: Any,
    *,
    left: float | None = 3600.0,
    nodes: str = "n1",
    restart: int = 0,
    tick: float = 0.0,
    **config: Any,
) -> tuple[Supervisor, Any, TickingClock]:
    count = len(nodes.split(","))
    view = JobView(
        state=JobState.ACTIVE, partition="p", nodes=nodes, num_nodes=count, restarts=restart
    )
    scheduler = fakes.Scheduler({JOB: view})
    scheduler.partitions["p"] = [Node(n, "idle", True) for n in nodes.split(",")]
    clock = TickingClock(tick=tick)
    if left is not None:
        scheduler.ends[JOB] = EndTime(str(NOW + left), left, "fake")
    env = {
        "PATH": str(Path(sys.executable).parent),
        "SLURM_JOB_ID": JOB,
        "SLURM_RESTART_COUNT": str(restart),
        "SLURM_JOB_NODELIST": nodes,
        "SLURM_JOB_NUM_NODES": str(count),
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURMCLOCK_DIR": str(tmp_path / "timelines"),
    }
    config.setdefault("resume_hint", "submit again with --continue")
    sup = Supervisor(
        SuperviseConfig(**config),
        env=env,
        scheduler=scheduler,
        clock=clock,
        sleep=clock.sleep,
        out=io.StringIO(),
        here="n1",
    )
    return sup, scheduler, clock


def step(tmp_path: Path, *codes: str, srun: bool = False) -> list[str]:
    script = tmp_path / "step.py"
    script.write_text(STEP)
    argv = [sys.executable, str(script), str(tmp_path), ",".join(codes)]
    if not srun:
        return argv
    fake = tmp_path / "srun"
    fake.write_text(SRUN.format(python=sys.executable))
    fake.chmod(0o755)
    return [str(fake), *argv]


def log(sup: Supervisor) -> str:
    out = sup.out
    assert isinstance(out, io.StringIO)
    return out.getvalue()


def events(sup: Supervisor) -> list[str]:
    return [e.name for e in sup.timeline.events()]


def launches(tmp_path: Path) -> list[list[str]]:
    found = sorted(tmp_path.glob("launch-*"), key=lambda p: int(p.name.split("-")[1]))
    return [json.loads(p.read_text()) for p in found]


def placed(tmp_path: Path) -> list[list[str]]:
    return [json.loads(line) for line in (tmp_path / "srun.log").read_text().splitlines()]


ENDED = ("exited", NOW - 50, {"rc": 75})  # an earlier run that ended cleanly


def history(sup: Supervisor, *marks: tuple[str, float, dict[str, Any]]) -> None:
    """Earlier lines of the job's timeline, at fake times before NOW."""
    timeline = JobTimeline(JOB, directory=sup.timeline.directory, env={})
    for name, at, info in marks:
        timeline.mark(name, at=at, **info)


# -- a crash -------------------------------------------------------------------------------------


def test_a_crash_with_time_left_starts_again_in_the_allocation(tmp_path: Path, fakes: Any) -> None:
    sup, scheduler, _ = make(tmp_path, fakes, relaunch_args=("--resume", "latest"), tick=0.05)
    history(sup, ("start", NOW - 100, {}), ("first_step", NOW - 70, {"seconds": 2.0}), ENDED)
    assert sup.run(step(tmp_path, "137", "0+")) == 0
    out = log(sup)
    assert re.search(
        r"training failed \(exit 137 \(killed by SIGKILL\), failure 1 of 3 in a row before any "
        r"checkpoint\): starting it again in this allocation \(3[56]\d\d s left, a restart needs "
        r"~50 s\)",
        out,
    ), out  # the start-up measured (30 s) + 5 steps of 2 s + a 10 s margin
    assert "starting the training step again (launch 2)" in out
    assert "training again: the first step of this launch was done " in out  # the job log's
    assert out.index("training again") < out.index("training finished")
    assert launches(tmp_path) == [[], ["--resume", "latest"]]
    assert events(sup)[3:] == ["start", "exited", "failed", "relaunched", "first_step", "exited"]
    assert not any(c[0] == "requeue" for c in scheduler.calls)


def test_without_the_time_for_a_restart_the_job_is_requeued(tmp_path: Path, fakes: Any) -> None:
    sup, scheduler, _ = make(tmp_path, fakes, left=45.0)
    history(sup, ("start", NOW - 100, {}), ("first_step", NOW - 70, {"seconds": 2.0}), ENDED)
    assert sup.run(step(tmp_path, "1", "0")) == 0
    assert (
        "training failed (exit 1, failure 1 of 3 in a row before any checkpoint); 45 s left, a "
        "restart needs ~50 s in this allocation: requeueing to resume from the newest checkpoint"
    ) in log(sup)
    assert len(launches(tmp_path)) == 1 and ("requeue", JOB) in scheduler.calls


def test_before_any_start_up_is_measured_a_guess_stands(tmp_path: Path, fakes: Any) -> None:
    sup, _, _ = make(tmp_path, fakes, left=65.0, startup_guess=60.0)
    assert sup.run(step(tmp_path, "1", "0")) == 0
    assert "65 s left, a restart needs ~70 s in this allocation: requeueing" in log(sup)


def test_the_crash_loop_guard_counts_restarts_and_requeues_alike(
    tmp_path: Path, fakes: Any
) -> None:
    # The run before this allocation failed at step 100 (its allocation then requeued it).
    sup, scheduler, _ = make(tmp_path, fakes, restart=1)
    history(
        sup,
        ("start", NOW - 500, {}),
        ("checkpoint", NOW - 400, {"step": 100}),
        ("exited", NOW - 300, {"rc": 139}),
        ("failed", NOW - 300, {"rc": 139, "step": 100, "why": "exit 139", "nodes": "n1"}),
        ("requeued", NOW - 299, {"confirmed": True}),
    )
    assert sup.run(step(tmp_path, "139")) == 139
    out = log(sup)
    assert len(launches(tmp_path)) == 2, out  # the first failure here is the second in a row
    assert "failure 2 of 3 in a row at checkpoint step 100): starting it again" in out
    assert out.count("gave up: the training step failed 3 times in a row at checkpoint step") == 1
    assert events(sup)[-1] == "gave_up" and events(sup).count("failed") == 3
    assert not any(c[0] == "requeue" for c in scheduler.calls)


# -- the store -----------------------------------------------------------------------------------


def test_an_unreachable_store_is_tried_again_and_never_counted(tmp_path: Path, fakes: Any) -> None:
    sup, scheduler, clock = make(tmp_path, fakes, max_failures=1)
    assert sup.run(step(tmp_path, "74", "74", "74", "0")) == 0
    out = log(sup)
    what = "the checkpoint store could not be reached (exit 74: nothing lost, not a failure)"
    for pause in (5, 10, 20):  # doubling; one line each time
        assert f"{what}: trying again in {pause} s in this allocation" in out
    assert clock.now >= NOW + 35 and "training finished" in out
    assert "failed" not in events(sup) and len(launches(tmp_path)) == 4
    assert not any(c[0] == "requeue" for c in scheduler.calls)


def test_an_unreachable_store_near_the_end_is_requeued(tmp_path: Path, fakes: Any) -> None:
    sup, scheduler, _ = make(tmp_path, fakes, left=50.0)
    assert sup.run(step(tmp_path, "74", "0")) == 0
    assert "(exit 74: nothing lost, not a failure); 50 s left, a restart needs ~75 s" in log(sup)
    assert ("requeue", JOB) in scheduler.calls and "failed" not in events(sup)


def test_an_outage_that_outlasts_the_allocation_is_given_up_once(
    tmp_path: Path, fakes: Any
) -> None:
    """Issue 34: 74 through the allocation's retries is one line and the end, not a requeue
    up to --max-restarts times (each would only meet the same outage)."""
    sup, scheduler, clock = make(tmp_path, fakes, left=100.0, tick=0.0)
    steps = step(tmp_path, "74", "74", "74", "74", "0")
    code = sup.run(steps)
    out = log(sup)
    assert code == 74, out
    assert "trying again in 5 s in this allocation" in out
    assert out.count("gave up: the checkpoint store did not answer through") == 1, out
    assert "not requeueing (nothing is lost)" in out and "failed" not in events(sup)
    assert events(sup)[-1] == "gave_up"
    assert not any(c[0] == "requeue" for c in scheduler.calls)


# -- requeue off (issue 30) ----------------------------------------------------------------------


def test_requeue_off_in_a_plain_job_ends_with_the_steps_status(tmp_path: Path, fakes: Any) -> None:
    sup, scheduler, _ = make(tmp_path, fakes, requeue=False)
    assert sup.run(step(tmp_path, "75")) == 75
    said = log(sup)
    assert "stopped early with steps left; not requeueing (requeue is off); to go on: " in said
    assert "next array task" not in said and ("requeue", JOB) not in scheduler.calls


# -- a lost node ---------------------------------------------------------------------------------


def test_a_dead_node_is_left_out_and_the_step_goes_on_with_the_nodes_left(
    tmp_path: Path, fakes: Any
) -> None:
    sup, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2")
    scheduler.dead.add("n2")
    assert sup.run(step(tmp_path, "69:n2", "0", srun=True)) == 0
    out = log(sup)
    named = out.index("rank 1 on node n2 was dead (reported by rank 0): the step cannot go on")
    assert named < out.index("training step exited with status 69")
    assert "node n2 does not answer (node n2 did not answer): left out of this job" in out
    assert (
        "on 1 node(s) (n1) of 2 without n2: world size x1/2, the data goes on from its exact "
        "position" in out
    )
    assert placed(tmp_path) == [
        ["--nodes=2", "--nodelist=n1,n2", "--ntasks=2"],
        ["--nodes=1", "--nodelist=n1", "--ntasks=1", "--overlap"],
    ]
    assert ("probe_node", JOB, "n2") in scheduler.calls
    # Given back: SLURM would hold the job (its end, a requeue) until it marks n2 DOWN.
    assert ("update_job", JOB, "NodeList=n1") in scheduler.calls
    assert "gave node(s) n2 back to SLURM (NodeList=n1)" in out
    timeline = sup.timeline.events()
    fault = next(e for e in timeline if e.name == "fault")
    assert (fault.info["node"], fault.info["what"], fault.info["rank"]) == ("n2", "dead", 1)
    assert [e.name for e in timeline][1:] == ["fault", "exited", "failed", "relaunched", "exited"]


def test_a_rank_cut_off_in_an_earlier_launch_cannot_end_the_next(
    tmp_path: Path, fakes: Any
) -> None:
    """A node cut off from the network goes on running its rank, which reports the others dead
    once it misses them -- after its step was ended and the next launched: each launch has a
    fault file of its own (DDPKIT_FAULT_FILE)."""
    sup, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2")
    scheduler.dead.add("n2")
    assert sup.run(step(tmp_path, "69:n2", "0~", srun=True)) == 0
    out = log(sup)
    assert out.count("the step cannot go on") == 1 and "training finished" in out
    files = sorted(p.name for p in (tmp_path / "timelines").glob("*.faults.jsonl"))
    assert files == ["job-42.0-1.faults.jsonl"]  # launch 2's ranks reported nothing


def test_a_hot_spare_takes_the_place_of_a_lost_node(tmp_path: Path, fakes: Any) -> None:
    sup, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2,n3", spare_nodes=1)
    scheduler.dead.add("n2")
    assert sup.run(step(tmp_path, "69:n2", "0", srun=True)) == 0
    out = log(sup)
    assert "training on n1, n2; hot spare(s): n3" in out
    assert "on n1, n3 without n2; spare n3 takes over" in out
    assert placed(tmp_path)[1] == ["--nodes=2", "--nodelist=n1,n3", "--ntasks=2", "--overlap"]


def test_a_rank_that_died_on_a_live_node_keeps_the_node(tmp_path: Path, fakes: Any) -> None:
    sup, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2")
    assert sup.run(step(tmp_path, "69:n2", "0", srun=True)) == 0
    assert "node n2 answers: its rank failed, not the node" in log(sup)
    assert placed(tmp_path)[1] == ["--nodes=2", "--nodelist=n1,n2", "--ntasks=2", "--overlap"]


def test_a_step_stuck_on_a_lost_node_is_ended_through_slurm(tmp_path: Path, fakes: Any) -> None:
    """srun waits on a node that does not answer: the supervisor ends the step (scancel of the
    newest training step, not a probe), then kills srun, then goes on without the node."""
    sup, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2", tick=0.25)
    scheduler.dead.add("n2")
    scheduler.running[JOB] = [
        Step(f"{JOB}.batch", "n1", "batch"),
        Step(f"{JOB}.0", "n[1-2]", "python"),
        Step(f"{JOB}.1", "n2", "slurmclock-probe"),
    ]
    assert sup.run(step(tmp_path, "hang:n2", "0", srun=True)) == 0
    out = log(sup)
    assert "srun still waits on the step's nodes: ended 42.0" in out
    assert "srun did not leave: killed it (SIGKILL)" in out
    assert "training step exited with status 137" in out
    assert ("cancel_step", f"{JOB}.0") in scheduler.calls and "training finished" in out


def test_below_the_minimum_the_job_is_requeued_with_fewer_nodes(tmp_path: Path, fakes: Any) -> None:
    """Two nodes of three left, two needed to train with the spare gone: a requeue; the
    partition has two usable nodes, so the job asks for two (SLURM drops a NumNodes its task
    count contradicts: the task count first)."""
    sup, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2,n3", min_nodes=3)
    scheduler.dead.add("n2")
    scheduler.partitions["p"][1] = Node("n2", "down*", False)
    assert sup.run(step(tmp_path, "69:n2", srun=True)) == 69
    out = log(sup)
    assert "2 node(s) of this allocation left, fewer than the minimum of 3 (MIN_NODES)" in out
    assert "gave up: partition p has 2 usable node(s) for this job, fewer than its minimum" in out


def test_a_requeue_asks_for_no_more_nodes_than_the_partition_has(
    tmp_path: Path, fakes: Any
) -> None:
    sup, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2,n3", left=40.0)
    scheduler.dead.add("n2")
    scheduler.partitions["p"][1] = Node("n2", "down*", False)
    assert sup.run(step(tmp_path, "69:n2", srun=True)) == 0
    updates = [c for c in scheduler.calls if c[0] in ("requeue", "update_job")]
    assert updates == [
        ("update_job", JOB, "NodeList=n1,n3"),
        ("requeue", JOB),
        ("update_job", JOB, "NumTasks=2"),
        ("update_job", JOB, "NumNodes=2-2"),
        ("update_job", JOB, "NumTasks=2"),  # again: SLURM may take them out of order
        ("update_job", JOB, "NumNodes=2-2"),
        ("update_job", JOB, "NumTasks=2"),  # last: a task count after the node count holds
    ]
    assert "the next allocation asks for 2 instead of 3 (NumNodes)" in log(sup)


def test_a_requeue_at_the_limit_after_a_node_loss_asks_for_the_nodes_left(
    tmp_path: Path, fakes: Any
) -> None:
    """The time limit after the job went on without a node: requeued at SLURM's SIGTERM,
    planned while the job runs, the counts sent right after SLURM accepted."""
    sup, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2,n3")
    scheduler.jobs[JOB] = replace(scheduler.jobs[JOB], state=JobState.TIMED_OUT, reason="TimeLimit")
    scheduler.dead.add("n2")
    scheduler.partitions["p"][1] = Node("n2", "idle*", False)
    assert sup.run(step(tmp_path, "69:n2", "limit", srun=True)) == 0
    out = log(sup)
    assert "received SIGTERM at the time limit: requeueing job 42 now" in out
    assert "the next allocation asks for 2 instead of 3 (NumNodes)" in out
    updates = [c for c in scheduler.calls if c[0] in ("requeue", "update_job")]
    assert updates[1:] == [
        ("requeue", JOB),
        ("update_job", JOB, "NumTasks=2"),
        ("update_job", JOB, "NumNodes=2-2"),
        ("update_job", JOB, "NumTasks=2"),
        ("update_job", JOB, "NumNodes=2-2"),
        ("update_job", JOB, "NumTasks=2"),
    ]
    assert "already requeued at the time limit" in out


@pytest.mark.parametrize(
    ("nodes", "config", "said"),
    [
        ("n1", {"spare_nodes": 1}, "has 1 node(s), the settings ask for at least 1 node(s) to "
         "train on and 1 spare(s) (MIN_NODES, SPARE_NODES): submit with --nodes=2"),
        ("n1,n2", {"min_nodes": 3}, "has 2 node(s), the settings ask for at least 3 node(s)"),
    ],
)  # fmt: skip
def test_node_settings_the_allocation_cannot_meet_are_one_line(
    tmp_path: Path, fakes: Any, nodes: str, config: dict[str, Any], said: str
) -> None:
    sup, _, _ = make(tmp_path, fakes, nodes=nodes, **config)
    assert sup.run(step(tmp_path, "0")) == 2
    out = log(sup)
    assert said in out and "(nothing was run)" in out and out.count("\n") == 1
    assert launches(tmp_path) == []


def test_a_later_allocation_with_fewer_nodes_trains_without_its_spare(
    tmp_path: Path, fakes: Any
) -> None:
    sup, _, _ = make(tmp_path, fakes, nodes="n1", restart=1, spare_nodes=1)
    assert sup.run(step(tmp_path, "0")) == 0
    assert "1 node(s) in this allocation: no spare left (of 1)" in log(sup)
