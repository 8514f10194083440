"""An interrupted test run leaves no SLURM daemon, job or temp folder behind (issue 24: stopping
``nox`` left e2e's daemons and their requeuing jobs running; failing sessions left 137-163 MB
folders in /tmp).

A real pytest run, through tools/tempguard.py as nox runs it, starts a local cluster
(tools/localslurm.py) and a job that would run for minutes; then it is stopped the ways a run
ends early: Ctrl-C under nox (SIGINT from the terminal, pressed twice; nox's SIGTERM, then
SIGKILL to tempguard within half a second), SIGTERM to pytest, SIGKILL to pytest. Afterwards no
process of the cluster is left (daemons, slurmstepd, the job's own processes, the reaper) and
the temp folder is gone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("localslurm", ROOT / "tools" / "localslurm.py")
assert _spec is not None and _spec.loader is not None
localslurm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(localslurm)

INNER = """
import importlib.util, json, os, time
spec = importlib.util.spec_from_file_location("localslurm", {tool!r})
localslurm = importlib.util.module_from_spec(spec); spec.loader.exec_module(localslurm)

def test_a_long_job():
    with localslurm.LocalCluster(cpus=2) as cluster:  # in its own temp folder: short paths
        job = cluster.sbatch("#!/bin/bash\\nsleep 600\\n", "--time=10", "--requeue")
        cluster.wait_for(job, {{"RUNNING"}}, timeout=120)
        pids = {{n: p.pid for n, p in cluster._procs.items()}}
        info = {{"conf": str(cluster.conf_path), "pytest": os.getpid(), "daemons": pids}}
        open({ready!r}, "w").write(json.dumps(info))
        time.sleep(600)
"""


def cluster_processes(conf: str, daemons: dict[str, int]) -> list[str]:
    """What still runs of the cluster: its daemons, and any process started with its config
    (slurmstepd, the job) or watching it (the reaper)."""
    workdir = str(Path(conf).parent)
    left = [f"{n} {p}" for n, p in daemons.items() if localslurm._alive(p, n)]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"SLURM_CONF={conf}".encode() in env or (" reap " in cmd and workdir in cmd):
            left.append(f"pid {entry}: {cmd[:100]}")
    return left


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.parametrize("how", ["ctrl-c under nox", "SIGTERM to pytest", "SIGKILL to pytest"])
def test_an_interrupted_run_leaves_no_daemon_job_or_temp_folder(how: str, tmp_path: Path) -> None:
    why = localslurm.unavailable_reason()
    if why is not None:
        if os.environ.get("PYRECOVER_REQUIRE_SLURM") == "1":
            pytest.fail(f"PYRECOVER_REQUIRE_SLURM=1 but {why}")
        pytest.skip(why)
    # Short: the cluster's sockets live under it, and a socket's path has 108 characters.
    parent, ready = Path(tempfile.mkdtemp(prefix="i")), tmp_path / "ready.json"
    try:
        interrupt(how, parent, ready, tmp_path)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def interrupt(how: str, parent: Path, ready: Path, tmp_path: Path) -> None:
    inner = tmp_path / "inner" / "test_inner.py"
    inner.parent.mkdir()
    inner.write_text(INNER.format(tool=str(ROOT / "tools" / "localslurm.py"), ready=str(ready)))
    guard = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "tempguard.py"), "--"]
        + [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(inner)],
        env={**os.environ, "TMPDIR": str(parent)},
        cwd=inner.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    end = time.monotonic() + 300
    while not ready.exists():
        assert guard.poll() is None, f"the inner run ended early ({guard.returncode})"
        assert time.monotonic() < end, "the local cluster's job did not start in 300 s"
        time.sleep(0.2)
    time.sleep(0.2)  # the file is complete once written
    info = json.loads(ready.read_text())
    assert cluster_processes(info["conf"], info["daemons"])  # it runs: the check can fail
    if how == "ctrl-c under nox":
        for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):  # Ctrl-C twice, nox's SIGTERM
            guard.send_signal(sig)
            time.sleep(0.2)
        guard.kill()  # nox's last word, half a second after the Ctrl-C
    else:
        os.kill(info["pytest"], signal.SIGTERM if how == "SIGTERM to pytest" else signal.SIGKILL)
    guard.wait(timeout=400)
    end = time.monotonic() + 400
    while (left := cluster_processes(info["conf"], info["daemons"])) or any(parent.iterdir()):
        assert time.monotonic() < end, f"left: {left}, {[p.name for p in parent.iterdir()]}"
        time.sleep(0.5)
