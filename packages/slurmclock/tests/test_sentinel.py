"""The sentinel of the batch node (supervisor/sentinel.py): it requeues only when SLURM shows the
batch node lost to the job, names what it saw in the timeline, and the next allocation's
supervisor says so in its job log without counting a failure. The real thing: chaos/test_nodes.py
(the batch node set DOWN, and killed, on a three-node SLURM)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from slurmclock import JobTimeline, JobView, Node
from slurmclock.supervisor.sentinel import SENTINEL_NAME, Sentinel, batch_node_lost

sys.path.insert(0, str(Path(__file__).parent))
from test_restart import JOB, log, make, step  # noqa: E402  - its fake job

ENV = {"SLURM_JOB_ID": JOB, "SLURM_RESTART_COUNT": "0", "SLURM_PROCID": "0"}


def sentinel(tmp_path: Path, fakes: Any, batch_state: str = "mix", in_job: bool = True) -> Any:
    nodes = "n1,n2" if in_job else "n2"
    view = JobView(state="RUNNING", partition="p", nodes=nodes, num_nodes=2, restarts=0)
    scheduler = fakes.Scheduler({JOB: view})
    scheduler.partitions["p"] = [Node("n1", batch_state, True, "psu"), Node("n2", "mix", True)]
    timeline = JobTimeline(env={**ENV, "SLURMCLOCK_DIR": str(tmp_path / "t")})
    made = Sentinel(
        JOB,
        "n1",
        beat=tmp_path / "beat",
        stop=tmp_path / "stop",
        scheduler=scheduler,
        timeline=timeline,
        silent=0.5,
    )
    return made, scheduler, timeline


def test_a_healthy_batch_node_is_never_requeued(tmp_path: Path, fakes: Any) -> None:
    """The time limit, scancel, the job's end: SLURM's SIGTERM with the batch node in the job."""
    made, scheduler, _ = sentinel(tmp_path, fakes)
    assert made.batch_gone() is None
    made.term = True
    assert made.watch() == 0
    assert ("requeue", JOB) not in scheduler.calls


def test_the_batch_node_out_of_the_job_is_requeued_and_named(tmp_path: Path, fakes: Any) -> None:
    made, scheduler, timeline = sentinel(tmp_path, fakes, batch_state="down", in_job=False)
    made.term = True
    assert made.watch() == 0
    assert ("requeue", JOB) in scheduler.calls
    node = next(e for e in timeline.events() if e.name == "node")
    assert (node.info["node"], node.info["state"], node.info["batch"]) == ("n1", "down", 1)
    assert [e.name for e in timeline.events()] == ["node", "requeued"]


def test_a_silent_supervisor_on_a_node_not_responding(tmp_path: Path, fakes: Any) -> None:
    """A crash: no heartbeat for longer than the bound, and SLURM no longer hears the node."""
    made, scheduler, _ = sentinel(tmp_path, fakes, batch_state="mix*")
    (tmp_path / "beat").touch()
    old = time.time() - 60
    os.utime(tmp_path / "beat", (old, old))
    assert made.watch() == 0
    assert ("requeue", JOB) in scheduler.calls


def test_a_slow_supervisor_on_a_healthy_node_is_left_alone(tmp_path: Path, fakes: Any) -> None:
    made, scheduler, _ = sentinel(tmp_path, fakes)
    (tmp_path / "beat").touch()
    old = time.time() - 60
    os.utime(tmp_path / "beat", (old, old))
    threading.Timer(1.5, (tmp_path / "stop").touch).start()
    assert made.watch() == 0
    assert ("requeue", JOB) not in scheduler.calls


def test_sigterm_reaches_the_watch(tmp_path: Path, fakes: Any) -> None:
    made, scheduler, _ = sentinel(tmp_path, fakes, batch_state="down", in_job=False)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR2)).start()  # a warning: ignored
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert made.watch() == 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert ("requeue", JOB) in scheduler.calls


def test_the_sentinel_is_launched_as_the_scheduler_says_on_another_node(
    tmp_path: Path, fakes: Any
) -> None:
    """The supervisor of a job of several nodes asks its scheduler how to launch the sentinel
    (SLURM: srun; the fake: ``true``), on a node other than its own, and says where."""
    sup, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2,n3")
    assert sup.run(step(tmp_path, "0")) == 0
    assert ("helper_command", JOB, "n3", SENTINEL_NAME) in scheduler.calls
    assert "sentinel on n3: requeues the job should this node (n1) be lost" in log(sup)


def test_the_next_allocation_names_it_and_counts_no_failure(tmp_path: Path, fakes: Any) -> None:
    first = JobTimeline(env={**ENV, "SLURMCLOCK_DIR": str(tmp_path / "timelines")})
    first.mark("start")
    first.mark("node", node="n1", state="down", reason="psu", kind="gone", batch=1, sentinel="n2")
    first.mark("requeued", confirmed=1)
    line = batch_node_lost(first.events())
    assert line == (
        "run 0 lost its batch node 'n1' ('down' in SLURM, reason 'psu'): requeued by the "
        "sentinel on 'n2'; not counted as a failure"
    )
    sup, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2", restart=1)
    scheduler.jobs[JOB] = replace(scheduler.jobs[JOB], restarts=1)
    assert sup.run(step(tmp_path, "0")) == 0
    assert line in log(sup) and "counted as a failure" not in log(sup).replace(line, "")
    assert "failed" not in [e.name for e in sup.timeline.events()]
