"""The time budget as pyrecover-train wires it (slurmclock): stop signals armed before torch is
imported, SLURM's warning read as information when its lead is known, the budget's figures in
every checkpoint and back on resume, the final save marked in the job's timeline for the next
allocation's exit estimate, and the start-up cost measured in parts."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_helpers import child_env, events, start_cli, tiny_flags, wait_for_step

import slurmclock
from pyrecover_train import build
from pyrecover_train.config import config_from_args
from pyrecover_train.report import format_summary, summarize
from pyrecover_train.startup import PARTS, Startup, cpu_wait_seconds

STEPS = 12


def flags(corpus: Path, cache_dir: Path, ckpt: Path, *extra: str) -> list[str]:
    return tiny_flags(
        corpus, cache_dir, ckpt, "--training-steps", str(STEPS), "--checkpoint-frequency", "4",
        *extra,
    )  # fmt: skip


def one(evs: list[dict], kind: str) -> dict:
    found = [e for e in evs if e["event"] == kind]
    assert len(found) == 1, found
    return found[0]


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pyrecover_train", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


# -- signals during start-up ------------------------------------------------------------------


def _torch_loaded(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
@pytest.mark.parametrize(
    ("sig", "lead", "want"),
    [
        (signal.SIGUSR2, "300", (0, "done")),  # SLURM's warning: information, trains on
        (signal.SIGTERM, "300", (75, "signal")),  # stop now: saves and exits 75
    ],
    ids=["USR2", "TERM"],
)
def test_a_signal_while_torch_is_still_imported_is_read_not_fatal(
    sig: signal.Signals,
    lead: str,
    want: tuple[int, str],
    corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
) -> None:
    """SLURM's warning comes at once in a job shorter than its lead, maybe while the trainer is
    still importing torch, when the default action of SIGUSR2 (and SIGTERM) kills the process.
    The command line arms flag-only handlers before it imports torch: the signal is sent as
    soon as torch's library is mapped into the process (the import runs on for a second)."""
    ckpt = tmp_path / "ckpt"
    metrics = ckpt / "default-exp" / "metrics.jsonl"
    proc = start_cli(flags(corpus, cache_dir, ckpt), env=child_env(PYRECOVER_SIGNAL_LEAD=lead))
    try:
        end = time.monotonic() + 60
        while not _torch_loaded(proc.pid):
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()[0]
            time.sleep(0.001)
        proc.send_signal(sig)
        sent_before_start = not metrics.exists()
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sent_before_start  # the run had not started: it was still importing
    evs = events(ckpt)
    stop = one(evs, "stop")
    assert (proc.returncode, stop["cause"]) == want, out
    assert stop["signal"] == sig.name, stop
    if sig == signal.SIGUSR2:
        # No deadline but the warning's: the end is its receipt + the lead, far away.
        assert one(evs, "start")["budget"]["deadline_source"] == "signal", out
        assert stop["step"] == STEPS
    else:
        assert "stopping early (stop: received SIGTERM" in out
        saved = [e["step"] for e in evs if e["event"] == "saved"]
        assert saved and saved[-1] == stop["step"]  # nothing lost: the stop step is durable


