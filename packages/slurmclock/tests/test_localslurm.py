"""The repository's local-cluster helper (tools/localslurm.py): parsing and CLI, no daemons."""

from __future__ import annotations

import subprocess
import sys
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
