"""Checkpoints on S3 (a real moto_server on 127.0.0.1, through s3fs), with a local mirror: a run
stopped for time resumes from the bucket and finishes; an endpoint that does not answer at the
start is exit 74 (the outage during a run: e2e/test_storage_faults.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from train_helpers import child_env, require_tool, run_cli, tiny_flags

import ckptstore

pytestmark = pytest.mark.s3


def test_s3_checkpoints_resume_and_mirror(
    moto: Any, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    mirror = tmp_path / "mirror"
    args = tiny_flags(
        corpus,
        cache_dir,
        tmp_path / "unused",
        "--checkpoint-url",
        "s3://ckpt/runs",
        "--checkpoint-mirror",
        str(mirror),
        "--training-steps",
        "6",
        "--checkpoint-frequency",
        "3",
        "--experiment_name",
        "s3exp",
    )
    env = child_env(**moto.env())
    first = run_cli([*args, "--time-limit", "1s", "--stop-margin", "0"], env=env, cwd=tmp_path)
    assert first.returncode == 75, first.stdout + first.stderr
    done = run_cli([*args, "--resume-from-checkpoint", "latest"], env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed from step 1 (s3://ckpt/runs/s3exp/step-00000001)" in done.stdout

    store = ckptstore.CheckpointStore(
        "s3://ckpt/runs", experiment="s3exp", storage_options=moto.storage_options()
    )
    try:
        assert [i.step for i in store.list()] == [1, 3, 6]
        assert store.verify("latest").ok
        manifest, state = store.read("latest")
    finally:
        store.close()
    assert manifest.step == 6 and state["step"] == 6
    # Metrics stay local (an object store cannot append): ./runs/EXPERIMENT.
    metrics = (tmp_path / "runs" / "s3exp" / "metrics.jsonl").read_text()
    assert '"url":"s3://ckpt/runs/s3exp/step-00000006"' in metrics
    assert not (tmp_path / "unused").exists()
    # Every checkpoint was copied to the mirror too.
    local = ckptstore.CheckpointStore(str(mirror), experiment="s3exp")
    try:
        assert local.latest_step() == 6 and local.verify(6).ok
    finally:
        local.close()


@pytest.fixture
def cut_moto() -> Iterator[Any]:
    """A moto_server behind a proxy this test can cut (tools/s3server.py)."""
    s3server = require_tool("s3server", "S3 endpoint", "PYRECOVER_REQUIRE_S3")
    with s3server.MotoServer(proxy=True) as server:
        server.make_bucket("ckpt")
        yield server


def test_an_unreachable_store_at_start_is_exit_74_in_one_line(
    cut_moto: Any, corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Was exit 2, a usage error that nothing retries: the store being down is no fault of the
    flags, and the same start works once it answers (CONTRACTS: 74, EX_IOERR)."""
    args = tiny_flags(
        corpus, cache_dir, tmp_path / "unused", "--checkpoint-url", "s3://ckpt/down",
        "--training-steps", "2",
    )  # fmt: skip
    env = child_env(**cut_moto.env())
    cut_moto.disconnect()
    r = run_cli(args, env=env, cwd=tmp_path)
    assert r.returncode == 74, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in r.stdout + r.stderr, r.stderr
    assert line.startswith("pyrecover-train: error: the store did not answer at s3://ckpt/down/")
    assert line.endswith("(exit 74: nothing durable was lost; run it again once the store answers)")
    cut_moto.reconnect()
    r = run_cli(args, env=env, cwd=tmp_path)  # the same start, once the store is back
    assert r.returncode == 0, r.stdout + r.stderr
