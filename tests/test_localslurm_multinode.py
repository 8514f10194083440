"""tools/localslurm.py's multi-node cluster, against real daemons: a controller and three compute
nodes, each in network and UTS namespaces of its own. A job spans nodes with their own names and
addresses; a node killed, frozen or cut off leaves the controller's view and comes back; two
clusters run side by side; and nothing is left behind -- no namespace, hosts line, mount,
daemon, job process or folder -- after stop(), `down`, a Ctrl-C, or a SIGKILL of the process
that started the cluster (its reaper)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "localslurm.py"
_spec = importlib.util.spec_from_file_location("localslurm", TOOL)
assert _spec is not None and _spec.loader is not None
localslurm: ModuleType = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(localslurm)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Short, so that a faulted node is DOWN within a test's patience (SLURM's default is 300 s).
SLURMD_TIMEOUT = 10
# How long SLURM's own timers may take to act on it: ping every SlurmdTimeout/3, DOWN after
# SlurmdTimeout without an answer, plus the time a loaded machine adds.
NODE_DOWN_WAIT = 20 * SLURMD_TIMEOUT


def require_multinode() -> None:
    why = localslurm.multinode_unavailable_reason()
    if why is None:
        return
    if os.environ.get("PYRECOVER_REQUIRE_SLURM") == "1":
        pytest.fail(f"PYRECOVER_REQUIRE_SLURM=1 but a multi-node cluster cannot start: {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[Any]:
    require_multinode()
    conf = {"SlurmdTimeout": str(SLURMD_TIMEOUT)}
    with localslurm.MultiNodeCluster(nodes=3, cpus=1, extra_conf=conf) as c:
        yield c


@pytest.fixture
def cluster(shared_cluster: Any) -> Iterator[Any]:
    """The module's cluster, healed after each test: a test that fails between a fault and its
    repair must not leave the next one a node dead, frozen or cut off, and its job holding the
    rest (the next ``srun -N3`` then waits for resources until its timeout)."""
    yield shared_cluster
    for node in shared_cluster.net.revive():  # links up, processes continued; the killed:
        shared_cluster.start_node(node, timeout=NODE_DOWN_WAIT)
    if jobs := list(shared_cluster.jobs()):
        shared_cluster.run(["scancel", *jobs])
    for node in shared_cluster.nodes:
        shared_cluster.wait_node(node, {"idle"}, timeout=NODE_DOWN_WAIT)


def leftovers(tag: str, conf: Path, daemons: dict[str, int]) -> list[str]:
    """What is left of the cluster ``tag`` on this machine."""
    left = [f"namespace {p.name}" for p in localslurm.NETNS_DIR.glob(f"*{tag}*")]
    hosts = localslurm.HOSTS_FILE.read_text().splitlines()
    left += [f"hosts line {line!r}" for line in hosts if tag in line]
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    left += [f"mount {line.split()[4]}" for line in mounts if tag in line]
    left += [f"folder {p}" for p in Path("/run").glob(f"*{tag}*")]
    left += [f"{key} {pid}" for key, pid in daemons.items() if localslurm._alive(pid, key)]
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"SLURM_CONF={conf}".encode() in env or f"--tag {tag}" in cmd:
            left.append(f"pid {entry}: {cmd[:100]}")
    return left


def wait_for_nothing_left(tag: str, conf: Path, daemons: dict[str, int], workdir: Path) -> None:
    end = time.monotonic() + 120
    while (left := leftovers(tag, conf, daemons)) or workdir.exists():
        assert time.monotonic() < end, f"left after 120 s: {left}, folder {workdir.exists()}"
        time.sleep(0.5)


def state_of(pid: int) -> str:
    """The process state letter (R, S, T, ...) from /proc/PID/stat; "gone" for no process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def descheduled_between_signals(monkeypatch: pytest.MonkeyPatch) -> None:
    """os.kill and os.killpg sleep 0.2 s after each signal, as a test process descheduled
    between two signals on a loaded machine: what the processes do meanwhile shows."""
    for name in ("kill", "killpg"):
        send = getattr(os, name)

        def slow(pid: int, sig: int, send: Any = send) -> None:
            send(pid, sig)
            time.sleep(0.2)

        monkeypatch.setattr(os, name, slow)


