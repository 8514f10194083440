"""StopSignals: the handler only raises a flag; chaining and restoring previous handlers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from types import FrameType

import pytest

from slurmclock import StopSignals, signal_number


@pytest.fixture(autouse=True)
def _keep_handlers() -> Iterator[None]:
    """Whatever a test does, the process's handlers are as before afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_signal_names_numbers_and_enums() -> None:
    assert signal_number("USR2") is signal.SIGUSR2
    assert signal_number("sigterm") is signal.SIGTERM
    assert signal_number(int(signal.SIGUSR1)) is signal.SIGUSR1
    assert signal_number(signal.SIGINT) is signal.SIGINT
    with pytest.raises(ValueError, match="unknown signal 'USR3'; use a name like"):
        signal_number("USR3")
    with pytest.raises(ValueError, match="not a signal number"):
        signal_number(12345)
    with pytest.raises(TypeError):
        signal_number(1.5)  # type: ignore[arg-type]


def test_uncatchable_or_no_signals_are_refused() -> None:
    with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
        StopSignals(("KILL",))
    with pytest.raises(ValueError, match="at least one signal"):
        StopSignals(())


def test_default_is_usr2_and_term() -> None:
    assert StopSignals().signals == (signal.SIGUSR2, signal.SIGTERM)


def test_a_signal_raises_the_flag_and_nothing_else() -> None:
    with StopSignals() as stop:
        assert not stop.requested and stop.received is None
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.wait(timeout=10)  # delivery to the main thread is prompt, not instant
        assert stop.requested and stop.received == "SIGUSR2" and stop.count == 1
        assert stop.received_at is not None
        os.kill(os.getpid(), signal.SIGTERM)  # the process survives SIGTERM
        stop.wait(timeout=0)
        for _ in range(1000):
            if stop.count == 2:
                break
            stop.wait(timeout=0.01)
        assert stop.count == 2 and stop.received == "SIGUSR2"  # the first one is kept
    stop.reset()
    assert not stop.requested and stop.count == 0


def test_previous_python_handler_is_chained_and_restored() -> None:
    seen: list[int] = []

    def previous(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    signal.signal(signal.SIGUSR2, previous)
    stop = StopSignals(("USR2",)).install()
    assert stop.install() is stop  # idempotent
    assert signal.getsignal(signal.SIGUSR2) == stop._handle
    os.kill(os.getpid(), signal.SIGUSR2)
    stop.wait(timeout=10)
    assert stop.requested and seen == [signal.SIGUSR2]
    stop.restore()
    assert signal.getsignal(signal.SIGUSR2) is previous
    assert not stop.installed


def test_chain_false_does_not_call_the_previous_handler() -> None:
    seen: list[int] = []
    signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    with StopSignals(("USR1",), chain=False) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        stop.wait(timeout=10)
    assert stop.received == "SIGUSR1" and seen == []


def test_default_action_is_not_chained_and_comes_back() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)  # default action: terminate
    with StopSignals(("USR2",)) as stop:
        os.kill(os.getpid(), signal.SIGUSR2)
        stop.wait(timeout=10)
        assert stop.requested  # and we are still alive
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def test_install_outside_the_main_thread_says_why() -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            StopSignals().install()
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


def test_request_without_a_signal() -> None:
    stop = StopSignals()
    stop.request("rank 3 asked to stop")
    assert stop.requested and stop.received == "rank 3 asked to stop"
    assert "rank 3" in repr(stop)


def test_wait_times_out_without_a_signal() -> None:
    assert StopSignals().wait(timeout=0.05) is False


def test_a_real_process_finishes_its_step_after_sigterm(tmp_path: os.PathLike[str]) -> None:
    """A child that would die on SIGTERM instead ends its 'step' and exits cleanly."""
    code = textwrap.dedent(
        """
        import sys, time
        from slurmclock import StopSignals
        stop = StopSignals().install()
        print("ready", flush=True)
        steps = 0
        while not stop.requested:
            time.sleep(0.01)
            steps += 1
        print("stopped by", stop.received, "after", steps, "steps", flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert out.startswith("stopped by SIGTERM after")


def test_every_arrival_is_kept_with_its_time() -> None:
    now = [100.0]
    with StopSignals(("USR2", "TERM"), clock=lambda: now[0]) as stop:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.wait(timeout=10)
        now[0] = 160.0
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(200):
            if stop.count == 2:
                break
            stop.wait(timeout=0.05)
    assert stop.arrivals == [("SIGUSR2", 100.0), ("SIGTERM", 160.0)]
    assert (stop.received, stop.received_at) == ("SIGUSR2", 100.0)  # the first one
    stop.reset()
    assert stop.arrivals == [] and not stop.requested


@pytest.mark.parametrize(
    ("kw", "message"),
    [({"timeout": float("nan")}, "timeout"), ({"timeout": 1.0, "interval": 0}, "interval")],
)
def test_wait_refuses_bad_numbers(kw: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=f"{message} must be a finite number of seconds"):
        StopSignals().wait(**kw)
