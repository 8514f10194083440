"""The repository's local-cluster helper (tools/localslurm.py): parsing, CLI, the multi-node
cluster's config and address claims; no daemons (tests/test_localslurm_multinode.py starts them)."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest

SHOW_JOB = """JobId=7 JobName=my job.sh
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   JobState=RUNNING Reason=None Dependency=(null)
   Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:0
   RunTime=00:00:02 TimeLimit=00:05:00 TimeMin=N/A
   StartTime=2026-11-22T10:54:41 EndTime=2026-11-22T10:59:41 Deadline=N/A
   Command=/tmp/a b/my job.sh arg1 arg 2
   WorkDir=/tmp/x y
   Power=
"""


def test_parse_scontrol_keeps_values_with_spaces(localslurm: ModuleType) -> None:
    info = localslurm.parse_scontrol(SHOW_JOB)
    assert info["JobName"] == "my job.sh" and info["JobId"] == "7"
    assert info["Command"] == "/tmp/a b/my job.sh arg1 arg 2" and info["WorkDir"] == "/tmp/x y"
    assert info["EndTime"] == "2026-11-22T10:59:41" and info["TimeLimit"] == "00:05:00"
    assert info["RestartCnt"] == info["Restarts"] == "1"
    assert info["Power"] == ""


def test_free_ports_differ(localslurm: ModuleType) -> None:
    ports = {localslurm.free_port() for _ in range(5)}
    assert len(ports) >= 2 and all(1024 < p < 65536 for p in ports)


def test_unavailable_reason_is_none_or_says_why(localslurm: ModuleType) -> None:
    reason = localslurm.unavailable_reason()
    assert reason is None or "SLURM" in reason or "root" in reason or "munge" in reason


def test_bad_cpus_is_refused(localslurm: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cpus must be >= 1"):
        localslurm.LocalCluster(tmp_path, cpus=0)


def test_cli_usage_errors(localslurm: ModuleType, tmp_path: Path) -> None:
    script = str(localslurm.__file__)
    out = subprocess.run(
        [sys.executable, script, "sideways", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "invalid choice" in out.stderr
    out = subprocess.run(
        [sys.executable, script, "down", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "no cluster recorded" in out.stderr
    out = subprocess.run(
        [sys.executable, script, "status", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "slurmctld: not running" in out.stdout


def test_partitions_and_settings_reach_slurm_conf(localslurm: ModuleType, tmp_path: Path) -> None:
    cluster = localslurm.LocalCluster(
        tmp_path,
        extra_conf={"KillWait": "30", "PreemptType": "preempt/partition_prio"},
        partitions={"debug": "Default=YES", "low": "PriorityTier=1 PreemptMode=REQUEUE"},
    )
    cluster._write_conf()  # what start() writes before the daemons start
    conf = (tmp_path / "slurm.conf").read_text().splitlines()
    assert "KillWait=30" in conf and "PreemptType=preempt/partition_prio" in conf
    parts = [line for line in conf if line.startswith("PartitionName=")]
    assert len(parts) == 2 and parts[1].endswith("State=UP PriorityTier=1 PreemptMode=REQUEUE")
    with pytest.raises(ValueError, match="partition name 'a b'"):
        localslurm.LocalCluster(tmp_path, partitions={"a b": ""})


def test_multinode_says_what_is_missing(
    localslurm: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(localslurm, "unavailable_reason", lambda: None)
    real = localslurm._which
    monkeypatch.setattr(localslurm, "_which", lambda name: None if name == "ip" else real(name))
    reason = localslurm.multinode_unavailable_reason()
    assert reason is not None and "apt-get install iproute2" in reason
    # A machine where namespaces cannot be made: the probe fails (here: `false` in its place).
    fake = {"unshare": "/bin/false"}
    monkeypatch.setattr(localslurm, "_which", lambda name: fake.get(name) or real(name))
    reason = localslurm.multinode_unavailable_reason()
    assert reason is not None and "cannot create network namespaces" in reason
    monkeypatch.setattr(localslurm.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(localslurm, "unavailable_reason", lambda: "runs as SlurmUser=root")
    assert localslurm.multinode_unavailable_reason() == "runs as SlurmUser=root"


def test_multinode_conf_has_a_node_per_namespace(localslurm: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nodes must be 1-250"):
        localslurm.MultiNodeCluster(tmp_path, nodes=0)
    cluster = localslurm.MultiNodeCluster(tmp_path, nodes=3, cpus=2)
    hosts = [cluster.controller, *cluster.nodes]
    cluster.addresses = {h: f"10.1.2.{i + 1}" for i, h in enumerate(hosts)}
    cluster._write_conf()  # what start() writes once the namespaces are there
    conf = (tmp_path / "slurm.conf").read_text().splitlines()
    assert f"SlurmctldHost={cluster.controller}(10.1.2.1)" in conf
    nodes = [line for line in conf if line.startswith("NodeName=")]
    assert nodes == [
        f"NodeName={n} NodeAddr=10.1.2.{i + 2} NodeHostname={n} CPUs=2 RealMemory=1000 "
        "State=UNKNOWN"
        for i, n in enumerate(cluster.nodes)
    ]
    # SLURM's defaults, as on a real cluster: every address, SlurmdTimeout 300 s ...
    assert not any(line.startswith(("CommunicationParameters=", "SlurmdTimeout=")) for line in conf)
    cluster = localslurm.MultiNodeCluster(tmp_path, extra_conf={"SlurmdTimeout": "30"})
    cluster.addresses = dict.fromkeys([cluster.controller, *cluster.nodes], "10.1.2.1")
    cluster._write_conf()  # ... unless set
    assert "SlurmdTimeout=30" in (tmp_path / "slurm.conf").read_text().splitlines()


def test_clusters_claiming_addresses_at_once_get_different_subnets(
    localslurm: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hosts = tmp_path / "etc" / "hosts"
    hosts.parent.mkdir()
    hosts.write_text("127.0.0.1 localhost\n10.9.9.9 elsewhere")  # no newline at the end
    monkeypatch.setattr(localslurm, "HOSTS_FILE", hosts)
    busy = ipaddress.ip_network("10.0.0.0/9")  # this machine's own: never taken
    monkeypatch.setattr(localslurm, "_local_networks", lambda: [busy])
    claims: dict[str, dict[str, str]] = {}

    def claim(tag: str) -> None:
        claims[tag] = localslurm._claim_addresses(tag, [f"c{tag}", f"n{tag}-1"])

    threads = [threading.Thread(target=claim, args=(f"t{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    nets = {ipaddress.ip_network(f"{c[f'c{tag}']}/24", strict=False) for tag, c in claims.items()}
    assert len(nets) == 8 and not any(n.overlaps(busy) for n in nets)
    lines = hosts.read_text().splitlines()
    assert lines[:2] == ["127.0.0.1 localhost", "10.9.9.9 elsewhere"] and len(lines) == 2 + 16
    for tag, claimed in claims.items():
        for host, address in claimed.items():
            assert f"{address} {host} # localslurm {tag}" in lines
    localslurm._edit_hosts(lambda old: [x for x in old if not localslurm._tagged(x, "t3")])
    lines = hosts.read_text().splitlines()
    assert len(lines) == 2 + 14 and not any(line.endswith("localslurm t3") for line in lines)

    def busy(*_: object) -> None:  # a container's /etc/hosts is a mount point: no rename onto it
        raise OSError(16, "Device or resource busy")

    monkeypatch.setattr(localslurm.os, "replace", busy)
    localslurm._edit_hosts(lambda old: [x for x in old if not localslurm._tagged(x, "t4")])
    lines = hosts.read_text().splitlines()
    assert len(lines) == 2 + 12 and not any(line.endswith("localslurm t4") for line in lines)
    assert sorted(p.name for p in hosts.parent.iterdir()) == ["hosts"]  # no temp file left
