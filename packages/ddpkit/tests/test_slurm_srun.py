"""Inside a real SLURM (tools/localslurm.py: slurmctld + slurmd on 127.0.0.1).

`srun -n 2` gives ranks 0 and 1 that all-reduce correctly; the batch shell of `sbatch -n 2` is
one process (not a launcher), and its srun step is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ddpkit import fallback_ports, master_port_for_job

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]
# The local cluster's node name (n<hex>) resolves nowhere; real clusters' node names do.
MASTER = {"MASTER_ADDR": "127.0.0.1"}


def load_localslurm() -> ModuleType | None:
    path = ROOT / "tools" / "localslurm.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("localslurm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    localslurm = load_localslurm()
    reason = (
        "tools/localslurm.py not found" if localslurm is None else localslurm.unavailable_reason()
    )
    if reason is not None:
        if os.environ.get("PYRECOVER_REQUIRE_SLURM") == "1":
            pytest.fail(f"PYRECOVER_REQUIRE_SLURM=1 but no local SLURM: {reason}")
        pytest.skip(reason)
    assert localslurm is not None
    with localslurm.LocalCluster(tmp_path_factory.mktemp("slurm"), cpus=4) as c:
        for key in list(c.env):  # an enclosing launcher's variables must not leak into the jobs
            if key in (
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "GROUP_RANK",
            ) or key.startswith(("MASTER_", "TORCHELASTIC_", "PYRECOVER_DIST")):
                del c.env[key]
        c.env["OMP_NUM_THREADS"] = "1"
        yield c


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_srun_two_ranks_all_reduce(cluster: Any) -> None:
    argv = [
        "srun",
        "-n",
        "2",
        "--time=2",
        sys.executable,
        "-m",
        "ddpkit",
        "check",
        "--json",
        "--timeout",
        "60",
    ]
    # An explicit free port: another SLURM on this host may have a job with this id (issue 24).
    out = cluster.run(
        argv, env={**MASTER, "MASTER_PORT": str(free_port())}, timeout=180, check=False
    )
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}\n{cluster.logs(10)}"
    lines = sorted(json_lines(out.stdout), key=lambda d: d["rank"])
    assert [d["rank"] for d in lines] == [0, 1]
    for d in lines:
        assert d["launcher"] == "srun" and d["world_size"] == 2 and d["backend"] == "gloo"
        assert d["sum"] == 3 and d["any_rank"] is True and d["ok"] is True
    assert lines[0]["master"] == lines[1]["master"]
    assert lines[0]["local_rank"] == 0 and lines[1]["local_rank"] == 1


def test_srun_from_a_shell_with_stale_torchrun_variables_is_refused(cluster: Any) -> None:
    """srun forwards the shell's environment: a leftover `export RANK=0 WORLD_SIZE=1
    LOCAL_RANK=0` made both tasks say `ok: 1 rank(s) via torchrun` (issue 30)."""
    argv = ["srun", "-n", "2", "--time=2", sys.executable, "-m", "ddpkit", "check"]
    stale = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    out = cluster.run(argv, env={**MASTER, **stale}, timeout=180, check=False)
    assert out.returncode != 0, f"{out.stdout}\n{out.stderr}"
    assert "ok:" not in out.stdout, out.stdout
    lines = sorted(x for x in out.stderr.splitlines() if x.startswith("ddpkit: error:"))
    assert len(lines) == 2, out.stderr
    for rank, line in enumerate(lines):
        assert "RANK=0 WORLD_SIZE=1 (torchrun's variables" in line, line
        assert f"srun's SLURM_PROCID={rank} SLURM_STEP_NUM_TASKS=2" in line, line
        assert "unset RANK WORLD_SIZE LOCAL_RANK" in line, line


def test_batch_shell_is_single_and_its_step_is_srun(cluster: Any, tmp_path: Path) -> None:
    py = sys.executable
    script = f"""#!/bin/bash
#SBATCH -n 2
#SBATCH --time=2
#SBATCH -o {tmp_path}/job.out
export MASTER_ADDR=127.0.0.1
{py} -m ddpkit info --json > {tmp_path}/batch.json
srun -n 2 {py} -m ddpkit check --json --timeout 60 > {tmp_path}/step.json
echo done > {tmp_path}/done
"""
    job = cluster.sbatch(script)
    info = cluster.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=180)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else "(no log)"
    assert info["JobState"] == "COMPLETED", log
    batch = json.loads((tmp_path / "batch.json").read_text())
    # sbatch -n 2 sets SLURM_PROCID=0 and SLURM_NTASKS=2 in the batch shell: still one process.
    assert (batch["launcher"], batch["world_size"], batch["job_id"]) == ("single", 1, job)
    steps = sorted(json_lines((tmp_path / "step.json").read_text()), key=lambda d: d["rank"])
    assert [(d["rank"], d["launcher"], d["sum"], d["ok"]) for d in steps] == [
        (0, "srun", 3, True),
        (1, "srun", 3, True),
    ]
    # MASTER_PORT was not set: derived from the job id and step 0, the same on both ranks (or,
    # when another job holds it -- another local SLURM has a job with this id too -- the first
    # free one of its fallbacks, issue 24).
    assert steps[0]["master"] == steps[1]["master"]
    port = int(steps[0]["master"].split(":")[1])
    assert port in fallback_ports(master_port_for_job(job, 0))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the watchdog under srun, with the shipped thresholds (heartbeat 2 s, frozen after 20 s) -----

CHILD = Path(__file__).with_name("_watchdog_child.py")
TARGET_S = {"KILL": 30.0, "STOP": 60.0}  # issue 21: all ranks gone within these


@pytest.mark.parametrize(
    ("victim", "sig", "kill_on_bad_exit"),
    [(1, "KILL", True), (0, "KILL", True), (1, "STOP", True), (1, "KILL", False)],
)
def test_srun_step_ends_when_a_rank_dies_or_freezes(
    cluster: Any, launch: Any, tmp_path: Path, victim: int, sig: str, kill_on_bad_exit: bool
) -> None:
    """`srun --kill-on-bad-exit=1 -n 2` (as the shipped sbatch script): one task SIGKILLed or
    SIGSTOPped; the watchdog ends the other (exit 69), srun ends the step (the stopped task too).
    Without --kill-on-bad-exit srun waits for every task: the watchdog alone ends the survivor.
    Timed from the signal to srun's own exit, as a job script sees it."""
    out = tmp_path / "out"
    out.mkdir()
    kill = ["--kill-on-bad-exit=1"] if kill_on_bad_exit else []
    argv = ["srun", "-n", "2", *kill, "--time=3", sys.executable, str(CHILD)]
    env = {
        **cluster.env,
        **MASTER,
        "SLURM_CONF": str(cluster.conf_path),
        "DDPKIT_FAULT_FILE": str(out / "faults.jsonl"),
    }
    proc, text, took = launch.signal_a_rank([*argv, str(out)], env, out, 2, victim, sig)
    print(f"srun -n 2 {' '.join(kill)}, SIG{sig} of rank {victim}: srun gone after {took:.1f} s")
    assert proc.returncode != 0, text
    assert took < TARGET_S[sig], text
    what = "dead" if sig == "KILL" else "frozen"
    (fault,) = launch.fault_lines(out)
    assert (fault["rank"], fault["what"], fault["reporter"]) == (victim, what, 1 - victim)
    assert fault["job_id"] and fault["host"]
    assert f"rank {victim} on " in text and f"is {what}" in text, text
