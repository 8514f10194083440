"""`python -m ddpkit`: info, check, hostlist; exit 2 with one line on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from ddpkit.cli import main


def test_hostlist(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hostlist", "gpu[01-02],cpu3"]) == 0
    assert capsys.readouterr().out == "gpu01\ngpu02\ncpu3\n"
    assert main(["hostlist", "--first", "n[7-9]"]) == 0
    assert capsys.readouterr().out == "n7\n"


def test_malformed_hostlist_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hostlist", "gpu[1-"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddpkit: error: unclosed '['") and err.count("\n") == 1


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_info_and_check_in_a_single_process(launch: Any) -> None:
    env = launch.clean_env(SLURM_JOB_ID="4242")
    out = run(["info", "--json"], env)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert (info["launcher"], info["world_size"], info["job_id"]) == ("single", 1, "4242")
    out = run(["check"], env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ddpkit check: ok: 1 rank(s) via single")


def test_bad_variables_exit_2_with_one_line(launch: Any) -> None:
    env = launch.clean_env(
        RANK="2",
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1234",
    )
    for args in (["info"], ["check"]):
        out = run(args, env)
        assert out.returncode == 2
        # (torch itself may warn on import, e.g. without numpy; ours is the last, single line)
        assert out.stderr.splitlines()[-1] == (
            "ddpkit: error: RANK=2 must be < WORLD_SIZE=2; the launcher's "
            "variables disagree (a stale export in your shell or sbatch script?)"
        )
        assert sum(line.startswith("ddpkit:") for line in out.stderr.splitlines()) == 1
        assert out.stdout == ""
