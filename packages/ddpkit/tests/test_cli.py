"""`python -m ddpkit`: info, check, hostlist; exit 2 with one line on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
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


@pytest.mark.parametrize("argv", [["frobnicate"], [], ["check", "--bogus"]])
def test_usage_error_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ddpkit") and err[0].endswith("--help)"), err


@pytest.mark.parametrize("nodelist", ["", "  "])
def test_an_empty_hostlist_is_an_error(capsys: pytest.CaptureFixture[str], nodelist: str) -> None:
    assert main(["hostlist", nodelist]) == 2  # an unset $SLURM_JOB_NODELIST, most likely
    err = capsys.readouterr().err
    assert err.startswith("ddpkit: error: empty node list") and err.count("\n") == 1


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


def test_help_is_plain_text_with_examples() -> None:
    out = run(["--help"], {**__import__("os").environ})
    assert out.returncode == 0, out.stderr
    assert "``" not in out.stdout and "```" not in out.stdout  # issue 17: no raw markup
    assert "examples:\n  srun -n 4 ddpkit info" in out.stdout
    assert "143: SIGTERM" in out.stdout


def test_check_waiting_for_a_peer_exits_143_on_sigterm(launch: Any) -> None:
    """``ddpkit check`` as rank 0 of 2 with no rank 1: SIGTERM ends the wait with one line."""
    import signal
    import socket
    import time

    port = launch.free_port()
    env = launch.clean_env(**launch.one_rank_env(port, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "check"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:  # rank 0's store listens once init() waits (its handlers are on by then)
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("ddpkit: [rank 0/2] stopped waiting at the rendezvous at 127.0.0.1:")
    assert last.endswith("SIGTERM received; 1 of 2 ranks arrived (rank 1 never did)")
    assert "Traceback" not in err


def test_hostlist_into_a_closed_pipe_ends_quietly() -> None:
    """`ddpkit hostlist ... | head -1`: the reader left; exit 141 as with SIGPIPE, no traceback."""
    tool = Path(__file__).resolve().parents[3] / "tools" / "closedpipe.py"
    cmd = [sys.executable, str(tool), sys.executable, "-m", "ddpkit", "hostlist", "n[1-9999]"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 141, done.stderr
    assert done.stderr == ""