def test_a_job_spans_the_nodes_each_with_its_own_name_and_address(cluster: Any) -> None:
    out = cluster.run(
        ["srun", "-N3", "--ntasks-per-node=1", "bash", "-c", "echo $(hostname) $SLURMD_NODENAME"]
    )
    lines = sorted(out.stdout.split("\n")[:-1])
    assert lines == [f"{node} {node}" for node in cluster.nodes], out.stdout
    hosts = localslurm.HOSTS_FILE.read_text()
    for host in (cluster.controller, *cluster.nodes):
        assert f"{cluster.addresses[host]} {host} # localslurm {cluster.tag}" in hosts
    assert len(set(cluster.addresses.values())) == 4
    assert len({a.rsplit(".", 1)[0] for a in cluster.addresses.values()}) == 1  # one /24
    node = cluster.nodes[1]
    said = cluster.on_node(node, ["bash", "-c", "hostname; ip -4 -o addr show dev eth0"]).stdout
    assert said.startswith(f"{node}\n") and f"inet {cluster.addresses[node]}/24" in said, said


def test_a_killed_frozen_or_cut_node_leaves_the_controllers_view_and_comes_back(
    cluster: Any,
) -> None:
    killed, frozen, cut = cluster.nodes
    job = cluster.sbatch("#!/bin/bash\nsrun sleep 600\n", "-N3", "--ntasks-per-node=1")
    cluster.wait_for(job, {"RUNNING"}, timeout=60)
    end = time.monotonic() + 60
    while not all(cluster.job_pids(n) for n in cluster.nodes):  # srun's tasks: one per node
        assert time.monotonic() < end, {n: cluster.processes(n) for n in cluster.nodes}
        time.sleep(0.2)
    sleepers = {n: cluster.job_pids(n) for n in cluster.nodes}

    with pytest.MonkeyPatch.context() as patch:
        descheduled_between_signals(patch)
        cluster.kill_node(killed)  # srun there and all that could see it go: at once
    assert cluster.processes(killed) == {}
    stopped = cluster.freeze_node(frozen)
    assert set(sleepers[frozen]) < set(stopped)  # the slurmd and slurmstepd too
    cluster.cut_network(cut)
    time.sleep(0.5)
    assert {state_of(pid) for pid in stopped} == {"T"}
    assert {state_of(pid) for pid in sleepers[cut]} <= set("RSD")  # cut off, running on
    said = cluster.on_node(cut, ["ip", "-o", "link", "show", "dev", "eth0"]).stdout
    assert "state DOWN" in said, said

    for node in (killed, frozen, cut):  # SlurmdTimeout without an answer: DOWN
        cluster.wait_node(node, {"down*"}, timeout=NODE_DOWN_WAIT)
    assert cluster.job(job)["JobState"] != "RUNNING"
    cluster.run(["scancel", job])

    cluster.thaw_node(frozen)
    cluster.restore_network(cut)
    cluster.start_node(killed)
    for node in cluster.nodes:
        cluster.wait_node(node, localslurm.READY, timeout=NODE_DOWN_WAIT)
    out = cluster.run(["srun", "-N3", "--ntasks-per-node=1", "hostname"], timeout=120)
    assert sorted(out.stdout.split()) == cluster.nodes


def test_a_second_cluster_beside_and_stop_leaves_nothing(cluster: Any) -> None:
    other = localslurm.MultiNodeCluster(nodes=2, cpus=1).start()
    try:
        assert (
            other.addresses[other.controller].rsplit(".", 1)[0]
            != (cluster.addresses[cluster.controller].rsplit(".", 1)[0])
        )
        job = other.sbatch("#!/bin/bash\nsrun sleep 600\n", "-N2", "--ntasks-per-node=1")
        other.wait_for(job, {"RUNNING"}, timeout=60)
        other.freeze_node(other.nodes[0])  # stop() must not hang on a hung node
        other.cut_network(other.nodes[1])
        daemons = {key: p.pid for key, p in other._procs.items()}
        assert leftovers(other.tag, other.conf_path, daemons)  # it runs: the check can fail
    finally:
        other.stop()
    assert leftovers(other.tag, other.conf_path, daemons) == []
    assert not other.workdir.exists()
    # The first cluster lost nothing: its hosts lines, its nodes.
    assert sum(cluster.tag in line for line in localslurm.HOSTS_FILE.read_text().splitlines()) == 4
    out = cluster.run(["srun", "-N3", "--ntasks-per-node=1", "hostname"], timeout=120)
    assert sorted(out.stdout.split()) == cluster.nodes


