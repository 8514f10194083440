"""Node states SLURM or an administrator sets mid-run, on a real multi-node SLURM (issue 34 items
3 and 8): a table of faults x moments. One three-node cluster for the module
(tools/localslurm.py's MultiNodeCluster, ``SlurmdTimeout`` 10 s so that a killed node is DOWN in
seconds, not minutes), healed between cases. Each case submits ``slurmclock supervise -- srun``
over a stand-in trainer (nodes_trainer.py: a hashed state stepped, checkpointed and resumed; no
torch) with ``--no-kill``, hits a node once training is under way, and asserts what an operator
checks: the change named in one quoted line of the job log, training going on (in the allocation
or requeued) to its last step within the job's time limit, nothing lost (the final state equals a
straight run's, bitwise), and no resize script left in the submit directory.

Rows: ``down`` (``scontrol update state=down``: SLURM takes the node out of a ``--no-kill`` job
and kills the step whole), ``drain`` (the node finishes the allocation), ``fail`` (FAILING: the
step goes on), ``spare`` (the hot spare set DOWN: named, no longer counted), ``batch_down`` and
``batch_killed`` (the batch node, where the supervisor runs, set DOWN or killed for good: the
sentinel on another node requeues the job), ``reboot`` (a training node's processes killed and
its slurmd back :data:`REBOOT_S` later, inside SlurmdTimeout: SLURM never marks it down and
still counts the step as running, srun waits for the lost tasks until the time limit unless
the supervisor, seeing the daemon's new start time, ends the step and launches it again)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from nodes_trainer import straight  # noqa: E402  - the value a run without faults ends with

ROOT = Path(__file__).resolve().parents[1]
TRAINER = Path(__file__).with_name("nodes_trainer.py")
STEPS, EVERY, STEP_S = 120, 10, 0.1  # ~12 s of training
FAULT_AT = 25  # the step after which the node is hit: a checkpoint stands
REBOOT_S = 3.0  # a reboot: the node's processes gone, its slurmd back this much later
# SlurmdTimeout 10 s: a killed node is DOWN in seconds. CHAOS_SLURMD_TIMEOUT=300 measures the
# cases at SLURM's default (minutes: not for CI).
SLURMD_TIMEOUT = int(os.environ.get("CHAOS_SLURMD_TIMEOUT", "10"))
LIMIT_MIN = 4 if SLURMD_TIMEOUT <= 30 else 4 + 3 * SLURMD_TIMEOUT // 60  # the job's time limit

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]


def _localslurm() -> ModuleType:
    spec = importlib.util.spec_from_file_location("localslurm", ROOT / "tools" / "localslurm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


localslurm = _localslurm()


@dataclass(frozen=True)
class Case:
    """``fault`` on ``target`` (``second``: a training node that is not the batch node,
    ``spare``: the hot spare, ``batch``: the batch node); the job asks for ``nodes`` with
    ``spare`` hot spares; ``said``: the job log line that names it (a regex);
    ``requeued``: the job comes back in a new allocation."""

    name: str
    fault: str
    target: str
    said: str
    nodes: int = 2
    spare: int = 0
    requeued: bool = False


CASES = [
    Case("down", "down", "second", r"node (\S+) is 'down' in SLURM, reason 'chaos down'; SLURM "
         r"took it out of the job: the next launch leaves it out", nodes=3),
    Case("drain", "drain", "second", r"node (\S+) is '(drng|drain)' in SLURM, reason 'chaos "
         r"drain': it finishes this allocation"),
    Case("fail", "fail", "second", r"node (\S+) is '(fail|failg)' in SLURM, reason 'chaos fail'"),
    Case("spare", "down", "spare", r"hot spare (\S+) is 'down' in SLURM, reason 'chaos down'; "
         r"SLURM took it out of the job: no longer counted as a spare", nodes=3, spare=1),
    Case("batch_down", "down", "batch", r"run 0 lost its batch node '(\S+)' \('down' in SLURM, "
         r"reason 'chaos down'\): requeued by the sentinel on '\S+'; not counted as a failure",
         requeued=True),
    Case("batch_killed", "kill", "batch", r"run 0 lost its batch node '(\S+)' \('[a-z]+\*' in "
         r"SLURM(, reason '[^']*')?\): requeued by the sentinel on '\S+'; not counted as a "
         r"failure", requeued=True),  # 'down*', or 'mix*' (not responding) at SlurmdTimeout 300
    Case("reboot", "reboot", "second", r"node (\S+) restarted \(its daemon started '[^']+'\): "
         r"what ran there is gone; the step is ended and launched again"),
]  # fmt: skip
# When the node is hit: mid-interval (FAULT_AT: the steps since the checkpoint at 20 are lost
# and done again), or right after a checkpoint became durable (step 30: nothing to do again).
MOMENTS = {"training": lambda folder: steps_done(folder) >= FAULT_AT,
           "after_checkpoint": lambda folder: saved_step(folder) >= 3 * EVERY}  # fmt: skip
ROWS = [(c, "training") for c in CASES] + [(CASES[0], "after_checkpoint")]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    why = localslurm.multinode_unavailable_reason()
    if why is not None:
        pytest.skip(why)
    # ReturnToService=1 (SLURM's default): a node an administrator set DOWN stays DOWN until
    # resumed (localslurm's 2 brings it back at its next registration, within a second).
    conf = {"SlurmdTimeout": str(SLURMD_TIMEOUT), "ReturnToService": "1"}
    with localslurm.MultiNodeCluster(nodes=3, cpus=2, extra_conf=conf) as c:
        yield c


@pytest.fixture
def healthy(cluster: Any) -> Iterator[Any]:
    """The module's cluster, healed after each case: jobs cancelled, a killed node's slurmd
    started again, every node resumed and idle."""
    yield cluster
    if jobs := list(cluster.jobs()):
        cluster.run(["scancel", *jobs], check=False)
    for node in cluster.net.revive():
        cluster.start_node(node, timeout=20 * SLURMD_TIMEOUT)
    for node in cluster.nodes:
        cluster.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
    for node in cluster.nodes:
        cluster.wait_node(node, {"idle"}, timeout=20 * SLURMD_TIMEOUT)


def script(case: Case, folder: Path) -> str:
    bin_dir = Path(sys.executable).parent
    spare = f"--spare-nodes {case.spare} " if case.spare else ""
    return (
        "#!/bin/bash\n"
        f"exec {bin_dir / 'slurmclock'} supervise --min-nodes 1 {spare}-- srun "
        f"{sys.executable} {TRAINER} {folder} {STEPS} {EVERY} {STEP_S}\n"
    )


def steps_done(folder: Path) -> int:
    try:
        lines = (folder / "steps-0.log").read_text().split()
    except OSError:
        return 0
    return int(lines[-1]) if lines else 0


def saved_step(folder: Path) -> int:
    try:
        return int(json.loads((folder / "ckpt.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def wait(what: str, ready: Any, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < end, f"{what}: not after {timeout:.0f} s"
        time.sleep(0.1)


def target(cluster: Any, case: Case, job: str) -> str:
    """The node the case hits, from SLURM's record of the job."""
    info = cluster.job(job)
    batch = info["BatchHost"]
    nodes = cluster.run(["scontrol", "show", "hostnames", info["NodeList"]]).stdout.split()
    if case.target == "batch":
        return str(batch)
    if case.target == "spare":
        return nodes[-1]  # the supervisor keeps the last node(s) as spares
    return next(n for n in nodes if n != batch)


