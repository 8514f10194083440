"""ddpkit's fault record, read by slurmclock's supervisor (DESIGN.md, "Contracts").

ddpkit wrote ``time`` as ISO-8601 text and the supervisor did ``float(time)``: every line was
dropped, the dead node was named nowhere and never excluded. Each package's tests used its own
format. Here ddpkit's writer writes and slurmclock's reader reads -- the record alone, and the
real watchdog under the real supervisor."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import ddpkit
import slurmclock
from ddpkit.faults import FAULT_RECORD_KEYS, Fault, append
from slurmclock.supervisor import Supervisor
from slurmclock.supervisor.faults import FAULT_FILE_ENV, read_faults


@pytest.mark.parametrize(
    "fault",
    [
        Fault(rank=1, host="node13", what="dead", reporter=0, silent_s=1.04, job_id="4242"),
        Fault(rank=3, host="node2", what="frozen", reporter=2, silent_s=20.5),
        Fault(rank=None, host="node1", what="dead", reporter=1),  # the store's host, no rank
    ],
)
def test_what_ddpkit_writes_the_supervisor_reads(fault: Fault, tmp_path: Path) -> None:
    path = tmp_path / "faults.jsonl"
    assert append(str(path), fault) is None
    (line,) = path.read_text().splitlines()
    assert list(json.loads(line)) == list(FAULT_RECORD_KEYS)
    (read,) = read_faults(path, since=time.time() - 60)
    assert (read.rank, read.host, read.what, read.reporter) == (
        fault.rank,
        fault.host,
        fault.what,
        fault.reporter,
    )
    assert read.time == pytest.approx(fault.time, abs=1e-3)
    assert read.silent_s == pytest.approx(round(fault.silent_s, 1))
    assert read.job_id == fault.job_id
    who = "a rank" if fault.rank is None else f"rank {fault.rank}"
    assert (
        read.describe()
        == f"{who} on node {fault.host} was {fault.what} (reported by rank {fault.reporter})"
    )
    # A record of another run of the job (written before this one started) is not this run's.
    assert read_faults(path, since=time.time() + 60) == []


def test_the_variable_is_the_same_name_on_both_sides(job: Any) -> None:
    """The supervisor sets DDPKIT_FAULT_FILE for the step; ddpkit reads that variable."""
    sup = Supervisor(env=job.env)
    assert ddpkit.faults.FAULT_FILE_ENV == FAULT_FILE_ENV == "DDPKIT_FAULT_FILE"
    assert sup.fault_file == job.dir / "ci-4242.0-1.faults.jsonl"  # restart 0, launch 1


RANK = """
import os, signal, sys, time
from pathlib import Path
import ddpkit

out = Path(sys.argv[1])
with ddpkit.init(timeout=30) as dist:
    (out / f"ready{dist.rank}").write_text(str(os.getpid()))
    step = 0
    while not dist.any_rank(step >= 3000):
        if dist.rank == 1 and step == 20:
            os.kill(os.getpid(), signal.SIGKILL)  # a rank that dies (OOM killer, segfault)
        step += 1
        time.sleep(0.05)
"""

LAUNCH = """
import os, socket, subprocess, sys

# Two ranks as torchrun starts them; the step ends with rank 0's status (srun's
# --kill-on-bad-exit ends the others). The port: a free one, as torchrun's --standalone picks.
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
ranks = [
    subprocess.Popen(
        [sys.executable, sys.argv[1], sys.argv[2]],
        env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
             "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
    )
    for r in range(2)
]
codes = [p.wait() for p in ranks]
sys.exit(codes[0])
"""


@pytest.mark.slow
def test_a_dead_rank_is_named_by_the_supervisor_at_once(job: Any, tmp_path: Path) -> None:
    """The real watchdog (ddpkit, two gloo ranks) and the real `slurmclock supervise`: rank 1
    is SIGKILLed; rank 0 records it and exits 69; the supervisor names the node in the job log
    and the timeline (`fault`) while the step still runs, and again in `failed`. The node is the
    supervisor's own: a rank died, not the node, so it is not excluded. (Requeued here:
    `--no-restart-here`; a restart in the allocation is slurmclock's test_restart.py.)"""
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "launch.py").write_text(LAUNCH)
    step = [sys.executable, str(tmp_path / "launch.py"), str(tmp_path / "rank.py"), str(tmp_path)]
    supervise = [sys.executable, "-m", "slurmclock", "supervise", "--no-restart-here", "--", *step]
    out = subprocess.run(
        supervise, env=job.env, capture_output=True, text=True, timeout=400, check=False
    )
    log = out.stdout + out.stderr
    host = socket.gethostname()
    assert slurmclock.EXIT_PEER_LOST == ddpkit.EXIT_PEER_LOST
    named = f"rank 1 on node {host} was dead (reported by rank 0): the step cannot go on"
    assert out.stdout.index(named) < out.stdout.index("training step exited with status 69"), log
    assert out.returncode == 0, log  # requeued: the batch script ends, SLURM starts it again
    events = [json.loads(line) for line in job.timeline.read_text().splitlines()]
    (fault,) = [e for e in events if e["event"] == "fault"]
    assert (fault["node"], fault["rank"], fault["what"], fault["reporter"]) == (host, 1, "dead", 0)
    failed = [e for e in events if e["event"] == "failed"]
    assert len(failed) == 1 and failed[0]["nodes"] == host and failed[0]["rc"] == 69, events
    assert "scontrol requeue 4242" in job.calls, job.calls
    assert not any("ExcNodeList" in call for call in job.calls), job.calls
