"""Fixtures: a small generated corpus and a private cache dir shared by the session's runs, and
a real S3 endpoint (moto_server on 127.0.0.1) with a bucket "ckpt"."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from train_helpers import make_corpus, require_tool  # on sys.path via the root pyproject


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
