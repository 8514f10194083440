"""Files the run writes beside its checkpoints -- metrics, train.log, the loss CSV -- on a disk
that fills up or is read-only (real tmpfs mounts: tools/tmpfs.py, needs root). Training does not
depend on them: the run says in one line which file it goes on without, and trains and saves to
the end; a read-only or full --cache-dir at start is one line and exit 2 (issue 30)."""

from __future__ import annotations

import mmap
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from train_helpers import child_env, load_tool, run_cli, tiny_flags

import ckptstore
from pyrecover_train.metrics import MetricsLog, read_events

tmpfs = load_tool("tmpfs")
STEPS, EVERY = 120, 40


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 KiB tmpfs: room for the start of the metrics of a run, not for all of them."""
    try:
        with tmpfs.mounted(tmp_path / "tiny", "32k") as mnt:
            yield mnt
    except tmpfs.Unavailable as e:
        pytest.skip(str(e))


def one_line_each(stderr: str) -> list[str]:
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and "Logging error" not in stderr, stderr
    return lines


def test_a_metrics_disk_that_fills_during_training_costs_only_the_metrics(
    tiny_disk: Path, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """The metrics flush raised ENOSPC: a traceback, exit 1, no final save, and the requeued
    run died at start. Now: one line, training and its saves go on to the end, the summary
    counts the lines lost; the next run starts on the still-full disk and finishes too."""
    ckpt = tmp_path / "ckpt"
    metrics = tiny_disk / "metrics.jsonl"
    args = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", str(STEPS))
    args += ["--checkpoint-frequency", str(EVERY), "--metrics", str(metrics)]
    r = run_cli(args)
    assert r.returncode == 0, r.stdout + r.stderr
    (warning,) = one_line_each(r.stderr)
    assert warning == (
        f"pyrecover-train: warning: cannot write the metrics file {metrics}: No space left on "
        "device; training goes on without it (tried again every 30 s)"
    )
    assert f"finished: step {STEPS}/{STEPS}" in r.stdout
    assert "not written: " in r.stdout and f"line(s) of the metrics file {metrics}" in r.stdout
    with ckptstore.CheckpointStore(str(ckpt), experiment="default-exp") as store:
        assert store.latest_step() == STEPS and store.verify("latest").ok
    steps = [e["step"] for e in read_events(metrics) if e["event"] == "step"]
    assert steps and steps == list(range(1, len(steps) + 1)), steps  # whole lines, then none
    assert warning.split("warning: ")[1] in (ckpt / "default-exp" / "train.log").read_text()

    more = STEPS + EVERY  # a requeued run: the disk is still full when it starts
    r = run_cli([*args, "--training-steps", str(more), "--resume-from-checkpoint", "latest"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert one_line_each(r.stderr) == [warning]
    assert f"resumed from step {STEPS}" in r.stdout and f"finished: step {more}/{more}" in r.stdout


def test_train_log_and_metrics_on_a_full_disk_cost_only_themselves(
    tiny_disk: Path, corpus: Path, cache_dir: Path
) -> None:
    """With the checkpoints elsewhere (an object store), metrics and train.log go to
    ./runs/EXPERIMENT: the working folder is the tiny disk. A "--- Logging error ---" traceback
    per line before; one line for each file now, and the run ends as it would."""
    args = tiny_flags(corpus, cache_dir, tiny_disk / "unused", "--training-steps", str(STEPS))
    args += ["--checkpoint-url", "memory://full-disk-test", "--log-loss-to-csv"]
    r = run_cli(args, cwd=tiny_disk)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = one_line_each(r.stderr)
    exp = tiny_disk / "runs" / "default-exp"
    assert (
        f"ddpkit: cannot write the log file {exp / 'train.log'}: No space left on device; "
        "logging to it stops (the console goes on)"
    ) in lines, lines
    said = {line.split(" runs/")[0] for line in lines if line.startswith("pyrecover-train")}
    assert said <= {
        "pyrecover-train: warning: cannot write the metrics file",
        "pyrecover-train: warning: cannot write the loss CSV",
    }, lines
    assert len(lines) == 1 + len(said) and said, lines
    assert f"finished: step {STEPS}/{STEPS}" in r.stdout


def test_stdout_on_a_full_disk_keeps_the_runs_exit_status(
    tiny_disk: Path, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """sbatch's output file on a full disk: the console stops in one line, and a run that
    finished (or saved and stopped) still exits with its own status, not 1 from the last
    flush of stdout."""
    ckpt = tmp_path / "ckpt"
    args = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", str(STEPS))
    (tiny_disk / "filler").write_bytes(b"x" * (32 * 1024 - mmap.PAGESIZE))  # a page left
    with open(tiny_disk / "job.out", "w") as out:
        r = subprocess.run(
            [sys.executable, "-m", "pyrecover_train", *args],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            env={k: v for k, v in child_env().items() if k != "PYTHONUNBUFFERED"},  # sbatch's
            timeout=300,
        )
    assert r.returncode == 0, r.stderr
    assert one_line_each(r.stderr) == [
        "ddpkit: stdout cannot be written: No space left on device; console logging stops"
    ]
    assert f"finished: step {STEPS}/{STEPS}" in (ckpt / "default-exp" / "train.log").read_text()


def test_a_read_only_cache_dir_is_one_line(corpus: Path, tmp_path: Path, tiny_disk: Path) -> None:
    """Training a tokenizer into a read-only --cache-dir was a traceback; a cache that holds
    what the run needs serves read-only."""
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True)
    ckpt = tmp_path / "ckpt"
    args = tiny_flags(corpus, tiny_disk, ckpt, "--training-steps", "2", "--tokenizer", "bpe:300")
    r = run_cli(args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr == (
        f"pyrecover-train: error: --cache-dir {tiny_disk}: cannot write {tiny_disk}/tokenizers: "
        "Read-only file system; point --cache-dir (or PYRECOVER_CACHE) at a folder you can write "
        "with room to spare (a read-only cache serves once it holds what the run needs)\n"
    )
    assert not ckpt.exists()  # nothing written


def test_a_file_that_fails_is_said_once_tried_again_and_said_back(tiny_disk: Path) -> None:
    """AppendFile on the real full disk: one line when writing stops, the lines after it lost
    until the retry time, then one line with the count when there is room again; no line is
    spoilt by the one the disk cut short."""
    from pyrecover_train.metrics import AppendFile

    said: list[str] = []
    now = [0.0]
    path = tiny_disk / "m.jsonl"
    file = AppendFile(path, "metrics file", say=said.append, clock=lambda: now[0], retry_s=30)
    filler = tiny_disk / "filler"
    with open(filler, "wb") as f:  # all of the disk but the one page the file gets
        f.write(b"x" * (32 * 1024 - mmap.PAGESIZE))
    line = b'{"event": "step", "step": 1}\n'
    assert file.write(line)
    long = b'{"event": "step", "step": 2, "pad": "' + b"y" * mmap.PAGESIZE + b'"}\n'
    assert not file.write(long)  # cut short by the disk: a partial line is left behind
    assert said == [
        f"cannot write the metrics file {path}: No space left on device; training goes on "
        "without it (tried again every 30 s)"
    ]
    assert not file.write(line) and not file.write(line) and len(said) == 1  # not before 30 s
    filler.unlink()
    now[0] = 29.0
    assert not file.write(line)
    now[0] = 31.0
    assert file.write(line.replace(b'"step": 1', b'"step": 5'))
    assert said[1] == (
        f"the metrics file {path} can be written again; 4 line(s) were lost meanwhile (No space "
        "left on device)"
    )
    file.close()
    assert [e["step"] for e in read_events(path)] == [1, 5]


def test_a_run_after_a_kill_mid_line_keeps_its_first_line(tmp_path: Path) -> None:
    """A torn last line (a SIGKILL mid-write) swallowed the next run's first event."""
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as m:
        m.log("start", step=0)
    with open(path, "ab") as f:
        f.write(b'{"event": "step", "st')
    with MetricsLog(path) as m:
        m.log("start", step=0)
    assert [e["event"] for e in read_events(path)] == ["start", "start"]
