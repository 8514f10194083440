"""Issue 14: a rank waiting at the rendezvous for a missing peer stops on SIGTERM / Ctrl-C at
once, with one line, also when the caller installed flag-only handlers first (real processes)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ddpkit import InitInterrupted, init
from ddpkit.rendezvous import StopWatch

CHILD = Path(__file__).with_name("_rendezvous_child.py")
# Generous bounds for a loaded 2-core box; the wait itself polls ten times a second.
START_S, STOP_S = 120.0, 10.0


def start_waiting(launch: Any, tmp_path: Path, rank: int, handlers: str) -> subprocess.Popen[str]:
    marker = tmp_path / "polling"
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(rank), str(launch.free_port()), str(marker), handlers],
        env=launch.clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + START_S
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the child never started waiting (rc {proc.returncode}): {out} {err}")
        time.sleep(0.05)
    return proc


def stop(proc: subprocess.Popen[str], sig: int) -> tuple[dict[str, Any], str, float]:
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=STOP_S * 3)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    elapsed = time.monotonic() - t0
    assert out.strip(), f"no result line; rc {proc.returncode}, stderr: {err}"
    return json.loads(out.strip().splitlines()[-1]), err, elapsed


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_rank_zero_waiting_for_a_peer_stops_on_a_signal(
    sig: int, launch: Any, tmp_path: Path
) -> None:
    proc = start_waiting(launch, tmp_path, rank=0, handlers="none")
    rec, err, elapsed = stop(proc, sig)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, err
    assert elapsed < STOP_S, f"took {elapsed:.1f} s to stop"
    assert rec["error"].startswith("[rank 0/2] stopped waiting at the rendezvous at 127.0.0.1:")
    assert f"{name} received; 1 of 2 ranks arrived (rank 1 never did)" in rec["error"]
    assert "\n" not in rec["error"] and "Traceback" not in err
    assert rec["signum"] == sig
    assert rec["term_handler_restored"] and rec["int_handler_restored"]


def test_flag_only_handlers_still_set_their_flag_and_the_wait_ends(
    launch: Any, tmp_path: Path
) -> None:
    """pyrecover-train arms TERM/USR2 as flag-only handlers before init(): TERM still ends it."""
    proc = start_waiting(launch, tmp_path, rank=0, handlers="flags")
    rec, err, elapsed = stop(proc, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert elapsed < STOP_S
    assert "SIGTERM received" in rec["error"]
    assert rec["flags"] == {"TERM": True, "USR2": False}  # the caller's handler ran too
    assert rec["term_handler_restored"]


def test_abort_callable_ends_the_wait(launch: Any, tmp_path: Path) -> None:
    """USR2 is not a stop signal of init(); the caller's abort() (its USR2 flag) is."""
    proc = start_waiting(launch, tmp_path, rank=0, handlers="flags")
    rec, err, elapsed = stop(proc, signal.SIGUSR2)
    assert proc.returncode == 1, err
    assert elapsed < STOP_S
    assert "abort() is true; 1 of 2 ranks arrived (rank 1 never did)" in rec["error"]
    assert rec["signum"] is None and rec["flags"] == {"TERM": False, "USR2": True}


def test_worker_waiting_for_a_missing_rank_zero_stops_on_sigterm(
    launch: Any, tmp_path: Path
) -> None:
    proc = start_waiting(launch, tmp_path, rank=1, handlers="none")
    rec, err, elapsed = stop(proc, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert elapsed < STOP_S
    assert rec["error"].startswith("[rank 1/2] stopped waiting at the rendezvous")
    assert "SIGTERM received; nothing listens at 127.0.0.1:" in rec["error"]
    # The connect probes are plain sockets: no c10d stack traces on stderr while waiting.
    assert "socket.cpp" not in err and "TCPStore" not in err, err


def test_handlers_come_back_after_a_successful_init(launch: Any) -> None:
    def mine(signum: int, frame: object) -> None:
        pass

    before_int = signal.getsignal(signal.SIGINT)
    old = signal.signal(signal.SIGTERM, mine)
    try:
        env = launch.one_rank_env(launch.free_port())
        with init(env=env, distributed=True, timeout=20) as dist:
            assert dist.all_reduce(1.0, "sum") == 1.0
            assert signal.getsignal(signal.SIGTERM) is mine
            assert signal.getsignal(signal.SIGINT) is before_int
    finally:
        signal.signal(signal.SIGTERM, old)


def test_stopwatch_records_chains_and_ignores_sig_ign() -> None:
    seen: list[int] = []
    old_term = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    old_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopWatch(("TERM", "HUP")) as watch:
            assert watch.stopped() is None
            signal.raise_signal(signal.SIGHUP)  # ignored on purpose: stays ignored
            assert watch.stopped() is None
            signal.raise_signal(signal.SIGTERM)
            assert watch.stopped() == "SIGTERM received"
        assert seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGHUP, old_hup)


def test_bad_stop_arguments_are_refused() -> None:
    from ddpkit import DistConfigError

    with pytest.raises(DistConfigError, match="'TERMINATE' is not a signal name"):
        init(env={}, stop_signals=("TERMINATE",))
    with pytest.raises(DistConfigError, match="abort=True must be a callable"):
        init(env={}, abort=True)  # type: ignore[arg-type]
    assert issubclass(InitInterrupted, RuntimeError)
