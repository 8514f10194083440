"""Fixtures: a small generated corpus and a private cache dir shared by the session's runs, a
real S3 endpoint (moto_server on 127.0.0.1) with a bucket "ckpt", and the session's job
timelines kept in its temp folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from train_helpers import make_corpus, require_tool  # on sys.path via the root pyproject


@pytest.fixture(scope="session", autouse=True)
def _timelines_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """slurmclock's job timelines (written by every run that sees a SLURM_JOB_ID, and by the
    sbatch scripts' `slurmclock mark`) go to the session's temp folder, never to the user's
    ~/.cache/slurmclock. Session-wide and first: a SLURM cluster fixture copies the environment
    when it starts, and its jobs inherit it."""
    where = tmp_path_factory.mktemp("timelines")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURMCLOCK_DIR", str(where))
        yield where


@pytest.fixture(autouse=True)
def _compile_cache_per_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process run with --compile points TORCHINDUCTOR_CACHE_DIR at its experiment's
    folder (process-wide, as it must be before torch.compile): undone after each test, so no
    later test compiles into a removed temp folder. (setenv first: then delenv's undo also
    removes a value set during the test.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "corpus.parquet")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared by the session's runs: the byte tokenizer's token cache is built once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def moto() -> Iterator[Any]:
    s3server = require_tool("s3server", "S3 endpoint", "PYRECOVER_REQUIRE_S3")
    with s3server.MotoServer() as server:
        server.make_bucket("ckpt")
        yield server
