#!/usr/bin/env python3
"""A throw-away single-node SLURM cluster on 127.0.0.1, for tests (stdlib only).

Starts Debian's ``slurm-wlm`` (22.05) daemons -- one ``slurmctld`` and one ``slurmd`` -- with a
private config, free TCP ports, and their own state, spool, pid and log files under one directory,
so several clusters can run side by side on one machine (concurrent test sessions, other
engineers' tests). Nothing in ``/etc/slurm`` is read or written: every command run against the
cluster needs ``SLURM_CONF`` pointing at its config, which :attr:`LocalCluster.env` carries.

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
replaces the one ``debug`` partition: ``{name: "more options"}``, each over the one node, e.g. for
partition-based preemption on one node (with ``extra_conf={"PreemptType":
"preempt/partition_prio", "PreemptMode": "REQUEUE"}``)::

    {"debug": "Default=YES PreemptMode=OFF", "low": "PriorityTier=1 PreemptMode=REQUEUE",
     "urgent": "PriorityTier=2 PreemptMode=OFF"}

Shutdown order matters: ``scancel`` everything, wait for an empty queue (a ``slurmstepd`` that
outlives its ``slurmd`` can hang), then stop the daemons by PID -- never by name, other clusters
may be running -- and kill what is left of the jobs (processes started with this cluster's
``SLURM_CONF``). When the daemons fail to start, the error carries the tail of their logs.

The daemons run in sessions of their own (a Ctrl-C in the test terminal must not hit them), so
they would outlive a test process that dies without :meth:`LocalCluster.stop`: SIGTERM, SIGKILL,
a crash (issue 24: a stopped ``nox`` left e2e's daemons and their requeuing jobs running). A
*reaper* watches for that: a small process (``python localslurm.py reap``) started with the
cluster, whose parent is the process that started it. When that parent is gone (the reaper is
re-parented) before ``stop()`` ended the reaper, it shuts the cluster down in the order above
and removes the directory the cluster made. ``stop()`` on SIGINT (pytest's KeyboardInterrupt
teardown) needs no reaper; the reaper covers every way the test process can die.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
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


class LocalCluster:
    """A single-node SLURM on 127.0.0.1 with its own ports and state; a context manager.

    ``workdir`` holds the config, state, spool, logs and pid files (a fresh temp dir when None; it
    is removed by :meth:`stop` only if this object created it). ``cpus`` one-CPU jobs run at
    once. ``extra_conf`` adds or overrides ``slurm.conf`` keys (e.g. ``{"KillWait": "2"}``).
    ``partitions``: ``{name: options}`` over the node instead of the one ``debug`` partition.
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
        tag = uuid.uuid4().hex[:8]
        self.cluster_name = f"pyr{tag}"  # per cluster: state files carry the name
        self.node_name = f"n{tag}"
        self.conf_path = self.workdir / "slurm.conf"
        self.env: dict[str, str] = {**os.environ, "SLURM_CONF": str(self.conf_path)}
        self.env["PATH"] = self.env.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
        # Variables of an enclosing job would make sbatch/srun inside tests think they run in it.
        for key in list(self.env):
            if key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and key != "SLURM_CONF":
                del self.env[key]
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
        """Write the config, start both daemons, return once the node takes jobs."""
        reason = unavailable_reason()
        if reason is not None:
            raise SlurmError(reason)
        if self._want_reaper and self._reaper is None:  # before any daemon: none may be orphaned
            self._reaper = _start_reaper(self.workdir, remove=self._own_dir)
        for attempt in range(3):
            self._write_conf()
            try:
                self._start_daemons(timeout)
                return self
            except SlurmError as e:
                # A free port may have been taken between free_port() and the daemon's bind.
                self._kill_daemons()
                if attempt == 2 or "Address already in use" not in str(e):
                    self._cleanup_dir()
                    self._end_reaper()
                    raise
        raise AssertionError("unreachable")

    def _write_conf(self) -> None:
        for sub in ("state", "spool", "log", "run"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self.ports = {"slurmctld": free_port(), "slurmd": free_port()}
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
        conf.update(self.extra_conf)
        lines = [f"{k}={v}" for k, v in conf.items()]
        lines.append(
            f"NodeName={self.node_name} NodeAddr=127.0.0.1 NodeHostname=127.0.0.1 "
            f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
        )
        for name, options in self.partitions.items():
            line = f"PartitionName={name} Nodes={self.node_name} MaxTime=INFINITE State=UP"
            lines.append(f"{line} {options}".rstrip())
        self.conf_path.write_text("\n".join(lines) + "\n")

    def _start_daemons(self, timeout: float) -> None:
        log = self.workdir / "log"
        for name in DAEMONS:
            (log / f"{name}.log").unlink(missing_ok=True)
        argv = {
            # -D: foreground, so the PID we hold is the daemon's; -i: ignore stale state.
            "slurmctld": [str(_which("slurmctld")), "-D", "-i"],
            "slurmd": [str(_which("slurmd")), "-D", "-N", self.node_name],
        }
        for name in DAEMONS:
            with open(log / f"{name}.stdout", "wb") as out:
                self._procs[name] = subprocess.Popen(
                    argv[name],
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=self.workdir,
                    start_new_session=True,  # a Ctrl-C in the test terminal must not hit them
                )
            self._write_pids()
            if name == "slurmctld":
                self._wait(lambda: self._ping_ctld(), timeout, "slurmctld to answer")
        self._wait(self._node_idle, timeout, f"node {self.node_name} to become idle")

    def _write_pids(self) -> None:
        text = "".join(f"{n} {p.pid}\n" for n, p in self._procs.items())
        (self.workdir / "run/pids").write_text(text)

    def _wait(self, ready: Any, timeout: float, what: str) -> None:
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

    def _node_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False, timeout=10)
        # One line per partition the node is in, all with the node's state.
        state = (out.stdout.split() or [""])[0].lower()
        if state.startswith(("down", "drain")):
            # A node registering for the first time can come up DOWN; bring it back.
            self.run(
                ["scontrol", "update", f"NodeName={self.node_name}", "State=RESUME"],
                check=False,
                timeout=10,
            )
        return state in {"idle", "mixed", "allocated"}

    def logs(self, lines: int = 25) -> str:
        """The tails of both daemons' logs, for error messages."""
        log = self.workdir / "log"
        parts = []
        for name in DAEMONS:
            parts.append(f"--- {name}.log (tail)\n{_tail(log / f'{name}.log', lines)}")
            out = log / f"{name}.stdout"
            if out.exists() and out.stat().st_size:
                parts.append(f"--- {name} stdout/stderr (tail)\n{_tail(out, lines)}")
        return "\n".join(parts)

    def stop(self, timeout: float = 60.0) -> None:
        """Cancel every job, wait for an empty queue, stop the daemons by PID, kill what is left
        of the jobs, remove state; then end the reaper (nothing is left for it to do)."""
        if self._procs and self._procs["slurmctld"].poll() is None:
            _cancel_all(self.env, timeout)
        self._kill_daemons()
        _kill_jobs(self.conf_path)
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
        # slurmd first: it must not find the controller gone and retry for a minute.
        for name in reversed(DAEMONS):
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
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

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        **kw: Any,
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM client (squeue, scontrol, srun, ...) against this cluster."""
        full_env = {**self.env, **(env or {}), "SLURM_CONF": str(self.conf_path)}
        try:
            out = subprocess.run(
                list(argv),
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


# -- tearing a cluster down, also from the reaper --------------------------------------------


def _cancel_all(env: Mapping[str, str], timeout: float) -> None:
    """scancel every job (of any partition) and wait, at most ``timeout`` s, for an empty queue."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=15
        )
        jobs = out.stdout.split() if out.returncode == 0 else []
        if not jobs:
            return
        subprocess.run(["scancel", *jobs], env=env, capture_output=True, timeout=15)
        time.sleep(0.5)