CHILD = """
import importlib.util, json, sys, time
spec = importlib.util.spec_from_file_location("localslurm", {tool!r})
localslurm = importlib.util.module_from_spec(spec); spec.loader.exec_module(localslurm)
with localslurm.MultiNodeCluster(nodes=2, cpus=1) as c:
    job = c.sbatch("#!/bin/bash\\nsrun sleep 600\\n", "-N2", "--ntasks-per-node=1")
    c.wait_for(job, {{"RUNNING"}}, timeout=60)
    while not all(c.job_pids(n) for n in c.nodes):
        time.sleep(0.2)
    c.freeze_node(c.nodes[1])
    daemons = {{k: p.pid for k, p in c._procs.items()}}
    print(json.dumps({{"tag": c.tag, "conf": str(c.conf_path), "daemons": daemons}}), flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "SIGKILL"])
def test_the_process_that_started_it_interrupted_or_killed_leaves_nothing(
    how: signal.Signals,
) -> None:
    require_multinode()
    with tempfile.TemporaryDirectory(prefix="mn") as scratch:
        env = {**os.environ, "TMPDIR": scratch}  # where the cluster's own folder goes
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD.format(tool=str(TOOL))],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        assert child.stdout is not None
        line = child.stdout.readline()
        try:
            info = json.loads(line)
        except ValueError:
            child.kill()
            pytest.fail(f"the cluster did not start: {line}{child.communicate()[0]}")
        workdir = Path(info["conf"]).parent
        assert leftovers(info["tag"], Path(info["conf"]), info["daemons"])  # it can fail
        child.send_signal(how)
        said = child.communicate(timeout=300)[0]
        wait_for_nothing_left(info["tag"], Path(info["conf"]), info["daemons"], workdir)
        assert list(Path(scratch).iterdir()) == [], said


def test_the_command_line_up_run_status_down(tmp_path: Path) -> None:
    require_multinode()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, str(TOOL), args[0], "--dir", str(tmp_path / "c"), *args[1:]]
        return subprocess.run(argv, capture_output=True, text=True, timeout=300)

    up = cli("up", "--nodes", "2", "--cpus", "1")
    bystander: subprocess.Popen[bytes] | None = None
    try:
        assert up.returncode == 0, up.stderr
        tag = localslurm._tag_of(tmp_path / "c" / "slurm.conf")
        nodes = [f"n{tag}-1", f"n{tag}-2"]
        status = cli("status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert all(f"slurmd@{n}: pid" in status.stdout for n in nodes), status.stdout
        ran = cli("run", "--", "srun", "-N2", "--ntasks-per-node=1", "hostname")
        assert sorted(ran.stdout.split()) == nodes, ran.stdout + ran.stderr
        on = cli("run", "--on", nodes[1], "--", "hostname")
        assert on.stdout.strip() == nodes[1], on.stdout + on.stderr
        daemons = localslurm._read_pids(tmp_path / "c")
        # A job left running (its processes must go) and a bystander with the cluster's
        # SLURM_CONF in its environment, as the shell that ran `up`'s export line (must live).
        cli("run", "--", "sbatch", "-N2", "--output=/dev/null", "--wrap", "srun sleep 300")
        conf = tmp_path / "c" / "slurm.conf"
        bystander = subprocess.Popen(["sleep", "300"], env={**os.environ, "SLURM_CONF": str(conf)})
    finally:
        down = cli("down")
    try:
        assert down.returncode == 0, down.stderr
        assert bystander is not None and bystander.poll() is None, "down killed a bystander"
    finally:
        if bystander is not None:
            bystander.kill()
            bystander.wait()
    assert leftovers(str(tag), tmp_path / "c" / "slurm.conf", daemons) == []
    assert cli("status").returncode == 1
