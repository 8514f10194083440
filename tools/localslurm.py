#!/usr/bin/env python3
"""Throw-away SLURM clusters for tests (stdlib only): one node on 127.0.0.1, or a controller and
N compute nodes, each in network namespaces of its own.

Starts Debian's ``slurm-wlm`` (22.05) daemons -- one ``slurmctld`` and one ``slurmd`` per node --
with a private config and their own state, spool, pid and log files under one directory, so
several clusters can run side by side on one machine (concurrent test sessions, other engineers'
tests). Nothing in ``/etc/slurm`` is read or written: every command run against the cluster
needs ``SLURM_CONF`` pointing at its config, which :attr:`LocalCluster.env` carries.

This file is not part of any package. Tests load it by path, so it must stay self-contained::

    import importlib.util, pathlib
    spec = importlib.util.spec_from_file_location("localslurm", ROOT / "tools/localslurm.py")
    localslurm = importlib.util.module_from_spec(spec); spec.loader.exec_module(localslurm)

    if (why := localslurm.unavailable_reason()) is not None:
        pytest.skip(why)
    with localslurm.LocalCluster(tmp_path / "slurm", cpus=8) as cluster:
        job = cluster.sbatch(script, "--time=2", "--signal=B:USR2@60")
        info = cluster.wait_for(job, {"RUNNING"}, timeout=60)   # scontrol show job, parsed
        cluster.run(["scontrol", "requeue", job])

As a script (the cluster keeps running after ``up``; ``down`` stops it by the PIDs it recorded)::

    python tools/localslurm.py up --dir /tmp/slurm [--cpus 8]   # prints `export SLURM_CONF=...`
    python tools/localslurm.py up --dir /tmp/slurm --conf KillWait=30 \
        --partition 'debug Default=YES' --partition 'low PriorityTier=1 PreemptMode=REQUEUE'
    python tools/localslurm.py up --dir /tmp/mn --nodes 3 [--cpus 2]  # 3 nodes, see below
    python tools/localslurm.py run --dir /tmp/mn -- sinfo -N       # a client, on the controller
    python tools/localslurm.py run --dir /tmp/mn --on NODE -- hostname   # a command on a node
    python tools/localslurm.py status --dir /tmp/slurm
    python tools/localslurm.py down --dir /tmp/slurm

Settings that work on this machine, and why:

- ``SlurmUser=root``: the tests run as root;
- ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``: no cgroups in containers;
- ``AuthType``/``CredType`` ``auth/none``/``cred/none`` where those plugins exist, else munge;
- ``AuthInfo=cred_expire=10``: a requeued job starts again after ~15 s instead of ~170 s;
- ``CommunicationParameters=NoInAddrAny,NoCtldInAddrAny``: the daemons listen on 127.0.0.1;
- ``SlurmdParameters=config_overrides`` + ``CPUs=N``: N one-CPU jobs at once, whatever the host;
- ``SchedulerParameters=sched_interval=2,bf_interval=1``: jobs start within ~2 s;
- ``KillWait=5``: cancelled or timed-out jobs are gone soon; ``JobRequeue=1``;
- ``MinJobAge=600``: finished jobs stay visible to ``scontrol show job`` for 10 minutes.

``extra_conf`` overrides any of these (``{"KillWait": "30"}``: a site's default). ``partitions``
replaces the one ``debug`` partition: ``{name: "more options"}``, each over all nodes, e.g. for
partition-based preemption on one node (with ``extra_conf={"PreemptType":
"preempt/partition_prio", "PreemptMode": "REQUEUE"}``)::

    {"debug": "Default=YES PreemptMode=OFF", "low": "PriorityTier=1 PreemptMode=REQUEUE",
     "urgent": "PriorityTier=2 PreemptMode=OFF"}

Several nodes -- :class:`MultiNodeCluster` (Linux, root, ``ip`` and ``nsenter``)::

    if (why := localslurm.multinode_unavailable_reason()) is not None:
        pytest.skip(why)
    with localslurm.MultiNodeCluster(tmp_path / "slurm", nodes=3, cpus=2) as cluster:
        cluster.run(["srun", "-N2", "--ntasks-per-node=1", "hostname"])  # two node names
        cluster.kill_node(cluster.nodes[1])   # slurmd, slurmstepd and the jobs' processes
        cluster.wait_node(cluster.nodes[1], {"down*"}, timeout=400)  # after SlurmdTimeout

Each daemon runs in a network namespace (``/var/run/netns/localslurm-HOST``) and a UTS namespace
of its own: its hostname is the node's name, as on a real cluster (``hostname`` in a job on node
X says X; torch's gloo picks its interface from it). A veth pair per namespace (``eth0`` inside)
joins a bridge that lives in a namespace of its own, the cluster's switch: nothing is added to
the machine's own network. The addresses come from a /24 of 10.0.0.0/8 that no route or address
of the machine and no other cluster uses; the names go to /etc/hosts (lines ending ``#
localslurm TAG``, edited under a lock on /etc, so clusters starting side by side keep each
other's lines), so every process resolves them. The file system is shared, as a cluster's shared
file system would be. Why namespaces: two slurmd on loopback do not work (slurmd binds the
address of the machine's hostname, and calls srun back at the source address of its connection,
always 127.0.0.1). Why ``nsenter --net=...`` and not ``ip netns exec``: that remounts /sys, and
slurmd dies ("No filesystem mounted on /sys/fs/cgroup"). SLURM's clients must run inside the
controller's namespace: :meth:`LocalCluster.run` does that, :meth:`MultiNodeCluster.on_node`
runs a command on a node. The daemons listen on all their namespace's addresses and
``SlurmdTimeout`` is SLURM's default (300 s), as on a real cluster; ``extra_conf`` sets it.

Faults (a process is on the node whose network namespace it runs in, ``/proc/PID/ns/net``):
``kill_node`` (SIGKILL to all at once: slurmd, slurmstepd, the jobs' processes; ``start_node``
brings a slurmd back), ``freeze_node`` / ``thaw_node`` (SIGSTOP / SIGCONT to all of them),
``cut_network`` / ``restore_network`` (``ip link set dev eth0 down`` / ``up`` on the node);
``processes`` and ``job_pids`` say what runs on a node, ``node_states`` and ``wait_node`` what
the controller thinks of it (sinfo: ``down*``, where ``*`` means "not responding").

Shutdown order matters: ``scancel`` everything, wait for an empty queue (a ``slurmstepd`` that
outlives its ``slurmd`` can hang), then stop the daemons by PID -- never by name, other clusters
may be running -- and kill what is left of the jobs (the slurmstepd processes holding a socket
in this cluster's spool folder, and what they started; every process in a multi-node
cluster's namespaces) -- never a process because of its environment: the shell that ran
``export SLURM_CONF=...`` and any bystander live on. Before the ``scancel``
a multi-node cluster's faulted nodes are brought back (network up, processes continued) and
those without a slurmd are set DOWN, or their jobs would stay COMPLETING until SlurmdTimeout;
after the daemons its hosts lines, namespaces (their links go with them), UTS mounts and
``/run/localslurm-TAG`` go. All of it is found from the cluster's tag (``ClusterName=pyrTAG``
in slurm.conf): ``down`` and the reaper need nothing else. When the daemons fail to start, the
error carries the tail of their logs.

The daemons run in sessions of their own (a Ctrl-C in the test terminal must not hit them), so
they would outlive a test process that dies without :meth:`LocalCluster.stop`: SIGTERM, SIGKILL,
a crash (issue 24: a stopped ``nox`` left e2e's daemons and their requeuing jobs running). A
*reaper* watches for that: a small process (``python localslurm.py reap``) started with the
cluster, whose parent is the process that started it. When that parent is gone (the reaper is
re-parented) before ``stop()`` ended the reaper, it shuts the cluster down in the order above
and removes the directory the cluster made. ``stop()`` on SIGINT (pytest's KeyboardInterrupt
teardown, also during ``start()``) needs no reaper; the reaper covers every way the test
process can die.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo")
PLUGIN_DIRS = (
    "/usr/lib/x86_64-linux-gnu/slurm-wlm",
    "/usr/lib/aarch64-linux-gnu/slurm-wlm",
    "/usr/lib64/slurm",
    "/usr/lib/slurm",
    "/usr/local/lib/slurm",
)
# Jobs that are over: the queue counts as empty once every job is in one of these.
FINISHED = frozenset(
    {
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
    }
)
# A node that takes jobs (sinfo's %T; "idle*" would be one the controller cannot reach).
READY = frozenset({"idle", "mixed", "allocated"})

# Several nodes on one machine: where `ip netns add` keeps its namespaces, the names file every
# process resolves node names with, and the addresses each cluster takes a /24 of.
NETNS_DIR = Path("/var/run/netns")
HOSTS_FILE = Path("/etc/hosts")
SUBNETS = ipaddress.IPv4Network("10.0.0.0/8")
# SLURM's own ports: every daemon of a multi-node cluster has a namespace to itself.
PORTS = {"slurmctld": 6817, "slurmd": 6818}


class SlurmError(RuntimeError):
    """The local cluster could not be started, or a SLURM command failed."""


def _which(name: str) -> str | None:
    # The daemons live in /usr/sbin, which is not on every PATH (e.g. a nox virtualenv's).
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin:/usr/local/sbin"
    return shutil.which(name, path=path)


def unavailable_reason() -> str | None:
    """None when a local cluster can be started here, else why not (for ``pytest.skip``)."""
    missing = [
        name for name in (*DAEMONS, "sbatch", "squeue", "scontrol", "scancel") if not _which(name)
    ]
    if missing:
        return (
            f"SLURM is not installed ({', '.join(missing)} not found); "
            "install Debian's slurm-wlm (apt-get install slurm-wlm) to run these tests"
        )
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "a local SLURM cluster needs a POSIX system"
    if os.geteuid() != 0:
        return "a local SLURM cluster here runs as SlurmUser=root; run the tests as root"
    if _auth_plugin() is None:
        return "neither auth/none nor munge is available for SLURM authentication"
    return None


def multinode_unavailable_reason() -> str | None:
    """None when a :class:`MultiNodeCluster` can be started here, else why not."""
    if (why := unavailable_reason()) is not None:
        return why
    tools = {"ip": "iproute2", "nsenter": "util-linux", "unshare": "util-linux"}
    missing = sorted({package for name, package in tools.items() if not _which(name)})
    if missing:
        return (
            f"several SLURM nodes on one machine need {', '.join(sorted(tools))}: "
            f"install {' '.join(missing)} (apt-get install {' '.join(missing)})"
        )
    # In a namespace of its own, which goes with the probe: nothing is left behind either way.
    ip = _which("ip")
    probe = f"{ip} link add name v0 type veth peer name v1 && {ip} link add name b0 type bridge"
    out = subprocess.run(
        [str(_which("unshare")), "--net", "--uts", "sh", "-c", probe],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    if out.returncode != 0:
        said = (out.stderr.strip().splitlines() or ["no message"])[-1]
        return (
            f"cannot create network namespaces, veth pairs and bridges here ({said}): run as "
            "root with CAP_SYS_ADMIN and CAP_NET_ADMIN (a container: --privileged)"
        )
    return None


def _plugin_dir() -> str | None:
    for d in PLUGIN_DIRS:
        if Path(d, "auth_none.so").exists() or Path(d, "auth_munge.so").exists():
            return d
    return None


def _auth_plugin() -> str | None:
    """'none' when the no-auth plugins exist (no munged needed), 'munge' when munged runs."""
    d = _plugin_dir()
    if d and Path(d, "auth_none.so").exists() and Path(d, "cred_none.so").exists():
        return "none"
    if _which("munged") and Path("/run/munge/munge.socket.2").exists():
        return "munge"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"({path} not written)"
    return "\n".join(text[-lines:]) or f"({path} is empty)"


# Keys whose value runs to the end of its line and may hold spaces (JobName=my job.sh).
_REST_OF_LINE = ("JobName", "Command", "WorkDir", "StdErr", "StdIn", "StdOut", "Comment")


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show job`` (multi-line form) -> {key: value}."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        for key in _REST_OF_LINE:
            m = re.search(rf"(?:^|\s){key}=(.*)$", line)
            if m:
                fields[key] = m.group(1).strip()
                line = line[: m.start()]
        for token in line.split():
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
    if "Restarts" in fields:  # 22.05 says Restarts=; RestartCnt is the name in the docs and sacct
        fields.setdefault("RestartCnt", fields["Restarts"])
    return fields


def client_env(conf: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (this process's environment) for SLURM commands against the cluster ``conf``."""
    env = {
        key: value
        for key, value in (os.environ if base is None else base).items()
        # Variables of an enclosing job would make sbatch/srun inside tests think they run in it.
        if not key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))
    }
    env["SLURM_CONF"] = str(conf)
    env["PATH"] = env.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return env


