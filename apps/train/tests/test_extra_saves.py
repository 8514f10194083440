"""Extra saves after a stop for time: the final save's bound keeps it safe, so it usually ends
early; the trainer trains on and saves again, and abandons (exits 75 at once) a save that is not
durable when the exit must begin. In subprocesses: the abandon ends the process."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from train_helpers import child_env, events, final_state, run_cli, run_torchrun, tiny_flags

LIMIT = 16.0  # --time-limit, from the process start
MARGIN = 2.0  # --stop-margin: the exit must begin by LIMIT - MARGIN


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
sys.exit(main(sys.argv[1:]))
"""


def kinds(ckpt: Path) -> list[tuple[str, int]]:
    return [(e["kind"], e["step"]) for e in events(ckpt) if e["event"] == "save"]


def test_the_time_the_final_save_left_is_trained_and_saved(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    t0 = time.time()
    r = run_cli([*flags(corpus, cache_dir, ckpt), "--time-limit", f"{LIMIT:g}s"])
    took = time.time() - t0
    assert r.returncode == 75, r.stdout + r.stderr
    assert took < LIMIT, took  # the exit began in time: the process is gone before the limit
    assert "extra save: train" in r.stdout and "save of step" not in r.stdout
    saves = kinds(ckpt)
    assert [k for k, _ in saves[:2]] == ["final", "extra"], saves
    final, extra = saves[0][1], saves[1][1]
    assert extra > final + 10  # seconds of tiny steps, not one or two
    manifest, _ = final_state(ckpt)
    assert manifest.step == saves[-1][1]  # the newest extra save is the checkpoint
    stop = [e for e in events(ckpt) if e["event"] == "stop"][-1]
    assert stop["step"] == manifest.step and stop["cause"] == "time"
    # It resumes from there.
    again = run_cli(
        [
            *flags(corpus, cache_dir, ckpt),
            "--resume-from-checkpoint",
            "latest",
            "--time-limit",
            "1s",
        ]
    )
    assert again.returncode == 75, again.stdout + again.stderr
    assert f"resumed from step {manifest.step}" in again.stdout

    off = tmp_path / "off"
    r = run_cli([*flags(corpus, cache_dir, off), "--time-limit", "8s", "--no-extra-saves"])
    assert r.returncode == 75 and [k for k, _ in kinds(off)] == ["final"], r.stdout + r.stderr


@pytest.mark.parametrize("how", ["time", "SIGTERM"])
def test_an_extra_save_not_durable_in_time_is_abandoned_and_the_final_one_stands(
    how: str, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    script = tmp_path / "slow_extra.py"
    script.write_text(textwrap.dedent(SLOW_EXTRA))
    base = flags(corpus, cache_dir, ckpt)
    args = [*base, "--time-limit", f"{LIMIT:g}s"]
    if how == "SIGTERM":  # a final save of 3 s of a 10 s bound: the extra one has seconds
        args = [*base, "--time-limit", f"{LIMIT + 6:g}s", "--default-ckpt-time", "10"]
    env = child_env(FINAL_SAVE_S="3" if how == "SIGTERM" else "0")
    cmd = [sys.executable, str(script), *args]
    t0 = time.time()
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as proc:
        try:
            assert proc.stdout is not None
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if "extra save started" in line:
                    started = time.time()
                    if how == "SIGTERM":
                        time.sleep(0.2)
                        proc.send_signal(signal.SIGTERM)
                    break
            lines.append(proc.communicate(timeout=60)[0])
        finally:  # a failed test leaves no trainer behind
            if proc.poll() is None:
                proc.kill()
    out, took = "".join(lines), time.time() - t0
    assert proc.returncode == 75, out
    assert "extra save started" in out, out
    if how == "time":
        assert took < LIMIT - MARGIN + 1.0, (took, out)  # abandoned when the exit must begin
        assert "abandoned (the exit must begin)" in out
    else:
        assert time.time() - started < 1.2, out  # at once, not at the abandon time
        assert "abandoned (SIGTERM)" in out
    saves = kinds(ckpt)
    assert [k for k, _ in saves] == ["final"], saves  # the extra one never returned
    final = saves[0][1]
    said = re.search(
        r"extra save of step (\d+) abandoned \(.*\): step (\d+) is the checkpoint", out
    )
    assert said is not None, out
    extra = int(said[1])
    manifest, _ = final_state(ckpt)
    assert manifest.step == final == int(said[2]) < extra  # the final save stands
    assert (ckpt / "default-exp" / f"step-{extra:08d}").is_dir()  # half-written, not seen
    stop = [e for e in events(ckpt) if e["event"] == "stop"][-1]
    assert stop["step"] == final and "abandoned" in stop["reason"] and stop["exit_code"] == 75
    # The next allocation resumes from the final save; the half-written step is no obstacle.
    again = run_cli([*base, "--resume-from-checkpoint", "latest", "--time-limit", "1s"])
    assert again.returncode == 75, again.stdout + again.stderr
    assert f"resumed from step {final}" in again.stdout


def test_extra_saves_on_two_ranks_sharded_durable_and_abandoned(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """torchrun, gloo, DCP: every rank follows rank 0's plan, so the sharded extra save is
    collective; one rank's stalled write abandons it on both, and one process resumes."""
    kw = ("--use-torch-distributed-ckpt", "--time-limit", f"{LIMIT + 4:g}s")
    ok = tmp_path / "ok"
    r = run_torchrun(["--distributed", *flags(corpus, cache_dir, ok, *kw)])
    assert "exitcode  : 75" in r.stderr, r.stdout[-3000:] + r.stderr[-3000:]  # both ranks
    saves = kinds(ok)
    assert [k for k, _ in saves][:2] == ["final", "extra"], saves
    manifest, _ = final_state(ok)
    assert (manifest.step, manifest.world_size, manifest.format) == (saves[-1][1], 2, "dcp")

    stalled = tmp_path / "stalled"
    script = tmp_path / "slow_extra.py"
    script.write_text(textwrap.dedent(SLOW_EXTRA))
    base = flags(corpus, cache_dir, stalled, "--use-torch-distributed-ckpt")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(script),
                "--distributed",
                *base,
                "--time-limit",
                f"{LIMIT + 4:g}s",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(STALL_RANKS="1", TMPDIR=tmp),
        )
    took, out = time.time() - t0, r.stdout + r.stderr
    assert took < LIMIT + 4 + 3, took  # + torchrun's own start-up and teardown
    stop = [e for e in events(stalled) if e["event"] == "stop"][-1]
    assert MARGIN - 0.5 < stop["seconds_left"] < MARGIN + 1.0, stop  # abandoned when due
    assert out.count("exitcode  : 75") == 2 and "extra save started" in out, out[-4000:]
    said = re.search(r"extra save of step (\d+) abandoned .*: step (\d+) is the checkpoint", out)
    assert said is not None, out[-4000:]
    manifest, _ = final_state(stalled)
    assert manifest.step == int(said[2]) < int(said[1]) and manifest.world_size == 2
    again = run_cli([*base, "--resume-from-checkpoint", "latest", "--time-limit", "1s"])
    assert again.returncode == 75, again.stdout + again.stderr
    assert f"resumed from step {manifest.step}" in again.stdout
