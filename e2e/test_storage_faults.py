"""Scenarios 5, 5b and 6: the storage fails under a running trainer.

5. Checkpoints go to `s3://` on a real moto_server. The endpoint goes away in the middle of an
   upload (its TCP proxy resets every connection and refuses new ones, as a dead server would;
   moto keeps its data, as a restarted real store would): the trainer says so in one line and
   trains on, tries again with a growing pause, and once the endpoint is back saves ("store back:
   saved step N"); it finishes exit 0, bitwise equal to a straight run.
5b. The endpoint is down when the run must stop for time: the final save is tried again while the
   time allows, then the run exits 74 (the store could not be reached) with one line saying which
   checkpoint stands; it is intact, and once the endpoint is back the run resumes from it.
6. The checkpoint directory is a small tmpfs that fills up during a save: one clear error, the
   previous checkpoint intact; moved to a larger disk the run resumes and loses nothing.
"""

from __future__ import annotations

import contextlib
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
    running_cli,
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


@contextlib.contextmanager
def reconnected(moto: Any) -> Iterator[None]:
    """The endpoint answers again on the way out, whatever happened."""
    try:
        yield
    finally:
        moto.reconnect()


@pytest.mark.s3
def test_s3_endpoint_dies_during_an_upload(
    moto: Any, corpus: Path, cache_dir: Path, tmp_path: Path, figures: dict[str, Any]
) -> None:
    """5. object store: the S3 endpoint dies during an upload, training goes on"""
    url = "s3://ckpt/e2e"
    args = s3_flags(corpus, cache_dir, tmp_path / "unused", "--checkpoint-url", url)
    env = child_env(**moto.env())
    metrics = tmp_path / "runs" / "default-exp" / "metrics.jsonl"  # metrics stay local

    with running_cli(args, env=env, cwd=tmp_path) as proc, reconnected(moto):
        wait_for_step(proc, metrics, 0, S3_EVERY + 1, timeout=300)  # step 10 is committed
        wait_for_step(proc, metrics, 0, 2 * S3_EVERY, timeout=300)  # step 20's save starts now
        time.sleep(0.5)  # its upload is under way
        moto.disconnect()
        cut = time.monotonic()
        # Training goes on while the store is down: steps after 20 are trained meanwhile.
        trained = wait_for_step(proc, metrics, 0, 2 * S3_EVERY + 3, timeout=300)
        moto.reconnect()
        down_s = time.monotonic() - cut
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    down = [line for line in out.splitlines() if line.startswith("store unreachable since ")]
    assert len(down) == 1 and "(saving step 20: " in down[0], out
    assert down[0].endswith("; training on, saving when it is back"), down
    back = [line for line in out.splitlines() if line.startswith("store back: saved step ")]
    assert len(back) == 1, out
    saved = [e["step"] for e in events(metrics) if e["event"] == "saved"]
    back_at = int(back[0].split()[4])
    assert saved[0] == S3_EVERY and back_at in saved and back_at > 2 * S3_EVERY, (saved, back)
    assert saved[-1] == S3_STEPS

    straight = tmp_path / "straight"
    ref = run_cli(s3_flags(corpus, cache_dir, straight))
    assert ref.returncode == 0, ref.stdout + ref.stderr
    _, want = final_state(straight)
    manifest, got = final_state(url, storage_options=moto.storage_options())
    assert manifest.step == S3_STEPS
    assert_bitwise_equal(want, got)
    figures["down"] = f"{down_s:.0f} s, trained to step {trained} meanwhile"
    figures["back"] = back[0][len("store back: ") :][:60]
    figures["final"] = f"step {S3_STEPS}, bitwise equal to a straight run"


@pytest.mark.s3
def test_s3_endpoint_down_at_the_final_save(
    moto: Any, corpus: Path, cache_dir: Path, tmp_path: Path, figures: dict[str, Any]
) -> None:
    """5b. object store: the S3 endpoint is down when the run stops for time: exit 74"""
    url, every = "s3://ckpt/final", 5
    args = trainer_flags(
        corpus, cache_dir, tmp_path / "unused", 10**6, every, "--checkpoint-url", url
    )
    env = child_env(**moto.env())
    metrics = tmp_path / "runs" / "default-exp" / "metrics.jsonl"
    limited = [*args, "--time-limit", "40s"]
    with running_cli(limited, env=env, cwd=tmp_path) as proc, reconnected(moto):
        wait_for_step(proc, metrics, 0, every + 1, timeout=120)  # step 5 is durable
        moto.disconnect()
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 74, out
    error = [line for line in out.splitlines() if "pyrecover-train: error:" in line]
    assert len(error) == 1 and "Traceback" not in out, out
    durable = [e["step"] for e in events(metrics) if e["event"] == "saved"][-1]
    stop = [e for e in events(metrics) if e["event"] == "stop"][-1]
    assert stop["exit_code"] == 74 and stop["step"] > durable, stop
    assert "the store is still unreachable (since " in error[0], error
    assert (
        f"step {stop['step']} is not saved; the checkpoint of step {durable} is intact" in error[0]
    )
    assert error[0].endswith(
        "(exit 74: nothing durable was lost; run it again once the store answers)"
    )

    with ckptstore.CheckpointStore(
        url, experiment="default-exp", storage_options=moto.storage_options()
    ) as store:
        assert store.latest_step() == durable and store.verify("latest").ok
    again = [*args, "--training-steps", str(durable + 2), "--resume-from-checkpoint", "latest"]
    r = run_cli(again, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resumed from step {durable} ({url}/default-exp/step-{durable:08d})" in r.stdout
    figures["stopped"] = f"at step {stop['step']}, exit 74"
    figures["stands"] = f"step {durable} (verified), resumed from it"


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