def hit(cluster: Any, case: Case, node: str) -> None:
    if case.fault == "kill":
        cluster.kill_node(node)
        return
    if case.fault == "reboot":  # down for a few seconds, then back: a machine that reboots
        cluster.kill_node(node)
        time.sleep(REBOOT_S)
        cluster.start_node(node, timeout=20 * SLURMD_TIMEOUT)
        return
    state = {"down": "down", "drain": "drain", "fail": "fail"}[case.fault]
    cluster.run(["scontrol", "update", f"nodename={node}", f"state={state}",
                 f"reason=chaos {case.fault}"])  # fmt: skip


def messages(log: str) -> list[str]:
    return re.findall(r"^\[[0-9-]+ [0-9:]+\] slurmclock: (.*)$", log, flags=re.MULTILINE)


@pytest.mark.parametrize(("case", "moment"), ROWS, ids=[f"{c.name}-{m}" for c, m in ROWS])
def test_node_state(case: Case, moment: str, healthy: Any, tmp_path: Path) -> None:
    cluster = healthy
    folder, submit = tmp_path / "run", tmp_path / "repo"
    folder.mkdir()
    submit.mkdir()
    env = {"SLURMCLOCK_DIR": str(tmp_path / "timelines")}
    args = [f"--nodes={case.nodes}", "--ntasks-per-node=1", "--no-kill", f"--time={LIMIT_MIN}",
            "--open-mode=append", f"--output={tmp_path / 'job.log'}"]  # fmt: skip
    started = time.monotonic()
    job = cluster.sbatch(script(case, folder), *args, env=env, cwd=submit)
    wait(f"the moment {moment}", lambda: MOMENTS[moment](folder), 120)
    node = target(cluster, case, job)
    hit(cluster, case, node)
    hit_at, hit_epoch = time.monotonic(), time.time()
    info = cluster.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"},
                            timeout=LIMIT_MIN * 60 + 60)  # fmt: skip
    took = time.monotonic() - started
    log = (tmp_path / "job.log").read_text()
    said = messages(log)
    assert info["JobState"] == "COMPLETED", f"{info['JobState']}\n{log}"
    assert took < LIMIT_MIN * 60, f"{took:.0f} s: past the limit\n{log}"  # the deadline held
    named = [m for m in said if (hit_ := re.match(case.said, m)) and hit_.group(1) == node]
    assert len(named) == 1, f"{node} not named once as {case.said!r}\n{log}"
    assert "gave up" not in log, log
    assert int(info["Restarts"]) == (1 if case.requeued else 0), log
    final = json.loads((folder / "ckpt.json").read_text())
    assert final == {"step": STEPS, "state": straight(STEPS)}, final  # nothing lost, bitwise
    assert not list(submit.glob("slurm_job_*_resize.*")), "resize scripts in the submit dir"
    trained_on = set((folder / "steps-0.log").read_text().split()[::2])
    if case.fault in ("down", "kill") and case.target != "spare":
        last_run = (folder / "steps-0.log").read_text().split()[-2]
        assert last_run != node, f"trained on {node} after it was lost\n{log}"
    timelines = [  # the job's timelines: not the fault record, not the chain's list of jobs
        p
        for p in (tmp_path / "timelines").glob("*.jsonl")
        if "faults" not in p.name and not p.name.endswith(".chain.jsonl")
    ]
    marks = [json.loads(line) for p in timelines for line in p.read_text().splitlines()]
    requeued = [m for m in marks if m["event"] == "requeued" and m["time"] > hit_epoch]
    if case.requeued:  # by the sentinel: when, and what made it act
        sentinel = next(m for m in marks if m["event"] == "node" and m.get("batch") == 1)
        figures = f"requeued {requeued[0]['time'] - hit_epoch:.0f} s after ({sentinel['why']}), "
    else:
        figures = ""
    done = time.monotonic() - hit_at
    print(f"\n{case.name}/{moment}: job {job} {took:.0f} s, named {named[0]!r}, {figures}"
          f"done {done:.0f} s after the hit; rank 0 on {trained_on}")  # fmt: skip
