"""The drivers of scenario 11, nodes lost mid-run (test_slurm_node_faults.py asserts): the
multi-node part of the fault matrix. Each case submits the shipped sbatch script with
``--distributed`` and one rank per node to a local multi-node SLURM of its own
(tools/localslurm.py's MultiNodeCluster: SLURM's default SlurmdTimeout, 300 s), waits until it
trains, hits its second node -- killed for good (its slurmd, slurmstepd and ranks), frozen
(SIGSTOP to all of it), its network cut (eth0 down), or only its rank killed -- and records
what the job log and the metrics say until the job is over. Beside them one straight two-node run
of the same flags: what the cases that keep their world size must equal bitwise.

The node never comes back: SLURM would mark it DOWN only after SlurmdTimeout, and the job must
go on long before that (``slurmclock supervise``: ended step, probe, relaunch on the nodes left,
the lost node given back to SLURM). Case ``gone`` runs on a two-node partition with a one-minute
limit and trainers slowed to a tenth (as scenario 10), so that after the loss it is requeued and
its next allocation must ask for the one node the partition still has.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e_helpers import (
    Background,
    Calibration,
    Job,
    JobRecord,
    last_step,
    runs,
    trainer_flags,
    wait_until,
)
from faults import WRAPPER
from multinode import Throttle, steps_for

STEPS = 200  # an unslowed case: ~10 s of training on two ranks
EVERY = 25  # a checkpoint every 25 steps
FAULT_AT = 60  # the step at which the second node is hit (a slowed case: FAULT_AT_SLOW)
FAULT_AT_SLOW = EVERY + 1  # right after the first checkpoint: time left for a restart
BATCH = 4  # tiny_flags' --batch-size, per rank
# At most this many cases start up (import torch, build the model) at once: two cores.
_STARTING = threading.Semaphore(2)


@dataclass(frozen=True)
class NodeCase:
    """One row: ``fault`` (kill, freeze, cut, rank) on the job's second node; the job asks for
    ``nodes`` of the cluster's ``cluster_nodes`` with ``spare`` hot spares; ``limited``: a
    one-minute limit with slowed trainers (requeued after the loss); ``compare``: ``straight``
    (bitwise, the world size kept) or ``position`` (the world size changes: the data position
    must go on exactly)."""

    name: str
    title: str
    fault: str
    nodes: int = 2
    spare: int = 0
    cluster_nodes: int = 2
    limited: bool = False
    compare: str = "position"


CASES = [
    NodeCase("gone", "11a. a node killed for good, --nodes=2 on two nodes: on with one, then "
             "requeued on one", "kill", limited=True),
    NodeCase("spare", "11b. a node killed for good, a hot spare (--nodes=3, SPARE_NODES=1)",
             "kill", nodes=3, spare=1, cluster_nodes=3, compare="straight"),
    NodeCase("frozen", "11c. a node frozen (SIGSTOP to all of it)", "freeze"),
    NodeCase("rank", "11d. one rank killed on the second node (the node lives)", "rank",
             compare="straight"),
    NodeCase("cut", "11e. a node's network cut (eth0 down)", "cut"),
]  # fmt: skip
BY_NAME = {c.name: c for c in CASES}
REFERENCE = "straight"


@dataclass
class NodeRun:
    """What a driver saw: the job, when the fault came (epoch seconds), the victim node."""

    case: NodeCase
    job: Job
    record: JobRecord | None = None
    fault_at: float | None = None
    victim: str = ""
    steps: int = STEPS
    notes: dict[str, Any] = field(default_factory=dict)


def drive_node_faults(
    bg: Background, localslurm: Any, env: dict[str, str], work: Path, corpus: Path, cache: Path,
    quiet: Calibration, wanted: list[str], clusters: list[Any],
) -> None:  # fmt: skip
    """Start the wanted cases (and the straight reference, when one compares with it), each on
    a cluster of its own, in ``bg``; the clusters go to ``clusters`` (the caller stops them)."""
    names = list(wanted)
    if any(BY_NAME[n].compare == "straight" for n in wanted):
        names.append(REFERENCE)
    for name in names:
        case = BY_NAME.get(name, NodeCase(REFERENCE, "two nodes, straight", "none"))
        cluster = localslurm.MultiNodeCluster(work / f"slurm-{name}", nodes=case.cluster_nodes,
                                              cpus=2)  # fmt: skip
        clusters.append(cluster)
        cluster.start()
        cluster.env = localslurm.client_env(cluster.conf_path, env)
        job = Job(cluster, work, name)
        bg.start(name, lambda c=case, j=job: drive(c, j, corpus, cache, quiet))


def drive(case: NodeCase, job: Job, corpus: Path, cache: Path, quiet: Calibration) -> NodeRun:
    run = NodeRun(case, job, steps=steps_for(quiet) if case.limited else STEPS)
    every = ["--log-every", "10" if case.limited else "1"]
    flags = ["--distributed", *trainer_flags(corpus, cache, Path("ckpt"), run.steps, EVERY, *every)]
    sbatch = [f"--nodes={case.nodes}", "--ntasks-per-node=1", f"--time={1 if case.limited else 10}"]
    # The trainers at nice 10, as the fault matrix's (fault_wrapper.py): scenario 1 measures
    # start-up and goodput meanwhile; these cases measure the supervisor.
    extra = {
        "TRAIN_CMD": str(WRAPPER),
        "FAULT_DIR": str(job.dir),
        "FAULT_METRICS": str(job.metrics),
    }
    if case.spare:
        extra["SPARE_NODES"] = str(case.spare)
    with _STARTING:
        run.record = job.submit(sbatch, flags, **extra)
        wait_until(f"{job.name}: first step", lambda: last_step(job.metrics) >= 1, 900, 0.1)
    throttle = Throttle(0.1) if case.limited else None
    try:
        if case.fault != "none":
            hit(run, throttle)
        run.record = job.finish(run.record, timeout=1500)
    finally:
        if throttle is not None:
            throttle.release()
    return run


def hit(run: NodeRun, throttle: Throttle | None) -> None:
    """The fault, on the job's second node, once it trained to its fault step."""
    job, cluster = run.job, run.job.cluster
    at = FAULT_AT_SLOW if throttle is not None else FAULT_AT
    nodes = cluster.nodes
    while last_step(job.metrics) < at:
        if throttle is not None:  # the trainers of the allocation, wherever they run
            throttle.hold({p for n in nodes for p in trainers(cluster, n, job.name)})
        time.sleep(0.1)
    run.notes["fault_step"] = last_step(job.metrics)
    run.victim = victim = nodes[1]
    run.fault_at = time.time()
    if run.case.fault == "kill":
        cluster.kill_node(victim)
    elif run.case.fault == "freeze":
        cluster.freeze_node(victim)
    elif run.case.fault == "cut":
        cluster.cut_network(victim)
    else:  # its rank only: the node lives
        for pid in trainers(cluster, victim, job.name):
            os.kill(pid, signal.SIGKILL)
    if throttle is not None:
        keep_slow(job, throttle, victim)
        throttle.release()