@pytest.mark.parametrize(
    ("lead", "want"), [("300", (0, "done")), ("0", (75, "time"))], ids=["lead300", "lead0"]
)
def test_a_warning_with_a_known_lead_moves_the_deadline_it_does_not_stop(
    lead: str, want: tuple[int, str], corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """A SIGUSR2 mid-run, with PYRECOVER_SIGNAL_LEAD as the sbatch script exports it: the end
    is LEAD seconds away. 300 s: more than the run needs, it finishes; 0 s: the end is now,
    the run stops for *time* (exit 75), with the warning named in the reason."""
    ckpt = tmp_path / "ckpt"
    metrics = ckpt / "default-exp" / "metrics.jsonl"
    args = flags(corpus, cache_dir, ckpt, "--time-limit", "1h")
    proc = start_cli(args, env=child_env(PYRECOVER_SIGNAL_LEAD=lead))
    try:
        wait_for_step(proc, metrics, 0, 3)
        proc.send_signal(signal.SIGUSR2)
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stop = one(events(ckpt), "stop")
    assert (proc.returncode, stop["cause"]) == want, out
    assert stop["signal"] == "SIGUSR2"
    if lead == "0":
        assert "(deadline: SIGUSR2 + lead 0.00 s)" in stop["reason"], stop
        assert "using the earlier end" in out  # SLURM's own end time was later: said once


# -- the budget's figures travel with the checkpoints -----------------------------------------


def test_the_budget_figures_are_in_every_checkpoint_and_back_on_resume(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    import ckptstore

    ckpt = tmp_path / "ckpt"
    assert run(flags(corpus, cache_dir, ckpt, "--training-steps", "8"), child_env()).returncode == 0
    store = ckptstore.CheckpointStore(str(ckpt), experiment="default-exp")
    try:
        state = store.manifest("latest").metadata["time_budget"]
        earlier = store.manifest(4).metadata["time_budget"]
    finally:
        store.close()
    assert state["version"] == 1 and len(state["steps"]) == 8 - 2  # minus 2 warm-up steps
    assert len(state["saves"]) == 1 and len(earlier["saves"]) == 0  # durable by then: step 4's
    again = [*flags(corpus, cache_dir, ckpt), "--resume-from-checkpoint", "latest"]
    resumed = run(again, child_env())
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    start = [e for e in events(ckpt) if e["event"] == "start"][-1]
    # Before this run measured anything, the budget knows the earlier run's steps and saves.
    assert start["budget"]["step_estimate"] == pytest.approx(max(state["steps"]))
    assert start["budget"]["save_estimate"] is not None
    assert start["budget"]["steps_measured"] == 0 and start["budget"]["saves_measured"] == 0


def test_a_malformed_budget_state_costs_first_guesses_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = config_from_args(["--default-ckpt-time", "7"])
    flag = slurmclock.AnyFlag(slurmclock.StopSignals(("USR2",)))
    model = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="pyrecover_train"):
        budget = build.budget(cfg, model, flag, resumed={"time_budget": {"version": 99}})
    assert "the checkpoint's time budget figures are not used: time budget state version 99" in (
        caplog.text
    )
    assert budget.save_estimate is None and budget.config.initial_save_estimate == 7.0
    good = {"version": 1, "steps": [0.5], "saves": [2.0], "exits": []}
    loaded = build.budget(cfg, model, flag, resumed={"time_budget": good})
    assert loaded.step_estimate == 0.5 and loaded.save_estimate is not None
    assert build.budget(cfg, model, flag, resumed={}).save_estimate is None  # fresh start


def test_defaults_measure_the_margin_and_stop_margin_overrides_it() -> None:
    flag = slurmclock.AnyFlag(slurmclock.StopSignals(("USR2",)))
    model = torch.nn.Linear(2, 2)
    measured = build.budget(config_from_args([]), model, flag)
    assert measured.config.margin is None and measured.timeline is not None
    fixed = build.budget(config_from_args(["--stop-margin", "1m"]), model, flag)
    assert fixed.config.margin == 60.0


def test_the_final_save_marks_the_job_timeline_and_the_next_run_keeps_that_exit_free(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """In a SLURM job (here: its variables, no SLURM) the final save marks `saved` in the job's
    timeline; the batch script marks `exited`; the next allocation (restart 1) reads what its
    exit took and keeps 1.25 x that free, instead of the 10 s first guess."""
    ckpt, timelines = tmp_path / "ckpt", tmp_path / "timelines"
    job = {
        "SLURM_JOB_ID": "4242",
        "SLURMCLOCK_DIR": str(timelines),
        "PYRECOVER_END_TIME": str(time.time() + 3600),  # no squeue: no controller here
        "SLURM_JOB_START_TIME": str(int(time.time())),
    }
    first = run(flags(corpus, cache_dir, ckpt, "--training-steps", "6"), child_env(**job))
    assert first.returncode == 0, first.stdout + first.stderr
    time.sleep(0.3)  # the exit: process teardown, srun, the script's requeue
    clock = [sys.executable, "-m", "slurmclock", "mark", "exited", "rc=75"]
    assert subprocess.run(clock, env=child_env(**job), check=False).returncode == 0
    lines = [json.loads(x) for x in (timelines / "job-4242.jsonl").read_text().splitlines()]
    durable = [e["step"] for e in lines if e["event"] == "checkpoint"]
    assert durable and durable[-1] == 6, lines  # every durable save, the final one last
    lines = [e for e in lines if e["event"] != "checkpoint"]
    # first_step: the supervisor's measure of a restart's start-up (see slurmclock's TimeLoop)
    assert [e["event"] for e in lines] == ["first_step", "saved", "exited"], lines
    exit_s = lines[2]["time"] - lines[1]["time"]  # saved -> exited

    again = flags(corpus, cache_dir, ckpt, "--resume-from-checkpoint", "latest")
    second = run(again, child_env(**job, SLURM_RESTART_COUNT="1"))
    assert second.returncode == 0, second.stdout + second.stderr
    budget = [e for e in events(ckpt) if e["event"] == "start"][-1]["budget"]
    assert budget["exits_measured"] == 1
    assert budget["exit_estimate"] == pytest.approx(1.25 * exit_s, abs=0.01)
    assert "exit (measured) + 2 s slack" in second.stdout


# -- start-up -----------------------------------------------------------------------------------


def test_startup_parts_from_the_allocation_start() -> None:
    now = [1000.0]
    s = Startup(origin=1000.0, clock=lambda: now[0])
    for part, seconds in (("imports", 2.0), ("setup", 0.5), ("data", 0.25), ("first step", 1.0)):
        now[0] += seconds
        s.mark(part)
    assert s.seconds() == 3.75 and s.parts()["imports"] == 2.0
    s.allocation = slurmclock.AllocationStart(998.0, "squeue")  # 2 s of batch script and srun
    assert list(s.parts()) == ["launch", "imports", "setup", "data", "first step"]
    assert s.parts()["launch"] == 2.0 and s.seconds() == 5.75
    assert s.describe().startswith("5.8 s from the allocation start (squeue): launch 2.0 s")
    s.allocation = slurmclock.AllocationStart(1000.5, "squeue")  # whole seconds: never after
    assert s.parts()["launch"] == 0.0 and s.start == 1000.0
    with pytest.raises(ValueError, match="unknown start-up part 'lunch'"):
        s.mark("lunch")


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (b"284333 2500000000 2\n", 2.5),  # cpu ns, run delay ns, time slices
        (b"1 0 1\n", 0.0),
        (b"1\n", None),  # a kernel that keeps no run delay
        (b"", None),
        (b"x y z\n", None),
        (b"1 -5 1\n", None),
    ],
)
def test_cpu_wait_reads_the_kernels_run_delay(tmp_path: Path, text: bytes, want: float) -> None:
    path = tmp_path / "schedstat"
    path.write_bytes(text)
    assert cpu_wait_seconds(str(path)) == want
    assert cpu_wait_seconds(str(tmp_path / "absent")) is None