def _kill_jobs(conf: Path) -> list[int]:
    """SIGKILL what is left of the jobs once the daemons are down: processes started with this
    cluster's SLURM_CONF (slurmstepd and the job steps it ran). Linux (/proc)."""
    key, killed = f"SLURM_CONF={conf}".encode(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if key in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
    return killed


def down(workdir: Path, timeout: float = 60.0, pids: dict[str, int] | None = None) -> bool:
    """Stop the cluster in ``workdir`` from the PIDs it recorded (CLI ``down``, the reaper):
    cancel every job, wait for an empty queue, stop the daemons, kill the jobs' remains."""
    conf, pids = workdir / "slurm.conf", _read_pids(workdir) or pids or {}
    env = {**os.environ, "SLURM_CONF": str(conf)}
    if _alive(pids.get("slurmctld", -1), "slurmctld"):
        _cancel_all(env, timeout)
    for name in reversed(DAEMONS):
        pid = pids.get(name)
        if pid is None or not _alive(pid, name):
            continue
        os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + 15
        while _alive(pid, name) and time.monotonic() < end:
            time.sleep(0.2)
        if _alive(pid, name):
            os.kill(pid, signal.SIGKILL)
    _kill_jobs(conf)
    for sub in ("state", "spool", "run"):
        shutil.rmtree(workdir / sub, ignore_errors=True)
    return bool(pids)


def _start_reaper(workdir: Path, *, remove: bool) -> subprocess.Popen[bytes]:
    argv = [sys.executable, str(Path(__file__).resolve()), "reap", "--dir", str(workdir)]
    return subprocess.Popen(
        [*argv, "--parent", str(os.getpid()), *(["--remove-dir"] if remove else [])],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C for the tests is not for it
    )


def reap(workdir: Path, parent: int, remove: bool) -> int:
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
    down(workdir, pids=pids)
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


def _alive(pid: int, name: str) -> bool:
    """Is ``pid`` still the daemon ``name`` (not a recycled PID of something else)?"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return name.encode() in cmdline


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="localslurm", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["up", "down", "status", "reap"])
    parser.add_argument("--dir", required=True, help="directory holding the cluster's files")
    parser.add_argument("--cpus", type=int, default=8, help="CPUs of the node (up only)")
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)  # reap: whose death
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
        help="a partition over the node instead of `debug` (up only; repeat), e.g. "
        "--partition 'low PriorityTier=1 PreemptMode=REQUEUE'",
    )
    args = parser.parse_args(argv)
    if args.action == "reap":
        return reap(Path(args.dir).resolve(), args.parent, args.remove_dir)
    extra: dict[str, str] = {}
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            parser.error(f"--conf {item!r}: give KEY=VALUE, e.g. --conf KillWait=30")
        extra[key.strip()] = value.strip()
    partitions = {p.split()[0]: " ".join(p.split()[1:]) for p in args.partition if p.split()}
    workdir = Path(args.dir).resolve()
    conf = workdir / "slurm.conf"
    pids = _read_pids(workdir)

    if args.action == "up":
        if any(_alive(p, n) for n, p in pids.items()):
            print(
                f"localslurm: a cluster already runs in {workdir}; `down` it first", file=sys.stderr
            )
            return 1
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            cluster = LocalCluster(  # reaper=False: it outlives this CLI
                workdir,
                cpus=args.cpus,
                extra_conf=extra,
                partitions=partitions or None,
                reaper=False,
            )
        except ValueError as e:
            parser.error(str(e))
        try:
            cluster.start()
        except SlurmError as e:
            print(f"localslurm: {e}", file=sys.stderr)
            return 1
        # Leave the daemons running: forget the Popen objects so nothing waits on them.
        cluster._procs.clear()
        print(f"export SLURM_CONF={conf}")
        return 0

    if args.action == "status":
        alive = {n: p for n, p in pids.items() if _alive(p, n)}
        for name in DAEMONS:
            state = f"pid {alive[name]}" if name in alive else "not running"
            print(f"{name}: {state}")
        if conf.exists() and alive:
            env = {**os.environ, "SLURM_CONF": str(conf)}
            out = subprocess.run(
                ["sinfo", "-N"], env=env, capture_output=True, text=True, timeout=15
            )
            print(out.stdout.rstrip())
            print(f"export SLURM_CONF={conf}")
        return 0 if len(alive) == len(DAEMONS) else 1

    # down: same order as LocalCluster.stop, from the PIDs `up` recorded.
    if not down(workdir):
        print(f"localslurm: no cluster recorded in {workdir}", file=sys.stderr)
        return 1
    print(f"localslurm: stopped the cluster in {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
