"""Fixtures: a small generated corpus and a private cache dir shared by the session's runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from train_helpers import make_corpus  # on sys.path via pytest's pythonpath (root pyproject)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "corpus.parquet")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared by the session's runs: the byte tokenizer's token cache is built once."""
    return tmp_path_factory.mktemp("cache")