def keep_slow(job: Job, throttle: Throttle, victim: str, timeout: float = 1500) -> None:
    """The trainer the job starts again after the fault is slowed too (not the victim's: a
    frozen one stays frozen) from its first step, until the allocation ends and the job is
    requeued: what the next allocation asks for is what the case is about; it then trains at
    full speed. Its start-up is not slowed: the supervisor restarts it in the allocation when
    the time left holds the start-up it measured, at full speed."""
    cluster, end = job.cluster, time.monotonic() + timeout
    others = [n for n in cluster.nodes if n != victim]
    restarts = job.state().get("Restarts")
    before = len(runs(job.metrics))
    while time.monotonic() < end and job.state().get("JobState") not in FINAL:
        if job.state().get("Restarts") != restarts:
            return
        rs = runs(job.metrics)
        stepping = len(rs) > before and any(e["event"] == "step" for e in rs[-1])
        throttle.hold(
            {p for n in others for p in trainers(cluster, n, job.name)} if stepping else set()
        )
        time.sleep(0.3)


def trainers(cluster: Any, node: str, exp: str) -> list[int]:
    """The trainer processes of experiment ``exp`` on ``node`` (the wrapper's: it becomes the
    trainer in its own process; not srun's, whose command line names it too)."""
    found = []
    for pid, cmd in cluster.processes(node).items():
        argv = cmd.split()
        if len(argv) > 1 and argv[1] == str(WRAPPER) and f" --experiment_name {exp} " in f"{cmd} ":
            found.append(pid)
    return found


FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}

# -- reading the job log ---------------------------------------------------------------------------

_NAMED = re.compile(r"(?:rank \d+|a rank) on node (\S+) was (dead|frozen)")


def named_at(lines: list[tuple[float, str]], since: float) -> tuple[float, str] | None:
    """(when, node) of the job log's first line naming a dead or frozen rank's node."""
    for t, said in lines:
        if t >= int(since) and (m := _NAMED.search(said)):
            return t, m.group(1)
    return None
