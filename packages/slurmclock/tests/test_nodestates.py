"""The job's nodes as SLURM shows them now (supervisor/nodestates.py): what changed is named once,
in quotes, and a relaunch reads the job's node list from SLURM, never the one it started with."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from slurmclock import Node
from slurmclock.slurm import node_condition
from slurmclock.supervisor.nodestates import changes, no_resize_scripts

sys.path.insert(0, str(Path(__file__).parent))
from test_restart import JOB, events, log, make, placed, step  # noqa: E402  - its fake job


def states(*nodes: Node) -> dict[str, Node]:
    """Nodes as SLURM's scheduler gives them: each printed state sorted (``condition``)."""
    return {n.name: replace(n, condition=node_condition(n.state)) for n in nodes}


def test_a_node_out_of_the_job_is_gone_whatever_its_state() -> None:
    found = changes(["n1", "n2"], ["n1"], states(Node("n2", "idle", True)))
    assert [(c.node, c.kind, c.state, c.in_job) for c in found] == [("n2", "gone", "idle", False)]


def test_states_sorted_into_gone_and_drained() -> None:
    listed = states(
        Node("n1", "mix", True),
        Node("n2", "drng", True, "fan"),
        Node("n3", "fail", False, "bad dimm"),
        Node("n4", "drain*", False),
        Node("n5", "down*", False),
        Node("n6", "alloc", True),
        Node("n7", "mix@", True),  # a reboot asked for once the node is idle: no change yet
        Node("n8", "boot", False),  # rebooting
        Node("n9", "drng@", True, "Reboot ASAP"),  # `scontrol reboot ASAP`: drains first
    )
    hosts = [f"n{i}" for i in range(1, 10)]
    kinds = {c.node: c.kind for c in changes(hosts, hosts, listed)}
    assert kinds == {
        "n2": "drained",
        "n3": "gone",
        "n4": "drained",
        "n5": "gone",
        "n8": "gone",
        "n9": "drained",
    }


def test_the_line_quotes_what_an_administrator_wrote() -> None:
    found = changes(["n1", "n2"], ["n1"], states(Node("n2", "down", False, "x\n[fake] ok")))
    line = found[0].line()
    assert "\n" not in line and "'x\\n[fake] ok'" in line
    long = changes(["n1", "n2"], ["n1"], states(Node("n2", "down", False, "a" * 500)))[0].line()
    assert "'" + "a" * 120 + "...'" in long  # cut: the rest of the line still reads


def test_scontrol_runs_without_slurm_jobid_so_it_writes_no_resize_scripts() -> None:
    runner = no_resize_scripts({"SLURM_JOBID": "7", "SLURM_JOB_ID": "7", "PATH": "/bin"})
    assert runner.env == {"SLURM_JOB_ID": "7", "PATH": "/bin"}  # type: ignore[attr-defined]


def down(scheduler: Any, node: str, reason: str, state: str = "down") -> None:
    """``scontrol update nodename=NODE state=down``: SLURM takes it out of a --no-kill job."""
    view = scheduler.jobs[JOB]
    left = [n for n in view.nodes.split(",") if n != node]
    scheduler.jobs[JOB] = replace(view, nodes=",".join(left), num_nodes=len(left))
    scheduler.partitions["p"] = [
        Node(n.name, state, False, reason) if n.name == node else n
        for n in scheduler.partitions["p"]
    ]


def test_a_node_set_down_mid_run_is_named_and_the_step_goes_on_without_it(
    tmp_path: Path, fakes: Any
) -> None:
    """SLURM kills the whole step (srun: exit 137) before any rank reports: no fault record.
    The relaunch reads the job's nodes from SLURM and leaves the DOWN node out."""
    sup, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2")
    down(scheduler, "n2", "disk 'gone'")
    assert sup.run(step(tmp_path, "137", "0", srun=True)) == 0
    out = log(sup)
    assert (
        "node n2 is 'down' in SLURM, reason 'disk \\'gone\\''; SLURM took it out of the job: the "
        "next launch leaves it out" in out
    ), out
    assert placed(tmp_path)[-1] == ["--nodes=1", "--nodelist=n1", "--ntasks=1", "--overlap"]
    node = next(e for e in sup.timeline.events() if e.name == "node")
    assert (node.info["node"], node.info["state"], node.info["kind"]) == ("n2", "down", "gone")
    assert out.count("node n2 is 'down'") == 1 and "gave up" not in out
    assert events(sup).count("relaunched") == 1


