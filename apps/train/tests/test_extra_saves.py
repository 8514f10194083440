"""Extra saves after a stop for time: the final save's bound keeps it safe, so it usually ends
early; the trainer trains on and saves again, and abandons (exits 75 at once) a save that is not
durable when the exit must begin. In subprocesses: the abandon ends the process.

Nothing here depends on how fast the machine is: the deadline is set once the run trains --
SLURM's warning signal, sent by the test, with its lead known (``PYRECOVER_SIGNAL_LEAD``), says
the end is LEAD seconds away -- and every timing allowance comes from the process's own speed
(:class:`OwnSpeed`: what its imports took). A CPU hog on a core, or a start-up of 20 s, changes
the steps it trains, not the outcome."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from train_helpers import OwnSpeed, child_env, events, final_state, run_cli, tiny_flags

MARGIN = 2.0  # --stop-margin: the exit must begin MARGIN s before the deadline
LEAD = 10.0  # the deadline comes this long after the warning (the final save takes ~4 s of it)


def flags(corpus: Path, cache: Path, ckpt: Path, *extra: str) -> list[str]:
    # A save estimate far above what a tiny model's save takes: the final save leaves ~4 s
    # unused, which the extra save spends. No periodic saves: the final one is measured alone.
    return tiny_flags(
        corpus,
        cache,
        ckpt,
        "--training-steps",
        "1000000",
        "--checkpoint-frequency",
        "1000000",
        "--default-ckpt-time",
        "4",
        "--stop-margin",
        str(MARGIN),
        *extra,
    )


# The trainer with a storage that hangs in the extra save's first file, after its temp file
# exists (a file system that stalls): what the abandon must survive. FINAL_SAVE_S slows the
# saves before it (the final one) down, which leaves the extra save seconds before its abandon.
# STALL_RANKS: the ranks that stall (the others wait for them in the save's collectives).
SLOW_EXTRA = """
import os, sys, time
from ckptstore.storage import local
from pyrecover_train import trainer
from pyrecover_train.cli import main

slow = []
save, write_all = trainer.Trainer.save, local.LocalStorage._write_all
def traced_save(self, *, kind, blocking):
    if kind == "extra":
        slow.append(kind)
        print("extra save started", flush=True)
    return save(self, kind=kind, blocking=blocking)
def stalled(self, *a, **k):
    stall = slow and os.environ.get("RANK", "0") in os.environ.get("STALL_RANKS", "0")
    time.sleep(600 if stall else 0 if slow else float(os.environ.get("FINAL_SAVE_S", "0")))
    return write_all(self, *a, **k)
