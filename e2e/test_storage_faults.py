"""Scenarios 5 and 6: the storage fails under a running trainer.

5. Checkpoints go to `s3://` on a real moto_server. The endpoint goes away in the middle of an
   upload (its TCP proxy resets every connection and refuses new ones, as a dead server would;
   moto keeps its data, as a restarted real store would): the trainer reports the error and exits,
   `latest` still names the last complete checkpoint, and once the endpoint is back the run resumes
   from the bucket and ends bitwise equal to a straight run.
6. The checkpoint directory is a small tmpfs that fills up during a save: one clear error, the
   previous checkpoint intact; moved to a larger disk the run resumes and loses nothing.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import SHORT_STEPS, events, short_flags, trainer_flags
from train_helpers import (
    assert_bitwise_equal,
    child_env,
    final_state,
    load_tool,
    run_cli,
    start_cli,
    wait_for_step,
)

import ckptstore

pytestmark = [pytest.mark.slow]

S3_STEPS, S3_EVERY = 30, 10


def s3_flags(corpus: Path, cache: Path, ckpt: Path, *extra: str) -> list[str]:
    # The small preset: a ~115 MB checkpoint, whose upload to moto takes a few seconds.
    return trainer_flags(
        corpus, cache, ckpt, S3_STEPS, S3_EVERY, "--model-size", "small", "--log-every", "1", *extra
    )


@pytest.mark.s3
def test_s3_endpoint_dies_during_an_upload(
    moto: Any, corpus: Path, cache_dir: Path, tmp_path: Path, figures: dict[str, Any]
) -> None:
    """5. object store: the S3 endpoint dies during an upload"""
    url = "s3://ckpt/e2e"
    args = s3_flags(corpus, cache_dir, tmp_path / "unused", "--checkpoint-url", url)
    env = child_env(**moto.env())
    metrics = tmp_path / "runs" / "default-exp" / "metrics.jsonl"  # metrics stay local

    proc = start_cli(args, env=env, cwd=tmp_path)
    try:
        wait_for_step(proc, metrics, 0, S3_EVERY + 1, timeout=300)  # step 10 is committed
        wait_for_step(proc, metrics, 0, 2 * S3_EVERY, timeout=300)  # step 20's save starts now
        time.sleep(0.5)  # its upload is under way
        moto.disconnect()
        cut = time.monotonic()
        out, _ = proc.communicate(timeout=600)
        reported_after = time.monotonic() - cut
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        moto.reconnect()
    assert proc.returncode == 1, out
    error = [line for line in out.splitlines() if "pyrecover-train: error:" in line]
    assert len(error) == 1 and "Traceback" not in out, out
    # One line on the console; what a bug report needs is in the log file.
    assert "Traceback" in (tmp_path / "runs" / "default-exp" / "train.log").read_text()
    saved = [e["step"] for e in events(metrics) if e["event"] == "saved"]
    assert saved == [S3_EVERY], saved  # step 20 never became durable

    with ckptstore.CheckpointStore(
        url, experiment="default-exp", storage_options=moto.storage_options()
    ) as store:
        assert store.latest_step() == S3_EVERY
        assert [c.step for c in store.list()] == [S3_EVERY]
        assert store.verify("latest").ok

    r = run_cli([*args, "--resume-from-checkpoint", "latest"], env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed from step {S3_EVERY} ({url}/default-exp/step-{S3_EVERY:08d})" in r.stdout

    straight = tmp_path / "straight"
    ref = run_cli(s3_flags(corpus, cache_dir, straight))
    assert ref.returncode == 0, ref.stdout + ref.stderr
    _, want = final_state(straight)
    manifest, got = final_state(url, storage_options=moto.storage_options())
    assert manifest.step == S3_STEPS
    assert_bitwise_equal(want, got)
    figures["error after"] = f"{reported_after:.1f} s: {error[0][:60]}..."
    figures["latest"] = f"step {S3_EVERY} (verified)"
    figures["resumed"] = "from s3, bitwise equal"


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs: room for one checkpoint of the tiny model (10.5 MB), not two."""
    tmpfs = load_tool("tmpfs")
    try:
        with tmpfs.mounted(tmp_path / "tiny", "16m") as mnt:
            yield mnt
    except tmpfs.Unavailable as e:
        pytest.skip(str(e))


def test_disk_full_during_a_save(
    tiny_disk: Path,
    corpus: Path,
    cache_dir: Path,
    short_reference: Path,
    tmp_path: Path,
    figures: dict[str, Any],
) -> None:
    """6. disk full: the checkpoint directory on a small tmpfs"""
    ckpt = tiny_disk / "ckpt"
    args = short_flags(corpus, cache_dir, ckpt)
    r = run_cli(args)
    assert r.returncode == 1, r.stdout + r.stderr
    error = r.stderr.strip().splitlines()
    assert len(error) == 1, r.stderr  # one line, no traceback (that is in train.log)
    assert "no space left" in error[0] and "previous checkpoint is intact" in error[0], error

    with ckptstore.CheckpointStore(str(ckpt), experiment="default-exp") as store:
        assert [c.step for c in store.list()] == [5]
        assert store.verify("latest").ok

    # Nothing is lost: on a disk with room the same experiment resumes and finishes.
    bigger = tmp_path / "bigger"
    shutil.copytree(ckpt, bigger)
    r = run_cli([*short_flags(corpus, cache_dir, bigger), "--resume-from-checkpoint", "latest"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from step 5" in r.stdout
    _, want = final_state(short_reference)
    manifest, got = final_state(bigger)
    assert manifest.step == SHORT_STEPS
    assert_bitwise_equal(want, got)
    figures["error"] = error[0][:70] + "..."
    figures["resumed"] = "from step 5 on a larger disk, bitwise equal"
