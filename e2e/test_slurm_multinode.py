"""Scenario 10: two real nodes. On a local multi-node SLURM (controller and three nodes, each in
network namespaces of its own: tools/localslurm.py's MultiNodeCluster), the shipped sbatch
script with ``--distributed --nodes=2 --ntasks-per-node=1``: one rank per node over gloo, stopped
by the time limit (``--time=1``) and requeued until done; the final weights, optimizer, data
position and RNG states are bitwise those of a straight two-node run of the same flags. Before
it, a quick check that two ranks on two nodes find each other at all (``ddpkit check``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from allocation_use import allocations
from e2e_helpers import Background, job_env, one, runs
from train_helpers import assert_bitwise_equal, final_state

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(3000)]


def test_two_ranks_on_two_nodes_reach_each_other(multinode_cluster: Any) -> None:
    """10a. two nodes: a rank on each finds the other over gloo"""
    out = multinode_cluster.run(
        ["srun", "--nodes=2", "--ntasks-per-node=1", "ddpkit", "check", "--json"],
        env=job_env(),
        timeout=300,
    )
    ranks = sorted((json.loads(line) for line in out.stdout.splitlines()), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1], out.stdout + out.stderr
    hosts = ranks[0]["hosts"]  # each rank's own hostname, gathered: two different nodes
    assert len(hosts) == 2 and set(hosts) <= set(multinode_cluster.nodes), ranks
    for r in ranks:
        assert r["ok"] and r["world_size"] == 2 and r["backend"] == "gloo", r
        assert r["hosts"] == hosts and r["master"].startswith(f"{hosts[0]}:"), r


def test_two_nodes_stop_for_time_requeue_and_equal_a_straight_run(
    long_multinode: Background, figures: dict[str, Any]
) -> None:
    """10b. two nodes (one rank each, gloo): time limit, requeued until done, bitwise"""
    seen = long_multinode.result("two_nodes", timeout=2700)
    job, straight, steps = seen["job"], seen["straight"], seen["steps"]
    assert job.info["JobState"] == "COMPLETED", job.log
    restarts = int(job.info["RestartCnt"])
    figures["steps"] = steps
    figures["allocations"] = restarts + 1
    figures["wall"] = f"{seen['wall']:.0f} s"
    assert restarts >= 1, f"one allocation did it all: {steps} steps were too few\n{job.log}"
    for i in range(restarts + 1):
        assert f"restart {i}, 2 node(s), 2 task(s)" in job.log, job.log
    # Seen from outside (each process's network namespace): one trainer on each of two nodes in
    # the first allocation, never two on one node later (a last one may end before it is seen).
    placements = seen["placement"]
    assert placements and sorted(n for n in placements[0].values() if n) == [1, 1], placements
    assert all(max(p.values()) <= 1 for p in placements), placements

    # Each allocation but the last stopped for time with a durable save (exit 75, requeued) and
    # the next resumed exactly there, with both ranks.
    assert [a.status for a in allocations(job.log)] == [75] * restarts + [0], job.log
    rs = runs(seen["metrics"])  # rank 0 writes the metrics: one run per allocation
    assert len(rs) == restarts + 1, f"{len(rs)} trainer runs\n{job.log}"
    for run, nxt in zip(rs, rs[1:], strict=False):
        start, stop = one(run, "start"), one(run, "stop")
        assert start["world_size"] == 2 and start["deadline_source"] == "squeue", start
        assert stop["cause"] == "time" and stop["exit_code"] == 75, stop
        assert one(nxt, "resume")["step"] == stop["step"], nxt
    last = one(rs[-1], "stop")
    assert last["cause"] == "done" and last["step"] == steps, last
    figures["stopped at"] = " ".join(str(one(r, "stop")["step"]) for r in rs[:-1])

    # The straight run: two nodes, never interrupted.
    assert straight.info["JobState"] == "COMPLETED" and straight.info["RestartCnt"] == "0"
    assert len(runs(seen["straight_metrics"])) == 1, straight.log
    _, want = final_state(*seen["straight_ckpt"])
    manifest, got = final_state(*seen["ckpt"])
    assert manifest.step == steps
    assert_bitwise_equal(want, got)
    figures["bitwise"] = "equal"
