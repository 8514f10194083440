"""Checkpoints on S3 (a real moto_server on 127.0.0.1, through s3fs), with a local mirror: a run
stopped for time resumes from the bucket and finishes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from train_helpers import child_env, run_cli, tiny_flags

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
