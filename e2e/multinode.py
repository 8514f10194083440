"""The driver of the two-node scenario (test_slurm_multinode.py asserts): the shipped sbatch
script with ``--distributed`` on two nodes of a local multi-node SLURM (tools/localslurm.py's
MultiNodeCluster: the controller and each node in network namespaces of their own), one rank per
node over gloo, stopped by the time limit and requeued until done; beside it, the same flags on
two nodes with no limit in reach: the straight run it must equal bitwise.

Once an allocation trains, its two trainers run a tenth of the time, stopped and continued
together (SIGSTOP/SIGCONT: slow machines in step), so that a few hundred steps outlast a
one-minute allocation: several allocations for seconds of CPU, not the minutes of both cores
that CI's other scenarios need."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from e2e_helpers import FINAL_STATES, Calibration, Job, runs, trainer_flags

TIME_LIMIT_MIN = 1  # SLURM's minimum: an allocation trains for less than a minute
DUTY = 0.1  # of the time the limited job's trainers run
TWO_NODES = ["--nodes=2", "--ntasks-per-node=1"]
TRAINER = "pyrecover-train"


def steps_for(quiet: Calibration) -> int:
    """Steps that cannot fit in one allocation: their CPU time over DUTY (a lower bound of a
    slowed rank's wall time) is 1.5 allocations, so the job is stopped by the limit and requeued
    at least once, more often on a busy machine."""
    return max(200, int(round(1.5 * TIME_LIMIT_MIN * 60 * DUTY / quiet.step_s, -2)))


def drive_two_nodes(
    cluster: Any, work: Path, corpus: Path, cache: Path, quiet: Calibration
) -> dict[str, Any]:
    steps = steps_for(quiet)
    flags = ["--distributed", *trainer_flags(corpus, cache, Path("ckpt"), steps, 100)]
    flags += ["--log-every", "10"]
    # No MASTER_ADDR: ddpkit takes the first node of the step's node list, which resolves.
    straight, limited = Job(cluster, work, "two-nodes-straight"), Job(cluster, work, "two-nodes")
    t0 = time.monotonic()
    reference = straight.submit(["--time=60", *TWO_NODES], flags)
    record = limited.submit([f"--time={TIME_LIMIT_MIN}", *TWO_NODES], flags)
    placement = slow_down(cluster, limited)
    return {
        "steps": steps,
        "job": limited.finish(record, timeout=120),
        "wall": time.monotonic() - t0,
        "straight": straight.finish(reference, timeout=2400),
        "placement": placement,
        "metrics": limited.metrics,
        "straight_metrics": straight.metrics,
        "ckpt": (limited.ckpt, limited.name),
        "straight_ckpt": (straight.ckpt, straight.name),
    }


def slow_down(cluster: Any, job: Job, timeout: float = 2400) -> list[dict[str, int]]:
    """Until the job is over: once an allocation's trainer logged a step, records how many
    trainers run on each node, seen from outside (a process's node is its network namespace),
    and keeps them running DUTY of the time."""
    seen: list[dict[str, int]] = []
    throttle = Throttle(DUTY)
    end = time.monotonic() + timeout
    try:
        while job.state().get("JobState") not in FINAL_STATES and time.monotonic() < end:
            allocations = runs(job.metrics)
            if len(allocations) > len(seen) and any(e["event"] == "step" for e in allocations[-1]):
                found = {node: _trainers(cluster, node, job.name) for node in cluster.nodes}
                seen.append({node: len(pids) for node, pids in found.items()})
                throttle.hold({pid for pids in found.values() for pid in pids})
            time.sleep(0.3)
    finally:
        throttle.release()
    return seen


class Throttle:
    """Keeps a group of processes running ``duty`` of the time, stopped and continued together
    (ranks slowed apart would wait for each other's pauses in every collective)."""

    def __init__(self, duty: float) -> None:
        self.duty, self.pids = duty, set[int]()
        self._lock, self._done = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def hold(self, pids: set[int]) -> None:
        with self._lock:  # those of the earlier allocation are gone
            for pid in self.pids - pids:  # let go of now: never left stopped
                _send(pid, signal.SIGCONT)
            self.pids = pids

    def _signal(self, sig: int) -> None:
        with self._lock:  # a pid that is gone is dropped: it may soon be another process's
            self.pids = {pid for pid in self.pids if _send(pid, sig)}

    def _run(self) -> None:
        while not self._done.is_set():
            self._signal(signal.SIGSTOP)
            time.sleep(0.1 * (1 - self.duty))
            self._signal(signal.SIGCONT)
            time.sleep(0.1 * self.duty)

    def release(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self._signal(signal.SIGCONT)


def _send(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _trainers(cluster: Any, node: str, exp: str) -> list[int]:
    """The trainer processes of experiment ``exp`` on ``node`` (not srun, nor the supervisor,
    whose command lines name the trainer too: a trainer's script is its argv[1])."""
    found = []
    for pid, cmd in cluster.processes(node).items():
        argv = cmd.split()
        mine = f" --experiment_name {exp} " in f" {cmd} "
        if len(argv) > 1 and argv[1].endswith(f"/{TRAINER}") and mine:
            found.append(pid)
    return found
