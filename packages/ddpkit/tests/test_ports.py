"""Issue 24: the port derived from the job id is taken (another SLURM on the host also has a job 1,
a job whose id maps to the same port, any program). Rank 0 moves on to the next fallback port and
says so in one line; the other ranks find it there without being told (real processes)."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ddpkit import fallback_ports, master_port_for_job

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("_watchdog_child.py")
CHECK = [sys.executable, "-m", "ddpkit", "check", "--json", "--timeout", "60"]


def job_cmds(launch: Any, out: Path, argv: list[str], **extra: str) -> list[Any]:
    return [(argv, env) for _, env in launch.srun_cmds(2, "-", out, extra=extra)]


def run_check(launch: Any, cmds: list[Any]) -> tuple[list[dict[str, Any]], list[str]]:
    with launch.processes(cmds) as procs:
        outs = launch.wait_all(procs, timeout=240)
        assert [p.returncode for p in procs] == [0, 0], outs
    lines = [json.loads(x) for out in outs for x in out.splitlines() if x.startswith("{")]
    return sorted(lines, key=lambda d: d["rank"]), outs


def test_a_taken_derived_port_moves_rank_zero_and_the_others_follow(
    launch: Any, outdir: Path
) -> None:
    """Something that is not a store listens on the derived port (the others' look at it never
    gets an answer: it is abandoned and they move on)."""
    cmds = job_cmds(launch, outdir, CHECK)
    job = cmds[0][1]["SLURM_JOB_ID"]
    derived = master_port_for_job(job, 0)
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", derived))
        squatter.listen()
        lines, outs = run_check(launch, cmds)
    moved = f"localhost:{fallback_ports(derived)[1]}"
    assert [(d["rank"], d["sum"], d["ok"], d["master"]) for d in lines] == [
        (0, 3, True, moved),
        (1, 3, True, moved),
    ]
    said = [x for x in outs[0].splitlines() if x.startswith("ddpkit: port ")]
    assert said == [
        f"ddpkit: port {derived} (first host of SLURM_STEP_NODELIST, port from job id {job} step "
        f"0) is in use on {socket.gethostname()}; rank 0 listens on {fallback_ports(derived)[1]} "
        "instead and the other ranks find it there (export MASTER_PORT=<a free port> to choose one)"
    ]


def test_two_clusters_with_the_same_job_id(launch: Any, outdir: Path, tmp_path: Path) -> None:
    """Job J of cluster A holds the derived port; job J of cluster B (same id, same step, same
    size) must not join A's store: it takes the fallback port, and A goes on undisturbed."""
    first = job_cmds(
        launch, outdir, [sys.executable, str(CHILD), str(outdir)], SLURM_CLUSTER_NAME="alpha"
    )
    job = first[0][1]["SLURM_JOB_ID"]
    second_out = tmp_path / "second"
    second_out.mkdir()
    second = job_cmds(launch, second_out, CHECK, SLURM_CLUSTER_NAME="beta")
    for _, env in second:
        env.update(SLURM_JOB_ID=job, SLURM_JOBID=job)
    with launch.processes(first) as running:
        deadline = time.monotonic() + 180
        while not all((outdir / f"ready{r}").exists() for r in range(2)):
            assert all(p.poll() is None for p in running) and time.monotonic() < deadline
            time.sleep(0.05)
        lines, _ = run_check(launch, second)
        (outdir / "finish").touch()
        outs = launch.wait_all(running, timeout=120)
        assert [p.returncode for p in running] == [0, 0], outs
    derived = master_port_for_job(job, 0)
    assert (outdir / "ready0").read_text().split()[1] == str(derived)  # A kept its port
    assert {d["master"] for d in lines} == {f"localhost:{fallback_ports(derived)[1]}"}
    assert [d["sum"] for d in lines] == [3, 3]  # B's two ranks, not a mix of A's and B's