@pytest.mark.skipif(cpu_wait_seconds() is None, reason="this kernel keeps no schedstat")
def test_cpu_wait_counts_the_time_another_process_held_the_cpu() -> None:
    """Two busy processes on one CPU: the kernel counts the seconds this one was kept off it.
    The cost of spinning is bounded by CPU seconds, so it holds on a busy machine too."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    before_affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        spin = (
            f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\n"
            "end = time.process_time() + 3\nwhile time.process_time() < end: pass"
        )
        rival = subprocess.Popen([sys.executable, "-c", spin])
        try:
            time.sleep(0.3)  # the rival is spinning
            waited = cpu_wait_seconds()
            end = time.process_time() + 0.5  # half a CPU second of our own, shared with it
            while time.process_time() < end:
                pass
            waited = cpu_wait_seconds() - waited  # type: ignore[operator]
        finally:
            rival.kill()
            rival.wait()
    finally:
        os.sched_setaffinity(0, before_affinity)
    assert waited >= 0.2, f"waited {waited:.3f} s for a CPU shared with a spinning rival"

    now = [0.0]
    s = Startup(origin=0.0, clock=lambda: now[0], cpu_wait=lambda: 25.3)
    now[0] = 37.3
    s.mark("first step")
    assert s.event()["cpu_wait"] == 25.3
    assert s.describe().endswith("; 25.3 s of it waiting for a CPU (the node is busy)")
    s = Startup(origin=0.0, clock=lambda: now[0], cpu_wait=lambda: 0.4)
    s.mark("first step")
    assert "waiting for a CPU" not in s.describe()  # a quiet node says nothing


def test_startup_carves_torch_compile_out_of_the_first_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.compile compiles inside the first step: dynamo's timers say how long, and that
    part is reported as "compile" (what a warm compile cache saves), the rest as the step."""
    import pyrecover_train.startup as startup_mod

    now, compiled = [0.0], [5.0]  # 5 s compiled before this run (another run in the process)
    monkeypatch.setattr(startup_mod, "compile_seconds", lambda: compiled[0])
    s = Startup(origin=0.0, clock=lambda: now[0], compiled_before=5.0)
    now[0] = 1.0
    s.mark("imports")
    now[0], compiled[0] = 11.0, 12.0  # a 10 s first step, 7 s of it compiling
    s.mark("first step")
    assert s.parts() == {"imports": 1.0, "compile": 7.0, "first step": 3.0}
    assert s.seconds() == 11.0
    with pytest.raises(ValueError, match="unknown start-up part 'compile'"):
        s.mark("compile")