def test_a_spare_set_down_is_named_and_no_longer_counted(tmp_path: Path, fakes: Any) -> None:
    sup, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2,n3", spare_nodes=1)
    down(scheduler, "n3", "maintenance")
    down(scheduler, "n2", "psu")
    assert sup.run(step(tmp_path, "137", "0", srun=True)) == 0
    out = log(sup)
    assert "hot spare n3 is 'down' in SLURM, reason 'maintenance'" in out, out
    assert "no longer counted as a spare" in out
    assert placed(tmp_path)[-1] == ["--nodes=1", "--nodelist=n1", "--ntasks=1", "--overlap"]


def test_a_drained_node_finishes_the_allocation(tmp_path: Path, fakes: Any) -> None:
    sup, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2")
    scheduler.partitions["p"][1] = Node("n2", "drng", True, "fan")
    assert sup.run(step(tmp_path, "1", "0", srun=True)) == 0
    out = log(sup)
    assert "node n2 is 'drng' in SLURM, reason 'fan': it finishes this allocation" in out, out
    assert placed(tmp_path)[-1] == ["--nodes=2", "--nodelist=n1,n2", "--ntasks=2", "--overlap"]


def test_slurm_sorts_its_node_states_the_supervisor_reads_only_the_condition() -> None:
    """SLURM's printed states are sorted in slurm.py (Node.condition); nodestates never reads
    them, so a second scheduler sets the condition and the supervisor follows unchanged."""
    from slurmclock import Slurm

    printed = "n1 mix none\nn2 drng@ Reboot ASAP\nn3 down* cable\nn4 idle* none\nn5 boot none\n"
    nodes = Slurm(lambda argv, timeout: printed).nodes("p")
    assert [(n.name, n.condition) for n in nodes] == [
        ("n1", ""),
        ("n2", "drained"),
        ("n3", "gone"),
        ("n4", ""),
        ("n5", "gone"),
    ]
    # a state no scheduler prints, with the condition set: the supervisor goes by the condition
    odd = {"n2": Node("n2", "quarantined", False, "", "gone")}
    assert [(c.node, c.kind, c.state) for c in changes(["n1", "n2"], ["n1", "n2"], odd)] == [
        ("n2", "gone", "quarantined")
    ]


def test_a_node_whose_daemon_started_again_is_named_once_and_stays_in_service(
    tmp_path: Path, fakes: Any
) -> None:
    """A reboot shorter than SlurmdTimeout: the node is in service, but the step's tasks there
    are gone. Named once per restart, never counted as gone (the next launch uses it)."""
    from slurmclock.supervisor.nodestates import NodeStates

    _, scheduler, _ = make(tmp_path, fakes, nodes="n1,n2")
    scheduler.booted = {"n1": "2026-01-01T00:00:00 2026-01-01T00:01:00", "n2": "t0 t0"}
    said: list[str] = []
    marks: list[dict[str, Any]] = []
    states_ = NodeStates(scheduler, JOB, 5.0, said.append, lambda _e, **kw: marks.append(kw))
    assert states_.look(["n1", "n2"]) == []  # the first read: what is normal
    scheduler.booted["n2"] = "t0 t1\n\x1b[31m"  # a value SLURM prints is quoted in the line
    found = states_.look(["n1", "n2"])
    assert [(c.node, c.kind) for c in found] == [("n2", "restarted")]
    assert said == [
        "node n2 restarted (its daemon started 't0 t1\\n\\x1b[31m'): what ran there is gone; "
        "the step is ended and launched again"
    ], said
    assert marks[0]["kind"] == "restarted" and marks[0]["node"] == "n2"
    assert states_.look(["n1", "n2"]) == [] and states_.gone == set()  # once, still in service
    scheduler.booted["n2"] = "t0 t2"  # a second restart is a second line
    assert [c.since for c in states_.look(["n1", "n2"])] == ["t0 t2"]


def test_slurm_reads_when_each_node_daemon_started() -> None:
    from slurmclock import Slurm

    printed = (
        "NodeName=n1 Arch=x86_64 BootTime=2026-11-28T10:00:00 SlurmdStartTime=2026-11-28T10:01:02 "
        "State=MIXED\nNodeName=n2 BootTime=None SlurmdStartTime=None State=DOWN*\ngarbage\n"
    )
    seen: list[list[str]] = []
    slurm = Slurm(lambda argv, timeout: seen.append(list(argv)) or printed)
    assert slurm.node_starts(["n1", "n2"]) == {"n1": "2026-11-28T10:00:00 2026-11-28T10:01:02"}
    assert seen == [["scontrol", "show", "node", "-o", "n1,n2"]]
    assert slurm.node_starts([]) == {}