def _log_name(key: str) -> str:
    """A daemon's key (``slurmctld``, ``slurmd``, ``slurmd@NODE``) -> its log files' stem."""
    return key.replace("@", "-")


class LocalCluster:
    """A single-node SLURM on 127.0.0.1 with its own ports and state; a context manager.

    ``workdir`` holds the config, state, spool, logs and pid files (a fresh temp dir when None; it
    is removed by :meth:`stop` only if this object created it). ``cpus`` one-CPU jobs run at
    once (per node). ``extra_conf`` adds or overrides ``slurm.conf`` keys (e.g. ``{"KillWait":
    "2"}``). ``partitions``: ``{name: options}`` over the nodes instead of the one ``debug``
    partition. :attr:`nodes` are the nodes' names.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        cpus: int = 8,
        extra_conf: Mapping[str, str] | None = None,
        partitions: Mapping[str, str] | None = None,
        reaper: bool = True,
    ) -> None:
        if cpus < 1:
            raise ValueError(f"cpus must be >= 1, got {cpus}")
        self.partitions = dict(partitions or {"debug": "Default=YES"})
        for name in self.partitions:
            if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
                raise ValueError(f"partition name {name!r}: use letters, digits, '-' and '_'")
        self._own_dir = workdir is None
        self.workdir = Path(
            tempfile.mkdtemp(prefix="localslurm-") if workdir is None else workdir
        ).resolve()
        self.cpus = cpus
        self.extra_conf = dict(extra_conf or {})
        self.tag = uuid.uuid4().hex[:8]
        self.cluster_name = f"pyr{self.tag}"  # per cluster: state files carry the name
        self.node_name = f"n{self.tag}"
        self.nodes = [self.node_name]
        self.daemons = list(DAEMONS)  # keys of _procs and of run/pids, in start order
        self.conf_path = self.workdir / "slurm.conf"
        self.env: dict[str, str] = client_env(self.conf_path)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}
        self._want_reaper = reaper
        self._reaper: subprocess.Popen[bytes] | None = None

    # -- life cycle -------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> LocalCluster:
        """Write the config, start the daemons, return once every node takes jobs."""
        reason = self._unavailable()
        if reason is not None:
            raise SlurmError(reason)
        if self._want_reaper and self._reaper is None:  # before any daemon: none may be orphaned
            self._reaper = _start_reaper(self.workdir, self.tag, remove=self._own_dir)
        try:
            self._bring_up(timeout)
        except BaseException:  # a Ctrl-C too: nothing of a failed start may outlive it
            self.stop()
            raise
        return self

    def _unavailable(self) -> str | None:
        return unavailable_reason()

    def _bring_up(self, timeout: float) -> None:
        for attempt in range(3):
            self._write_conf()
            try:
                self._start_daemons(timeout)
                return
            except SlurmError as e:
                # A free port may have been taken between free_port() and the daemon's bind.
                if attempt == 2 or "Address already in use" not in str(e):
                    raise
                self._kill_daemons()

    def _write_conf(self) -> None:
        for sub in ("state", "spool", "log", "run"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self.ports = self._ports()
        conf = {**self._conf(), **self.extra_conf}
        lines = [f"{k}={v}" for k, v in conf.items()]
        lines += self._node_lines()
        for name, options in self.partitions.items():
            line = f"PartitionName={name} Nodes=ALL MaxTime=INFINITE State=UP"
            lines.append(f"{line} {options}".rstrip())
        self.conf_path.write_text("\n".join(lines) + "\n")

    def _ports(self) -> dict[str, int]:
        return {"slurmctld": free_port(), "slurmd": free_port()}

    def _conf(self) -> dict[str, str]:
        """slurm.conf's settings (before ``extra_conf``), for the module docstring's reasons."""
        auth = _auth_plugin()
        host = socket.gethostname().split(".")[0]
        conf: dict[str, str] = {
            "ClusterName": self.cluster_name,
            "SlurmctldHost": f"{host}(127.0.0.1)",
            "SlurmctldPort": str(self.ports["slurmctld"]),
            "SlurmdPort": str(self.ports["slurmd"]),
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": f"auth/{auth}",
            "CredType": f"cred/{auth}",
            "AuthInfo": "cred_expire=10",
            "StateSaveLocation": str(self.workdir / "state"),
            "SlurmdSpoolDir": str(self.workdir / "spool"),
            "SlurmctldPidFile": str(self.workdir / "run/slurmctld.pid"),
            "SlurmdPidFile": str(self.workdir / "run/slurmd.pid"),
            "SlurmctldLogFile": str(self.workdir / "log/slurmctld.log"),
            "SlurmdLogFile": str(self.workdir / "log/slurmd.log"),
            "SlurmctldDebug": "info",
            "SlurmdDebug": "info",
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/none",
            "MpiDefault": "none",
            "SwitchType": "switch/none",
            "MailProg": "/bin/true",
            "CommunicationParameters": "NoInAddrAny,NoCtldInAddrAny",
            "SchedulerType": "sched/backfill",
            "SchedulerParameters": "sched_interval=2,bf_interval=1",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            "SlurmdParameters": "config_overrides",
            "JobRequeue": "1",
            "KillWait": "5",
            "MinJobAge": "600",
            "ReturnToService": "2",
            "SlurmdTimeout": "60",
            "InactiveLimit": "0",
            "Waittime": "0",
        }
        plugin_dir = _plugin_dir()
        if plugin_dir:
            conf["PluginDir"] = plugin_dir
        return conf

    def _node_lines(self) -> list[str]:
        return [
            f"NodeName={self.node_name} NodeAddr=127.0.0.1 NodeHostname=127.0.0.1 "
            f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
        ]

    def _argv(self, key: str) -> list[str]:
        """The command line of the daemon ``key`` (``slurmctld``, ``slurmd`` or ``slurmd@NODE``)."""
        name, _, node = key.partition("@")
        # -D: foreground, so the PID we hold is the daemon's; -i: ignore stale state.
        if name == "slurmctld":
            return [str(_which("slurmctld")), "-D", "-i"]
        return [str(_which("slurmd")), "-D", "-N", node or self.node_name]

    def _start_daemons(self, timeout: float) -> None:
        for key in self.daemons:
            self._spawn(key)
            if key == "slurmctld":
                self._wait(self._ping_ctld, timeout, "slurmctld to answer")
        self._wait(self._nodes_ready, timeout, f"{', '.join(self.nodes)} to become idle")

    def _spawn(self, key: str) -> None:
        log = self.workdir / "log"
        (log / f"{_log_name(key)}.log").unlink(missing_ok=True)
        with open(log / f"{_log_name(key)}.stdout", "wb") as out:
            self._procs[key] = subprocess.Popen(
                self._argv(key),
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,  # a Ctrl-C in the test terminal must not hit them
            )
        self._write_pids()

    def _write_pids(self) -> None:
        text = "".join(f"{n} {p.pid}\n" for n, p in self._procs.items())
        (self.workdir / "run/pids").write_text(text)

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited with {proc.returncode}\n{self.logs()}")
            if ready():
                return
            if time.monotonic() > end:
                raise SlurmError(
                    f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}"
                )
            time.sleep(0.2)

    def _ping_ctld(self) -> bool:
        out = self.run(["scontrol", "ping"], check=False, timeout=10)
        return "UP" in out.stdout and "DOWN" not in out.stdout

    def _nodes_ready(self) -> bool:
        states = self.node_states()
        for node, state in states.items():
            if state.startswith(("down", "drain")):
                # A node registering for the first time can come up DOWN; bring it back.
                self.run(
                    ["scontrol", "update", f"NodeName={node}", "State=RESUME"],
                    check=False,
                    timeout=10,
                )
        return all(states.get(node) in READY for node in self.nodes)

    def node_states(self) -> dict[str, str]:
        """{node: its state as ``sinfo`` says it}: "idle", "allocated", "mixed", "down*", ... (a
        trailing ``*``: the controller cannot reach the node)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=15)
        # One line per partition the node is in, all with the node's state.
        return dict(line.split()[:2] for line in out.stdout.splitlines() if len(line.split()) > 1)

    def wait_node(self, node: str, states: Collection[str], timeout: float) -> str:
        """Poll until ``node``'s state (:meth:`node_states`) is one of ``states``; that state."""
        end = time.monotonic() + timeout
        while (state := self.node_states().get(node, "?")) not in states:
            if time.monotonic() > end:
                raise SlurmError(
                    f"node {node} is {state!r} after {timeout:.0f} s, expected one of "
                    f"{sorted(states)}\n{self.logs(10)}"
                )
            time.sleep(0.5)
        return state

    def logs(self, lines: int = 25) -> str:
        """The tails of the daemons' logs, for error messages."""
        log = self.workdir / "log"
        parts = []
        for key in self.daemons:
            name = _log_name(key)
            parts.append(f"--- {name}.log (tail)\n{_tail(log / f'{name}.log', lines)}")
            out = log / f"{name}.stdout"
            if out.exists() and out.stat().st_size:
                parts.append(f"--- {name} stdout/stderr (tail)\n{_tail(out, lines)}")
        return "\n".join(parts)

    def stop(self, timeout: float = 60.0) -> None:
        """Cancel every job, wait for an empty queue, stop the daemons by PID, kill what is left
        of the jobs, remove state (and a multi-node cluster's network: see :func:`down`); then
        end the reaper (nothing is left for it to do)."""
        pids = {key: p.pid for key, p in self._procs.items() if p.poll() is None}
        down(self.workdir, timeout, pids=pids, tag=self.tag, env=self.env)
        self._kill_daemons()  # down() stopped them: this reaps them
        self._cleanup_dir()
        self._end_reaper()

    def _end_reaper(self) -> None:
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.terminate()
            reaper.wait(timeout=15)

    def _active_jobs(self) -> list[str]:
        out = self.run(["squeue", "-h", "-o", "%i %T"], check=False, timeout=15)
        if out.returncode != 0:
            return []
        return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]

    def _kill_daemons(self) -> None:
        # The slurmds first: they must not find the controller gone and retry for a minute.
        for key in sorted(self._procs, key=lambda k: k == "slurmctld"):
            proc = self._procs.pop(key)
            if proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        with contextlib.suppress(OSError):
            (self.workdir / "run/pids").unlink()

    def _cleanup_dir(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        else:
            for sub in ("state", "spool", "run"):
                shutil.rmtree(self.workdir / sub, ignore_errors=True)

    # -- using the cluster ------------------------------------------------------------------

    def _client(self) -> list[str]:
        """What a SLURM client's command line starts with (a multi-node cluster: nsenter)."""
        return []

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        **kw: Any,
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client (squeue, scontrol, srun, ...) against this cluster (on its
        controller's host)."""
        return self._run(self._client(), argv, check=check, timeout=timeout, env=env, **kw)

    def _run(
        self,
        prefix: Sequence[str],
        argv: Sequence[str],
        *,
        check: bool,
        timeout: float,
        env: Mapping[str, str] | None,
        **kw: Any,
    ) -> subprocess.CompletedProcess[str]:
        full_env = {**self.env, **(env or {}), "SLURM_CONF": str(self.conf_path)}
        try:
            out = subprocess.run(
                [*prefix, *argv],
                env=full_env,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
                **kw,
            )
        except subprocess.TimeoutExpired as e:
            raise SlurmError(f"{' '.join(argv)} timed out after {timeout:.0f} s") from e
        if check and out.returncode != 0:
            said = out.stderr.strip() or out.stdout.strip()
            raise SlurmError(f"{' '.join(argv)} failed ({out.returncode}): {said}")
        return out

    def sbatch(
        self,
        script: str | os.PathLike[str],
        *args: str,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        script_args: Sequence[str] = (),
    ) -> str:
        """Submit a batch script; returns the job id.

        ``script`` is a path, or the script's text when it starts with ``#!``; ``args`` are sbatch
        options (``"--time=2"``), ``script_args`` the script's own arguments; ``env`` is added to
        the cluster's environment (sbatch exports it to the job).
        """
        text = os.fspath(script)
        if text.startswith("#!"):
            path = self.workdir / f"job-{uuid.uuid4().hex[:8]}.sh"
            path.write_text(text)
            text = str(path)
        argv = ["sbatch", "--parsable", *args, text, *script_args]
        out = self.run(argv, env=env, cwd=cwd if cwd is not None else self.workdir)
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` parsed: JobState, EndTime, RestartCnt, TimeLimit, ..."""
        out = self.run(["scontrol", "show", "job", str(job_id)], timeout=15)
        return parse_scontrol(out.stdout)

    def wait_for(self, job_id: str, states: Collection[str], timeout: float) -> dict[str, str]:
        """Poll until the job's JobState is one of ``states``; its fields, or SlurmError."""
        wanted = {s.upper() for s in states}
        end = time.monotonic() + timeout
        info: dict[str, str] = {}
        while True:
            info = self.job(job_id)
            if info.get("JobState", "").upper() in wanted:
                return info
            if time.monotonic() > end:
                raise SlurmError(
                    f"job {job_id} is {info.get('JobState')} (reason {info.get('Reason')}) after "
                    f"{timeout:.0f} s, expected one of {sorted(wanted)}\n{self.logs(10)}"
                )
            time.sleep(0.5)

    def jobs(self) -> Iterator[str]:
        """Ids of the jobs still pending or running."""
        yield from self._active_jobs()


class MultiNodeCluster(LocalCluster):
    """A controller and ``nodes`` compute nodes on this machine, each daemon in network and UTS
    namespaces of its own (see the module's docstring); ``cpus`` one-CPU jobs per node. Linux,
    root. :attr:`nodes` are the compute nodes' names (``nTAG-1``, ...), :attr:`controller` the
    controller's, :attr:`addresses` everyone's address."""

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        nodes: int = 2,
        cpus: int = 8,
        extra_conf: Mapping[str, str] | None = None,
        partitions: Mapping[str, str] | None = None,
        reaper: bool = True,
    ) -> None:
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes must be 1-250 (a cluster has a /24 of addresses), got {nodes}")
        super().__init__(
            workdir, cpus=cpus, extra_conf=extra_conf, partitions=partitions, reaper=reaper
        )
        self.net = _Net(self.tag)
        self.controller = self.net.controller
        self.nodes = [self.net.node(i) for i in range(1, nodes + 1)]
        self.daemons = ["slurmctld", *(f"slurmd@{node}" for node in self.nodes)]
        self.addresses: dict[str, str] = {}

    def _unavailable(self) -> str | None:
        return multinode_unavailable_reason()

    def _bring_up(self, timeout: float) -> None:
        self.addresses = self.net.create([self.controller, *self.nodes])
        self._write_conf()
        self._start_daemons(timeout)

    def _ports(self) -> dict[str, int]:
        return dict(PORTS)

    def _conf(self) -> dict[str, str]:
        conf = super()._conf()
        # Each daemon has its namespace to itself: SLURM's defaults, as on a real cluster (listen
        # on every address; SlurmdTimeout 300 s).
        del conf["CommunicationParameters"], conf["SlurmdTimeout"]
        conf["SlurmctldHost"] = f"{self.controller}({self.addresses[self.controller]})"
        # Node-local, and short: slurmd's sockets live there, and a socket's path has 108 bytes.
        conf["SlurmdSpoolDir"] = str(self.net.state / "spool" / "%n")
        conf["SlurmdPidFile"] = str(self.workdir / "run" / "slurmd-%n.pid")
        conf["SlurmdLogFile"] = str(self.workdir / "log" / "slurmd-%n.log")
        return conf

    def _node_lines(self) -> list[str]:
        return [
            f"NodeName={node} NodeAddr={self.addresses[node]} NodeHostname={node} "
            f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
            for node in self.nodes
        ]

    def _argv(self, key: str) -> list[str]:
        host = key.partition("@")[2] or self.controller
        return [*self.net.enter(host), *super()._argv(key)]

    def _client(self) -> list[str]:
        return self.net.enter(self.controller)

    def _node(self, node: str) -> str:
        if node not in self.nodes:
            raise ValueError(f"{node!r} is not a node of this cluster; its nodes: {self.nodes}")
        return node

    # -- on a node, and faults --------------------------------------------------------------

    def on_node(
        self,
        node: str,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        **kw: Any,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``node`` (its network, its hostname) with the cluster's environment."""
        prefix = self.net.enter(self._node(node))
        return self._run(prefix, argv, check=check, timeout=timeout, env=env, **kw)

    def processes(self, node: str) -> dict[int, str]:
        """{pid: command line} of everything on ``node``: its slurmd, slurmstepd, the jobs'."""
        return {pid: _cmdline(pid) for pid in _netns_pids(self.net.nspath(self._node(node)))}

    def job_pids(self, node: str) -> list[int]:
        """The jobs' processes on ``node`` (neither its slurmd nor a slurmstepd)."""
        pids = _netns_pids(self.net.nspath(self._node(node)))
        # "": gone since it was listed (slurmd's short-lived forks as a step starts), not a job's.
        return sorted(pid for pid in pids if _comm(pid) not in ("", "slurmd", "slurmstepd"))

    def kill_node(self, node: str) -> None:
        """SIGKILL everything on ``node`` at once, for good, as a machine that crashes: its
        slurmd, slurmstepd and the jobs' processes (its network stays up: add
        :meth:`cut_network` for a node that goes silent). :meth:`start_node` starts its slurmd
        again."""
        _kill_all(self.net.nspath(self._node(node)))
        proc = self._procs.pop(f"slurmd@{node}", None)
        if proc is not None:
            proc.wait(timeout=15)
        self._write_pids()

    def start_node(self, node: str, timeout: float = 60.0) -> None:
        """Start ``node``'s slurmd again (after :meth:`kill_node`); return once it takes jobs
        (``ReturnToService=2``: a node DOWN for not responding comes back when it registers)."""
        key = f"slurmd@{self._node(node)}"
        if key in self._procs:
            raise SlurmError(f"the slurmd of {node} runs (pid {self._procs[key].pid})")
        self._spawn(key)
        self._wait(lambda: self.node_states().get(node) in READY, timeout, f"{node} to take jobs")

    def freeze_node(self, node: str) -> list[int]:
        """SIGSTOP everything on ``node`` (a hung machine: its connections stay open and nothing
        answers); the pids stopped. :meth:`thaw_node` continues them."""
        return sorted(_signal_all(self.net.nspath(self._node(node)), signal.SIGSTOP))

    def thaw_node(self, node: str) -> None:
        _signal_all(self.net.nspath(self._node(node)), signal.SIGCONT)

    def cut_network(self, node: str) -> None:
        """``ip link set dev eth0 down`` on ``node``: nothing reaches it, its processes run on."""
        _ip("-n", self.net.ns(self._node(node)), "link", "set", "dev", "eth0", "down")

    def restore_network(self, node: str) -> None:
        _ip("-n", self.net.ns(self._node(node)), "link", "set", "dev", "eth0", "up")


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    return ""


def _comm(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return ""


# -- the network of a multi-node cluster -------------------------------------------------------


def _cmd(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a system tool (ip, unshare, umount), found also outside PATH (/usr/sbin)."""
    out = subprocess.run(
        [_which(argv[0]) or argv[0], *argv[1:]],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    if check and out.returncode != 0:
        raise SlurmError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _cmd("ip", *argv, check=check)


class _Net:
    """The namespaces, links and names of one multi-node cluster. Everything is named after the
    cluster's tag, so what a killed test left is found and removed from the tag alone."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.state = Path(f"/run/localslurm-{tag}")  # UTS namespaces, the slurmds' spools
        self.switch = f"localslurm-s{tag}"  # the namespace of the bridge
        self.bridge = f"br{tag}"
        self.controller = f"c{tag}"

    def node(self, i: int) -> str:
        return f"n{self.tag}-{i}"

    def ns(self, host: str) -> str:
        return f"localslurm-{host}"

    def nspath(self, host: str) -> Path:
        return NETNS_DIR / self.ns(host)

    def utspath(self, host: str) -> Path:
        return self.state / f"{host}.uts"

    def enter(self, host: str) -> list[str]:
        """A command line's start that runs it on ``host`` (not `ip netns exec`: it remounts
        /sys, and slurmd then dies)."""
        net, uts = self.nspath(host), self.utspath(host)
        return [str(_which("nsenter")), f"--net={net}", f"--uts={uts}", "--"]

    def hosts(self) -> list[str]:
        """The controller and nodes whose namespaces exist."""
        found = NETNS_DIR.glob(f"localslurm-[cn]{self.tag}*")
        return sorted(p.name.removeprefix("localslurm-") for p in found)

    def exists(self) -> bool:
        return self.state.exists() or (NETNS_DIR / self.switch).exists() or bool(self.hosts())

    def create(self, hosts: Sequence[str]) -> dict[str, str]:
        """Namespaces, links, hostnames and /etc/hosts lines for ``hosts``: {host: address}."""
        self.state.mkdir(parents=True)
        addresses = _claim_addresses(self.tag, hosts)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", self.bridge, "type", "bridge")
        _ip("-n", self.switch, "link", "set", self.bridge, "up")
        for k, (host, address) in enumerate(addresses.items()):
            self._plug(host, address, f"v{self.tag}-{k}")
            (self.state / "spool" / host).mkdir(parents=True)
        return addresses

    def _plug(self, host: str, address: str, port: str) -> None:
        """``host``'s namespaces: eth0 (a veth whose other end is ``port`` on the bridge) with
        ``address``, loopback, and the hostname ``host``."""
        ns = self.ns(host)
        _ip("netns", "add", ns)
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", ns)  # fmt: skip
        _ip("-n", self.switch, "link", "set", port, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        for dev in ("lo", "eth0"):
            _ip("-n", ns, "link", "set", dev, "up")
        uts = self.utspath(host)
        uts.touch()
        _cmd("unshare", f"--uts={uts}", "hostname", host)  # a namespace kept by its mount

    def revive(self) -> list[str]:
        """Undo the faults, so that the nodes' jobs can end: links up, stopped processes
        continued. The nodes without a slurmd (killed) are returned."""
        dead = []
        for host in self.hosts():
            if host == self.controller:
                continue
            _ip("-n", self.ns(host), "link", "set", "dev", "eth0", "up", check=False)
            pids = _signal_all(self.nspath(host), signal.SIGCONT)
            if not any(_comm(pid) == "slurmd" for pid in pids):
                dead.append(host)
        return dead

    def destroy(self) -> None:
        """Every process in the namespaces killed, the hosts lines, the namespaces (their links
        go with them), the UTS mounts and the state folder removed. Idempotent."""
        spaces = [self.nspath(host) for host in self.hosts()] + [NETNS_DIR / self.switch]
        for path in spaces:
            _kill_all(path)
        _edit_hosts(lambda lines: [line for line in lines if not _tagged(line, self.tag)])
        for path in spaces:
            if path.exists():
                _ip("netns", "delete", path.name, check=False)
        for uts in self.state.glob("*.uts"):
            _cmd("umount", str(uts), check=False)
        shutil.rmtree(self.state, ignore_errors=True)


def _netns_pids(ns: Path) -> list[int]:
    """The processes whose network namespace is the one mounted at ``ns``."""
    try:
        want = os.stat(ns)
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                st = os.stat(f"/proc/{entry}/ns/net")
                if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
                    pids.append(int(entry))
    return pids


def _signal_all(ns: Path, sig: int) -> set[int]:
    """``sig`` to every process in ``ns``, and to those that appear meanwhile (forks); parents
    first: a parent that runs on sees no child stop."""
    done: set[int] = set()
    while new := set(_netns_pids(ns)) - done:
        for pid in sorted(new, key=_depth):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        done |= new
    return done


def _kill_all(ns: Path, timeout: float = 15.0) -> None:
    """SIGKILL every process in ``ns`` as at once, as on a machine that crashes, and wait until
    they are gone (zombies do not count).

    Killed one by one, the last run on and see the first die: a node's srun killed while its
    batch script and slurmstepd ran ended the job, and with it the step's tasks on every other
    node, within 0.25 s (what a test process descheduled between two kills gives them on a
    loaded machine). So all are stopped first; then each process group gets one SIGKILL for all
    its members, deepest first: the kernel wakes a stopped group with SIGHUP and SIGCONT when the
    last process tying it to its session dies (POSIX's orphaned process group; srun then
    cancels its step), unless the group was killed before."""
    _signal_all(ns, signal.SIGSTOP)
    end = time.monotonic() + timeout
    while (pids := set(_netns_pids(ns))) and time.monotonic() < end:
        _kill_groups(pids)
        time.sleep(0.05)


def _kill_groups(pids: Collection[int]) -> None:
    """SIGKILL ``pids``: a process group with one signal, deepest first (by its shallowest
    member, its leader: a group below another is started by a process of the one above); a group
    with members outside ``pids`` (a command entered from outside keeps its caller's group)
    process by process."""
    groups: dict[int, list[int]] = {}
    for pid in pids:
        groups.setdefault(_stat(pid)[2], []).append(pid)
    others = (_stat(int(e)) for e in os.listdir("/proc") if e.isdigit() and int(e) not in pids)
    outside = {pgid for state, _, pgid in others if state not in ("", "Z")}  # a zombie is no one
    for pgid, members in sorted(groups.items(), key=lambda g: -min(map(_depth, g[1]))):
        if pgid > 0 and pgid not in outside:  # 0: gone meanwhile
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            continue
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _stat(pid: int) -> tuple[str, int, int]:
    """(state, parent, process group) of ``pid``; ("", 0, 0) when it is gone."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), int(fields[2])
    return "", 0, 0


def _depth(pid: int) -> int:
    """How many ancestors ``pid`` has."""
    depth = 0
    while (pid := _stat(pid)[1]) > 0:
        depth += 1
    return depth


def _tagged(line: str, tag: str) -> bool:
    return line.rstrip().endswith(f"# localslurm {tag}")


def _edit_hosts(edit: Callable[[list[str]], list[str]]) -> None:
    """Rewrite /etc/hosts with ``edit`` (its lines -> new lines) under an exclusive lock on its
    folder: clusters started and stopped side by side keep each other's lines."""
    fd = os.open(HOSTS_FILE.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        old = HOSTS_FILE.read_text().splitlines(keepends=True)
        new = edit(old)
        if new == old:
            return
        tmp = HOSTS_FILE.with_name(f".{HOSTS_FILE.name}.localslurm-{os.getpid()}")
        try:  # whole, for the resolvers reading it meanwhile ...
            tmp.write_text("".join(new))
            shutil.copymode(HOSTS_FILE, tmp)
            os.replace(tmp, HOSTS_FILE)
        except OSError:  # ... or in place, where it is a mount point (a container's /etc/hosts)
            tmp.unlink(missing_ok=True)
            with open(HOSTS_FILE, "r+") as f:
                f.write("".join(new))
                f.truncate()
    finally:
        os.close(fd)  # and with it the lock


def _claim_addresses(tag: str, hosts: Sequence[str]) -> dict[str, str]:
    """A /24 of 10.0.0.0/8 that no route or address here and no other cluster's hosts line uses:
    its first addresses for ``hosts``, written to /etc/hosts (under the lock: no other cluster
    can take the same /24 meanwhile)."""
    busy = _local_networks()
    claimed: dict[str, str] = {}

    def edit(lines: list[str]) -> list[str]:
        taken = list(busy)
        for line in lines:
            if "# localslurm " in line:
                with contextlib.suppress(ValueError, IndexError):
                    taken.append(ipaddress.IPv4Network(f"{line.split()[0]}/24", strict=False))
        for _ in range(1000):
            first = int(SUBNETS.network_address) + (random.randrange(1, 2**16 - 1) << 8)
            net = ipaddress.IPv4Network((first, 24))
            if not any(net.overlaps(other) for other in taken):
                claimed.update(zip(hosts, map(str, net.hosts()), strict=False))
                head = [*lines[:-1], lines[-1].rstrip("\n") + "\n"] if lines else []
                return head + [f"{a} {h} # localslurm {tag}\n" for h, a in claimed.items()]
        raise SlurmError(f"no free /24 left in {SUBNETS} for the cluster's network")

    _edit_hosts(edit)
    return claimed


def _local_networks() -> list[ipaddress.IPv4Network]:
    """The networks this machine's own addresses and routes use."""
    found = []
    for argv in (("-4", "-o", "addr", "show"), ("-4", "route", "show", "table", "all")):
        text = _ip(*argv, check=False).stdout
        for word in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?\b", text):
            with contextlib.suppress(ValueError):
                found.append(ipaddress.IPv4Network(word, strict=False))
    return found


# -- tearing a cluster down, also from the reaper --------------------------------------------


def _cancel_all(env: Mapping[str, str], timeout: float, client: Sequence[str] = ()) -> None:
    """scancel every job (of any partition) and wait, at most ``timeout`` s, for an empty queue."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = subprocess.run(
            [*client, "squeue", "-h", "-o", "%i"],
            env=env,
            capture_output=True,
            text=True,
            timeout=15,
        )
        jobs = out.stdout.split() if out.returncode == 0 else []
        if not jobs:
            return
        subprocess.run([*client, "scancel", *jobs], env=env, capture_output=True, timeout=15)
        time.sleep(0.5)


def _kill_jobs(conf: Path) -> list[int]:
    """SIGKILL what is left of the jobs once the daemons are down: this cluster's slurmstepd
    processes -- those holding a socket SLURM made in the cluster's SlurmdSpoolDir, SLURM's own
    record of a step (what ``scontrol listpids`` reads) -- and their descendants (the job
    steps they ran); never a process only because its environment names this cluster's
    SLURM_CONF (the shell that ran the ``export`` line ``up`` printed, a bystander). Linux."""
    spool = _conf_value(conf, "SlurmdSpoolDir")
    if not spool or not os.path.isdir("/proc"):
        return []
    root = spool.split("%", 1)[0].rstrip("/") or spool  # multi-node: ``.../spool/%n``
    stepds = [pid for pid in _all_pids() if _comm(pid) == "slurmstepd" and _in_spool(pid, root)]
    pids = _descendants(stepds)
    for pid in pids:  # all stopped first: none sees another die and acts on it
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return sorted(pids)


def _all_pids() -> list[int]:
    me = os.getpid()
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != me]


def _in_spool(pid: int, root: str) -> bool:
    """Does ``pid`` hold a unix socket bound under ``root`` (its network namespace's table)?"""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    if not inodes:
        return False
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith(root + "/"):
                return True
    return False


def _descendants(pids: Collection[int]) -> set[int]:
    """``pids`` and every process below them (by parent, in /proc)."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        children.setdefault(_stat(pid)[1], []).append(pid)
    found, todo = set(pids), list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _conf_value(conf: Path, key: str) -> str | None:
    with contextlib.suppress(OSError):
        if m := re.search(rf"^{key}=(.+)$", conf.read_text(), flags=re.MULTILINE):
            return m.group(1).strip()
    return None


def _tag_of(conf: Path) -> str | None:
    """The tag of the cluster whose config is ``conf`` (its ClusterName is pyrTAG)."""
    with contextlib.suppress(OSError):
        if m := re.search(r"^ClusterName=pyr(\w+)$", conf.read_text(), flags=re.MULTILINE):
            return m.group(1)
    return None


def down(
    workdir: Path,
    timeout: float = 60.0,
    pids: Mapping[str, int] | None = None,
    *,
    tag: str | None = None,
    env: Mapping[str, str] | None = None,
) -> bool:
    """Stop the cluster in ``workdir`` (CLI ``down``, the reaper, :meth:`LocalCluster.stop`)
    from the PIDs it recorded: undo a multi-node cluster's faults, cancel every job, wait for an
    empty queue, stop the daemons, kill the jobs' remains, remove the network. ``tag``: the
    cluster's (default: from its slurm.conf). False when there was nothing to stop."""
    conf = workdir / "slurm.conf"
    pids = _read_pids(workdir) or dict(pids or {})
    tag = tag or _tag_of(conf)
    net = _Net(tag) if tag is not None and _Net(tag).exists() else None
    env = dict(env) if env is not None else client_env(conf)
    client = net.enter(net.controller) if net is not None else []
    dead = net.revive() if net is not None else []
    if _alive(pids.get("slurmctld", -1), "slurmctld"):
        for node in dead:  # else its jobs stay COMPLETING until SlurmdTimeout
            subprocess.run(
                [*client, "scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=down"],
                env=env,
                capture_output=True,
                timeout=15,
            )
        _cancel_all(env, timeout, client)
    for key in sorted(pids, key=lambda k: k == "slurmctld"):  # the slurmds first
        _stop(pids[key], key)
    _kill_jobs(conf)
    if net is not None:
        net.destroy()
    for sub in ("state", "spool", "run"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    return bool(pids) or net is not None


def _stop(pid: int, key: str) -> None:
    """SIGTERM to the daemon ``key`` (if ``pid`` still is that daemon), SIGKILL 15 s later."""
    if not _alive(pid, key):
        return
    os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + 15
    while _alive(pid, key) and time.monotonic() < end:
        time.sleep(0.2)
    if _alive(pid, key):
        os.kill(pid, signal.SIGKILL)


def _start_reaper(workdir: Path, tag: str, *, remove: bool) -> subprocess.Popen[bytes]:
    argv = [sys.executable, str(Path(__file__).resolve()), "reap", "--dir", str(workdir)]
    argv += ["--parent", str(os.getpid()), "--tag", tag, *(["--remove-dir"] if remove else [])]
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C for the tests is not for it
    )


def reap(workdir: Path, parent: int, remove: bool, tag: str | None = None) -> int:
    """The reaper: wait while ``parent`` is our parent; if it goes before ending us (SIGTERM from
    ``stop()``), shut the cluster down. The config is kept in memory: a temp folder removed
    under the cluster must not leave it unstoppable."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    conf, text = workdir / "slurm.conf", None
    pids: dict[str, int] = {}
    while os.getppid() == parent:
        if text is None and conf.exists():
            text = conf.read_text()
        pids = _read_pids(workdir) or pids  # the daemons, as start() records them
        time.sleep(0.5)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # from here on, finish the job
    if text is not None and not conf.exists():
        (workdir / "log").mkdir(parents=True, exist_ok=True)
        conf.write_text(text)
    down(workdir, pids=pids, tag=tag)
    if remove:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


# -- command line ------------------------------------------------------------------------------


def _read_pids(workdir: Path) -> dict[str, int]:
    pids = {}
    with contextlib.suppress(OSError):
        for line in (workdir / "run/pids").read_text().splitlines():
            name, pid = line.split()
            pids[name] = int(pid)
    return pids


def _alive(pid: int, key: str) -> bool:
    """Is ``pid`` still the daemon ``key`` (``slurmd@NODE``: a slurmd), not a recycled PID?"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return key.partition("@")[0].encode() in cmdline


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localslurm", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["up", "down", "status", "run", "reap"])
    parser.add_argument("--dir", required=True, help="directory holding the cluster's files")
    parser.add_argument("--cpus", type=int, default=8, help="CPUs of each node (up only)")
    parser.add_argument(
        "--nodes",
        type=int,
        help="compute nodes, each in network namespaces of its own (up only; default: one "
        "node on 127.0.0.1)",
    )
    parser.add_argument("--on", metavar="NODE", help="run: on this node, not the controller")
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)  # reap: whose death
    parser.add_argument("--tag", help=argparse.SUPPRESS)  # reap: the cluster's
    parser.add_argument("--remove-dir", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set or override a slurm.conf key (up only; repeat), e.g. --conf KillWait=30",
    )
    parser.add_argument(
        "--partition",
        action="append",
        default=[],
        metavar="'NAME [OPTIONS]'",
        help="a partition over the nodes instead of `debug` (up only; repeat), e.g. "
        "--partition 'low PriorityTier=1 PreemptMode=REQUEUE'",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # run: the command after `--` is the command's, not ours.
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    workdir = Path(args.dir).resolve()
    if args.action == "reap":
        return reap(workdir, args.parent, args.remove_dir, args.tag)
    if args.action == "up":
        return _up(parser, args, workdir)
    if args.action == "status":
        return _status(workdir)
    if args.action == "run":
        return _run_command(parser, workdir, args.on, command)
    # down: same order as LocalCluster.stop, from the PIDs `up` recorded.
    if not down(workdir):
        print(f"localslurm: no cluster recorded in {workdir}", file=sys.stderr)
        return 1
    print(f"localslurm: stopped the cluster in {workdir}")
    return 0


def _up(parser: argparse.ArgumentParser, args: argparse.Namespace, workdir: Path) -> int:
    extra: dict[str, str] = {}
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            parser.error(f"--conf {item!r}: give KEY=VALUE, e.g. --conf KillWait=30")
        extra[key.strip()] = value.strip()
    partitions = {p.split()[0]: " ".join(p.split()[1:]) for p in args.partition if p.split()}
    if any(_alive(p, n) for n, p in _read_pids(workdir).items()):
        print(f"localslurm: a cluster already runs in {workdir}; `down` it first", file=sys.stderr)
        return 1
    workdir.mkdir(parents=True, exist_ok=True)
    kw: dict[str, Any] = {"cpus": args.cpus, "extra_conf": extra, "partitions": partitions or None}
    try:  # reaper=False: the cluster outlives this CLI
        if args.nodes is None:
            cluster = LocalCluster(workdir, reaper=False, **kw)
        else:
            cluster = MultiNodeCluster(workdir, nodes=args.nodes, reaper=False, **kw)
    except ValueError as e:
        parser.error(str(e))
    try:
        cluster.start()
    except SlurmError as e:
        print(f"localslurm: {e}", file=sys.stderr)
        return 1
    # Leave the daemons running: forget the Popen objects so nothing waits on them.
    cluster._procs.clear()
    print(f"export SLURM_CONF={cluster.conf_path}")
    if isinstance(cluster, MultiNodeCluster):
        print(f"# nodes: {' '.join(cluster.nodes)}; SLURM commands run on the controller:")
        print(f"#   python {Path(__file__).resolve()} run --dir {workdir} -- sinfo -N")
    return 0


def _status(workdir: Path) -> int:
    pids = _read_pids(workdir)
    alive = {key: pid for key, pid in pids.items() if _alive(pid, key)}
    for key in pids or DAEMONS:
        print(f"{key}: {f'pid {alive[key]}' if key in alive else 'not running'}")
    conf = workdir / "slurm.conf"
    if conf.exists() and "slurmctld" in alive:
        out = subprocess.run(
            [*_client_of(conf), "sinfo", "-N"],
            env=client_env(conf),
            capture_output=True,
            text=True,
            timeout=15,
        )
        print(out.stdout.rstrip())
        print(f"export SLURM_CONF={conf}")
    return 0 if pids and len(alive) == len(pids) else 1


def _client_of(conf: Path) -> list[str]:
    """How a SLURM client reaches the cluster of ``conf`` (in its controller's namespace, for a
    multi-node cluster)."""
    tag = _tag_of(conf)
    net = _Net(tag) if tag is not None else None
    return net.enter(net.controller) if net is not None and net.exists() else []


def _run_command(
    parser: argparse.ArgumentParser, workdir: Path, on: str | None, command: list[str]
) -> int:
    if not command:
        parser.error("run: give the command after --, e.g. run --dir D -- sinfo -N")
    conf = workdir / "slurm.conf"
    tag = _tag_of(conf)
    if tag is None:
        print(f"localslurm: no cluster recorded in {workdir}", file=sys.stderr)
        return 1
    net = _Net(tag)
    if on is not None and on not in net.hosts():
        print(f"localslurm: no node {on!r} here; nodes: {' '.join(net.hosts())}", file=sys.stderr)
        return 1
    prefix = net.enter(on) if on is not None else _client_of(conf)
    return subprocess.run([*prefix, *command], env=client_env(conf)).returncode


if __name__ == "__main__":
    sys.exit(main())