def test_startup_is_measured_said_and_reported(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    r = run(flags(corpus, cache_dir, ckpt, "--training-steps", "3"), child_env())
    assert r.returncode == 0, r.stdout + r.stderr
    evs = events(ckpt)
    startup = one(evs, "startup")
    assert startup["since"] == "process start"
    assert list(startup["parts"]) == [p for p in PARTS if p not in ("launch", "compile")]
    assert 0 < startup["seconds"] < 60
    assert sum(startup["parts"].values()) == pytest.approx(startup["seconds"], abs=0.01)
    assert startup["cpu_wait"] is None or 0 <= startup["cpu_wait"] <= startup["seconds"]
    assert "  start-up:    " in r.stdout and "first step done " in r.stdout
    summary = summarize(evs)
    assert summary.startup_s_max == startup["seconds"]
    assert "start-up to the first step" in format_summary(summary)
    # The report counts the wall time from the process start, before the first event.
    assert summary.runs[0].started <= one(evs, "start")["time"] - startup["parts"]["imports"]


def test_async_saves_reserve_their_snapshot_buffer_after_the_first_step(
    corpus: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With async saves the store allocates the snapshot buffer in the background once the
    optimizer has its moments, not in the first save; the default on CPU is blocking saves."""
    import ckptstore
    from pyrecover_train.cli import main

    reserved: list[dict] = []
    real = ckptstore.CheckpointStore.reserve

    def spy(self: ckptstore.CheckpointStore, state: dict) -> None:
        reserved.append(state)
        real(self, state)

    monkeypatch.setattr(ckptstore.CheckpointStore, "reserve", spy)
    argv = flags(corpus, cache_dir, tmp_path / "a", "--training-steps", "5", "--async-checkpoint")
    assert main(argv) == 0
    ((state,),) = [reserved]
    assert state["optim"].state  # AdamW's moments exist: the buffer has their size too
    saves = [e for e in events(tmp_path / "a") if e["event"] == "save"]
    assert [e["async"] for e in saves] == [True, False]  # periodic async, the final blocking
    reserved.clear()
    assert main(flags(corpus, cache_dir, tmp_path / "b", "--training-steps", "5")) == 0
    assert reserved == []
    assert not any(e["async"] for e in events(tmp_path / "b") if e["event"] == "save")


def test_async_periodic_saves_are_timed_apart_from_the_final_save(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """A periodic async save is written while training goes on: the budget records it as a
    background save, so it cannot inflate the final (blocking) save's bound; with blocking saves
    only, both bounds come from the same saves."""
    from pyrecover_train.cli import main

    common = ("--training-steps", "5", "--checkpoint-frequency", "2")
    assert main([*flags(corpus, cache_dir, tmp_path / "a", *common), "--async-checkpoint"]) == 0
    budget = one(events(tmp_path / "a"), "stop")["budget"]
    assert budget["saves_measured"] == 3  # steps 2 and 4 in the background, 5 blocking
    assert budget["background_save_estimate"] != budget["save_estimate"]
    assert main(flags(corpus, cache_dir, tmp_path / "b", *common)) == 0
    budget = one(events(tmp_path / "b"), "stop")["budget"]
    assert budget["saves_measured"] == 3
    assert budget["background_save_estimate"] == budget["save_estimate"]  # none in background