trainer.Trainer.save, local.LocalStorage._write_all = traced_save, stalled
sys.exit(main())  # as the command line: its own start-up timed, its own end
"""


def kinds(ckpt: Path) -> list[tuple[str, int]]:
    return [(e["kind"], e["step"]) for e in events(ckpt) if e["event"] == "save"]


class Run:
    """A trainer process (the CLI, a script, torchrun) whose deadline is set by SLURM's warning
    signal, sent to rank 0 once it has trained a step: LEAD seconds later, however long the
    start-up took."""

    def __init__(self, cmd: list[str], ckpt: Path, lead: float = LEAD, **env: str) -> None:
        self.ckpt, self.signalled = ckpt, 0.0
        self.lines: list[str] = []
        env = child_env(PYRECOVER_SIGNAL_LEAD=f"{lead:g}", **env)
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:  # a failed test leaves no trainer behind
            self.proc.kill()
            self.proc.communicate()

    def warn_once_training(self) -> None:
        metrics = self.ckpt / "default-exp" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not any(e["event"] == "step" for e in _events(metrics)):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.02)
        pid = next(e["pid"] for e in _events(metrics) if e["event"] == "start")
        os.kill(pid, signal.SIGUSR2)  # rank 0 owns the clock; the others follow its decisions

    def read_until(self, text: str) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if text in line:
                return
        raise AssertionError(f"no {text!r} in:\n{self.output()}")

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)
        self.signalled = time.time()

    def finish(self) -> tuple[int, str, float]:
        """(exit status, output, when the process was gone)."""
        out = self.proc.communicate(timeout=120)[0]
        gone = time.time()
        self.lines.append(out)
        return self.proc.returncode, self.output(), gone

    def output(self) -> str:
        return "".join(self.lines)


def _events(metrics: Path) -> list[dict]:
    from pyrecover_train.metrics import read_events

    return list(read_events(metrics)) if metrics.exists() else []


def cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pyrecover_train", *args]


def deadline_of(ckpt: Path) -> float:
    """The deadline the run stopped for: the warning's receipt + LEAD, from its stop event. Not
    the event's ISO deadline alone: that is whole seconds, up to 1 s before the real one (the
    abandon at deadline - MARGIN then looked up to 1 s late)."""
    from datetime import datetime

    stop = [e for e in events(ckpt) if e["event"] == "stop"][-1]
    # seconds_left is taken just before the event's time: later by microseconds, never earlier
    exact = stop["time"] + stop["budget"]["seconds_left"]
    whole = datetime.fromisoformat(stop["budget"]["deadline"]).timestamp()
    assert whole <= exact < whole + 1.05, (exact, stop["budget"])
    return float(exact)


def assert_resumes_from(ckpt: Path, step: int, args: list[str]) -> None:
    again = run_cli([*args, "--resume-from-checkpoint", "latest", "--time-limit", "1s"])
    assert again.returncode == 75, again.stdout + again.stderr
    assert f"resumed from step {step}" in again.stdout


def test_the_time_the_final_save_left_is_trained_and_saved(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    with Run(cli(flags(corpus, cache_dir, ckpt)), ckpt) as run:
        run.warn_once_training()
        rc, out, gone = run.finish()
    assert rc == 75, out
    own = OwnSpeed.of(ckpt)  # the exit began in time: the process is gone by the deadline
    assert gone < deadline_of(ckpt) + own.exit_allowance, (gone - deadline_of(ckpt), own)
    assert "extra save: train" in out and "save of step" not in out
    saves = kinds(ckpt)
    assert [k for k, _ in saves[:2]] == ["final", "extra"], saves
    final, extra = saves[0][1], saves[1][1]
    assert extra > final + 10  # seconds of tiny steps, not one or two
    manifest, _ = final_state(ckpt)
    assert manifest.step == saves[-1][1]  # the newest extra save is the checkpoint
    stop = [e for e in events(ckpt) if e["event"] == "stop"][-1]
    assert stop["step"] == manifest.step and stop["cause"] == "time"
    assert_resumes_from(ckpt, manifest.step, flags(corpus, cache_dir, ckpt))

    off = tmp_path / "off"
    r = run_cli([*flags(corpus, cache_dir, off), "--time-limit", "8s", "--no-extra-saves"])
    assert r.returncode == 75 and [k for k, _ in kinds(off)] == ["final"], r.stdout + r.stderr


@pytest.mark.parametrize("how", ["time", "SIGTERM"])
def test_an_extra_save_not_durable_in_time_is_abandoned_and_the_final_one_stands(
    how: str, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    ckpt, script = tmp_path / "ckpt", tmp_path / "slow_extra.py"
    script.write_text(textwrap.dedent(SLOW_EXTRA))
    base = flags(corpus, cache_dir, ckpt)
    args, lead, final_s = base, LEAD, "0"
    if how == "SIGTERM":  # a final save of 3 s of a 10 s bound: the extra one has seconds
        args, lead, final_s = [*base, "--default-ckpt-time", "10"], LEAD + 6, "3"
    with Run([sys.executable, str(script), *args], ckpt, lead, FINAL_SAVE_S=final_s) as run:
        run.warn_once_training()
        run.read_until("extra save started")
        if how == "SIGTERM":
            time.sleep(0.2)
            run.signal(signal.SIGTERM)
        rc, out, gone = run.finish()
    assert rc == 75, out
    own, abandon_at = OwnSpeed.of(ckpt), deadline_of(ckpt) - MARGIN
    if how == "time":  # abandoned when the exit must begin
        assert gone < abandon_at + own.exit_allowance, (gone - abandon_at, own)
        assert "abandoned (the exit must begin)" in out
    else:  # at once, not at the abandon time
        assert gone - run.signalled < own.exit_allowance + 0.1, (gone - run.signalled, own)
        assert gone < abandon_at - 1.0, (gone - abandon_at, own)
        assert "abandoned (SIGTERM)" in out
    assert_abandoned_and_resumable(ckpt, out, base)


def assert_abandoned_and_resumable(ckpt: Path, out: str, args: list[str]) -> None:
    """Only the final save returned; the log names the abandoned step and the one that stands;
    the stop event says so; the next allocation resumes from the final save (the half-written
    step is no obstacle)."""
    saves = kinds(ckpt)
    assert [k for k, _ in saves] == ["final"], saves  # the extra one never returned
    final = saves[0][1]
    said = re.search(r"extra save of step (\d+) abandoned \(.*\): step (\d+) is the check", out)
    assert said is not None, out[-4000:]
    extra = int(said[1])
    manifest, _ = final_state(ckpt)
    assert manifest.step == final == int(said[2]) < extra  # the final save stands
    assert (ckpt / "default-exp" / f"step-{extra:08d}").is_dir()  # half-written, not seen
    stop = [e for e in events(ckpt) if e["event"] == "stop"][-1]
    assert stop["step"] == final and "abandoned" in stop["reason"] and stop["exit_code"] == 75
    assert_resumes_from(ckpt, final, args)


def torchrun(script: str, args: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    return [*cmd, "2", script, "--distributed", *args]


def test_extra_saves_on_two_ranks_sharded_durable_and_abandoned(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """torchrun, gloo, DCP: every rank follows rank 0's plan, so the sharded extra save is
    collective; one rank's stalled write abandons it on both, and one process resumes."""
    script = tmp_path / "slow_extra.py"
    script.write_text(textwrap.dedent(SLOW_EXTRA))
    for name, stall in (("ok", "none"), ("stalled", "1")):
        ckpt = tmp_path / name
        base = flags(corpus, cache_dir, ckpt, "--use-torch-distributed-ckpt")
        with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:  # torchrun's folders
            launched = time.time()
            cmd = torchrun(str(script), base)
            with Run(cmd, ckpt, STALL_RANKS=stall, TMPDIR=tmp) as run:
                run.warn_once_training()
                rc, out, gone = run.finish()
        assert out.count("exitcode  : 75") == 2, out[-4000:]  # both ranks
        if stall == "none":
            saves = kinds(ckpt)
            assert [k for k, _ in saves][:2] == ["final", "extra"], saves
            manifest, _ = final_state(ckpt)
            assert (manifest.step, manifest.world_size, manifest.format) == (saves[-1][1], 2, "dcp")
            continue
        stop = [e for e in events(ckpt) if e["event"] == "stop"][-1]
        assert MARGIN - 0.5 < stop["seconds_left"] < MARGIN + 1.0, stop  # abandoned when due
        # torchrun's teardown is allowed what its launch took (-> rank 0's process start).
        own = OwnSpeed.of(ckpt)
        launch, abandon_at = own.process_start - launched, deadline_of(ckpt) - MARGIN
        assert gone < abandon_at + launch + own.exit_allowance, (gone - abandon_at, launch)
        assert "extra save started" in out, out[-4000:]
        assert_abandoned_and_resumable(ckpt, out, base)
