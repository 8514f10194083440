"""Every wait on SLURM's commands has a bound derived from the time left, and a stop signal
ends it within seconds (issue 34). The commands are real processes: fake ``scontrol``,
``squeue``, ``sbatch``, ... on PATH that hang (``exec sleep``), say slurmctld is busy
(transient: tried again within the bound) or refuse (permanent: said once). The supervisor
runs as ``slurmclock supervise`` under each fault at each moment (fault x moment), all cases
at once, so the table costs the time of its slowest case."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from slurmclock.commands import CommandError, SubprocessRunner, command_bound, transient
from slurmclock.job import JobState, JobView, Node
from slurmclock.supervisor import SuperviseConfig, Supervisor
from slurmclock.supervisor.nodestates import NodeStates

COMMANDS = ("scontrol", "squeue", "sbatch", "scancel", "sinfo", "srun", "sacct")
FAKE = """#!/bin/sh
echo "{name} $*" >> "$FAKE_LOG"
case "$FAKE_SLURM" in
  hang) exec sleep 120 ;;
  refused) echo "{name}: error: Invalid job id specified" >&2; exit 1 ;;
  transient) echo "{name}: error: Socket timed out on send/recv operation" >&2; exit 1 ;;
esac
"""
STEP = """import pathlib, sys, time
pathlib.Path(sys.argv[1]).write_text("started")
time.sleep(float(sys.argv[2]))
sys.exit(int(sys.argv[3]))
"""


def fake_bin(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in COMMANDS:
        path = folder / name
        path.write_text(FAKE.format(name=name))
        path.chmod(0o755)
    return folder


# -- the bound, the classification, the runner ---------------------------------------------


@pytest.mark.parametrize(
    "left, ceiling, expect",
    [
        (None, 30.0, 30.0),  # no deadline known: the ceiling
        (3600.0, 30.0, 30.0),  # plenty of time
        (120.0, 30.0, 12.0),  # a tenth of the time left
        (10.0, 30.0, 3.0),  # never under the floor ...
        (-5.0, 30.0, 3.0),  # ... also past the deadline
        (10.0, 2.0, 2.0),  # ... nor over the ceiling
        (float("inf"), 30.0, 30.0),
    ],
)
def test_command_bound(left: float | None, ceiling: float, expect: float) -> None:
    assert command_bound(left, ceiling=ceiling) == pytest.approx(expect)


@pytest.mark.parametrize(
    "kind, code, stderr, expect",
    [
        ("timeout", None, "", True),
        ("failed", 1, "squeue: error: Socket timed out on send/recv operation", True),
        ("failed", 1, "Unable to contact slurm controller (connect failure)", True),
        ("failed", 1, "scontrol: error: Invalid job id specified", False),
        ("failed", 1, "Access/permission denied", False),
        ("failed", -9, "Socket timed out", False),  # killed: not slurmctld's answer
        ("missing", None, "", False),
        ("output", None, "", False),
        ("error", None, "", False),
    ],
)
def test_transient_or_permanent(kind: str, code: int | None, stderr: str, expect: bool) -> None:
    e = CommandError(["squeue"], kind, stderr or kind, returncode=code, stderr=stderr)
    assert transient(e) is expect


def runner_env(tmp_path: Path, fault: str) -> dict[str, str]:
    bin_dir = fake_bin(tmp_path / "bin")
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return {"PATH": path, "FAKE_SLURM": fault, "FAKE_LOG": str(tmp_path / "calls.log")}


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize(
    "fault, tries", [("transient", lambda n: n >= 2), ("refused", lambda n: n == 1)]
)
def test_transient_is_tried_again_within_the_bound(tmp_path: Path, fault: str, tries) -> None:
    runner = SubprocessRunner(runner_env(tmp_path, fault), bound=lambda: 2.0, cancel=lambda: False)
    began = time.monotonic()
    with pytest.raises(CommandError) as got:
        runner(["squeue", "-j", "7"], 30.0)
    assert time.monotonic() - began < 2.0 + 1.0  # the bound, not the caller's 30 s
    assert got.value.kind == "failed" and tries(len(calls(tmp_path)))
    # still busy when the bound ran out: no answer (the supervisor shortens the next ones)
    assert (runner.last_unanswered is not None) is (fault == "transient")


def test_cancel_ends_the_pause_between_tries(tmp_path: Path) -> None:
    stop = threading.Event()
    env = runner_env(tmp_path, "transient")
    runner = SubprocessRunner(env, bound=lambda: 60.0, cancel=stop.is_set)
    threading.Timer(1.0, stop.set).start()  # in the 1 s or 2 s pause, not a command
    began = time.monotonic()
    with pytest.raises(CommandError, match="Socket timed out"):
        runner(["squeue", "-j", "7"], 60.0)
    assert time.monotonic() - began < 1.0 + 1.0


def test_a_hung_command_ends_at_its_bound(tmp_path: Path) -> None:
    runner = SubprocessRunner(runner_env(tmp_path, "hang"), bound=lambda: 0.5, cancel=lambda: False)
    began = time.monotonic()
    with pytest.raises(CommandError, match="timed out after 0.5 s") as got:
        runner(["scontrol", "show", "job", "7"], 30.0)
    assert got.value.kind == "timeout" and runner.last_unanswered is not None
    assert time.monotonic() - began < 0.5 + 1.0


def test_cancel_ends_a_hung_command_at_once(tmp_path: Path) -> None:
    stop = threading.Event()
    runner = SubprocessRunner(runner_env(tmp_path, "hang"), cancel=stop.is_set)
    threading.Timer(0.3, stop.set).start()
    began = time.monotonic()
    with pytest.raises(CommandError, match="abandoned: a stop signal came"):
        runner(["sbatch", "job.sh"], 60.0)
    assert time.monotonic() - began < 0.3 + 1.0
    assert runner.last_unanswered is None  # abandoned, not timed out


def test_the_supervisor_derives_the_bound_from_the_deadline() -> None:
    now = [1_000.0]
    sup = Supervisor(
        SuperviseConfig(command_timeout=30.0),
        env={},
        runner=SubprocessRunner({}),
        clock=lambda: now[0],
    )
    assert sup._command_bound() == 30.0  # no deadline known yet
    sup._end_at = 1_000.0 + 120.0
    assert sup._command_bound() == pytest.approx(12.0)
    now[0] += 110.0  # 10 s left
    assert sup._command_bound() == pytest.approx(3.0)
    sup._signal_at = time.monotonic()  # a signal: KillWait runs
    assert sup._command_bound() == pytest.approx(3.0)  # 10 s left: still the floor
    sup._end_at = None
    assert sup._command_bound() == pytest.approx(5.0)
    runner = sup.scheduler.runner  # type: ignore[attr-defined]
    runner.last_unanswered = time.monotonic()  # slurmctld hangs since the signal
    assert sup._command_bound() == pytest.approx(1.0)


# -- the supervisor: fault x moment, all at once --------------------------------------------


@dataclass(frozen=True)
class Case:
    fault: str  # what every SLURM command does: hang, transient, refused
    moment: str  # start (a command in flight), step (the step runs), exit (the step exits 75)

    @property
    def id(self) -> str:
        return f"{self.fault}-{self.moment}"


CASES = [Case(f, m) for f in ("hang", "transient", "refused") for m in ("start", "step", "exit")]


@dataclass
class Result:
    seconds: float  # from the moment (the signal, or the step's exit) to the supervisor's end
    rc: int
    log: str
    calls: list[str]


def _launch(case: Case, folder: Path) -> tuple[subprocess.Popen[bytes], Path]:
    env = runner_env(folder, case.fault)
    env.update(
        HOME=str(folder),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="1",
        SLURM_CLUSTER_NAME="fake",
        SLURMCLOCK_DIR=str(folder / "timelines"),
        PYTHONPATH=os.pathsep.join(sys.path),
    )
    if case.moment == "start":  # its node list is read before the step: a command in flight
        env["SLURM_JOB_NODELIST"] = "n1"
    (folder / "step.py").write_text(STEP)
    marker = folder / "started"
    argv = [sys.executable, str(folder / "step.py"), str(marker)]
    argv += ["0", "75"] if case.moment == "exit" else ["60", "0"]
    # SLURM's commands get 30 s each, but a signal shortens that; at the step's exit no signal
    # comes and no deadline is known: --timeout itself bounds them.
    timeout = "3" if case.moment == "exit" else "30"
    out = open(folder / "job.log", "wb")  # noqa: SIM115 - closed once the process ends
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurmclock", "supervise", "--timeout", timeout, "--", *argv],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=folder,
    )
    out.close()
    return proc, marker


def _moment_came(case: Case, folder: Path, marker: Path) -> bool:
    if case.moment == "start":
        return any("show hostnames" in c for c in calls(folder))
    return marker.exists()


def _run_all(root: Path) -> dict[str, Result]:
    started = {c.id: (c, root / c.id) for c in CASES}
    procs = {}
    for key, (case, folder) in started.items():
        folder.mkdir(parents=True)
        procs[key] = _launch(case, folder)
    moments: dict[str, float] = {}
    ended: dict[str, float] = {}
    give_up = time.monotonic() + 120
    while len(ended) < len(procs) and time.monotonic() < give_up:
        for key, (proc, marker) in procs.items():
            case, folder = started[key]
            if key not in moments and _moment_came(case, folder, marker):
                moments[key] = time.monotonic()
                if case.moment != "exit":
                    proc.send_signal(signal.SIGTERM)
            if key not in ended and proc.poll() is not None:
                ended[key] = time.monotonic()
        time.sleep(0.05)
    results = {}
    for key, (proc, _) in procs.items():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            ended[key] = float("inf")
        folder = started[key][1]
        seconds = ended[key] - moments.get(key, ended[key])
        log = (folder / "job.log").read_text(errors="replace")
        results[key] = Result(seconds, proc.returncode, log, calls(folder))
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Result]]:
    yield _run_all(tmp_path_factory.mktemp("bounds"))


def _python_start_s() -> float:
    began = time.monotonic()
    subprocess.run([sys.executable, "-c", "import slurmclock"], check=True)
    return time.monotonic() - began


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_wait_ends_in_seconds(outcomes: dict[str, Result], case: Case) -> None:
    got = outcomes[case.id]
    # After a signal: 5 s for the first command, 1 s for each after one went unanswered (not
    # --timeout's 30 s); at the step's exit (no signal) the requeue's commands have --timeout 3
    # each. A few commands each, and the machine's own pace (a Python start) between them.
    allowed = (10.0 if case.moment != "exit" else 12.0) + 10 * _python_start_s()
    assert got.seconds < allowed, (case, got.seconds, got.log)
    assert "Traceback" not in got.log, got.log
    if case.fault == "hang" and case.moment == "start":  # in flight when SIGTERM came
        assert "show hostnames n1` was abandoned: a stop signal came" in got.log, got.log
    again = [a for a, b in zip(got.calls, got.calls[1:], strict=False) if a == b]  # retries
    if case.fault == "refused":  # permanent: said once, never tried again
        assert again == [] and "Invalid job id specified" in got.log, got.calls
    if case.fault == "transient":  # tried again within the bound
        assert again and "Socket timed out" in got.log, got.calls


def test_the_node_state_look_asks_the_bound_at_each_look() -> None:
    asked: list[float] = []

    class Record:  # a scheduler that only notes each command's timeout
        def show_job(self, job: str, *, timeout: float) -> JobView:
            asked.append(timeout)
            return JobView(state=JobState.ACTIVE, nodes="n1", partition="p")

        def hostnames(self, nodelist: str, *, timeout: float) -> list[str]:
            asked.append(timeout)
            return ["n1"]

        def nodes(self, partition: str, *, timeout: float) -> list[Node]:
            asked.append(timeout)
            return []

        def node_starts(self, nodes: list[str], *, timeout: float) -> dict[str, str]:
            asked.append(timeout)
            return {}

    bounds = iter([12.0, 3.0])
    states = NodeStates(Record(), "7", lambda: next(bounds), print, print)  # type: ignore[arg-type]
    states.read(["n1"])
    states.read(["n1"])
    assert asked == [12.0] * 4 + [3.0] * 4
