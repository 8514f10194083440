"""A stop source of one's own (a file to watch, a cloud's preemption notice) is one more flag in
``session.stop_flag``: the wait at the rendezvous and the training loop both read it."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from train_helpers import child_env, events, tiny_flags

# pyrecover-train with a source that is raised from the start ("NOTICE": not a signal's name).
RUN_WITH_A_SOURCE = """
import sys
import slurmclock
from pyrecover_train import session
from pyrecover_train.cli import main

class Notice:
    requested = True
    received = "NOTICE"
    arrivals = [("NOTICE", 0.0)]

session.stop_flag = lambda signals, cfg: slurmclock.AnyFlag(signals, Notice())
sys.exit(main(sys.argv[1:]))
"""


def _run(args: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RUN_WITH_A_SOURCE, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(**env),
    )


def test_the_loop_stops_on_the_source(corpus: Path, cache_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    out = _run([*tiny_flags(corpus, cache_dir, ckpt), "--training-steps", "50"])
    assert out.returncode == 75, out.stdout + out.stderr
    stop = [e for e in events(ckpt) if e["event"] == "stop"][-1]
    assert stop["cause"] == "signal" and "NOTICE" in stop["reason"], stop
    assert [e["step"] for e in events(ckpt) if e["event"] == "saved"][-1] == stop["step"]


def test_the_source_ends_the_wait_at_the_rendezvous(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Rank 0 of 2; rank 1 never starts. The source ends the wait: exit 128 + SIGTERM (the
    source has no signal number of its own), one line, nothing written."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ckpt = tmp_path / "ckpt"
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    out = _run(  # not waiting for the rendezvous timeout (30 min): the source ends it at once
        [*tiny_flags(corpus, cache_dir, ckpt), "--distributed"],
        timeout=120,
        **torchrun,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    assert out.returncode == 128 + 15, out.stdout + out.stderr
    assert "stopped waiting at the rendezvous" in out.stderr, out.stderr
    assert not ckpt.exists()
