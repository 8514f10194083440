"""Small text corpora written as real parquet files (no downloads)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "it",
    "an",
    "were",
    "are",
    "which",
    "this",
    "be",
    "ship",
    "sea",
    "storm",
    "king",
    "queen",
    "castle",
    "river",
    "mountain",
    "naïve",
    "café",
    "über",
    "東京",
    "данные",
    "🙂",
    "data",
    "model",
    "token",
    "batch",
    "window",
    "epoch",
    "rank",
    "shard",
    "resume",
    "cluster",
    "node",
    "job",
    "time",
    "limit",
]


def make_texts(n: int, seed: int = 0, *, min_words: int = 0, max_words: int = 60) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
        text = " ".join(words)
        if rng.random() < 0.2:
            text = text.capitalize() + ".\n"
        out.append(text)
    return out


def write_parquet(
    path: Path,
    texts: Sequence[str | None],
    *,
    row_group_size: int = 50,
    column: str = "text",
    compression: str = "zstd",
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({column: pa.array(list(texts), type=pa.string()), "id": range(len(texts))})
    pq.write_table(table, path, row_group_size=row_group_size, compression=compression)
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    """A directory with two parquet files (several row groups each) and their texts in order."""
    texts = make_texts(400, seed=1)
    write_parquet(tmp_path / "data" / "part-0.parquet", texts[:250])
    write_parquet(tmp_path / "data" / "part-1.parquet", texts[250:], row_group_size=40)
    return tmp_path / "data", texts


class Tools:
    """The helpers above, as a fixture (tests cannot import conftest in importlib mode)."""

    make_texts = staticmethod(make_texts)
    write_parquet = staticmethod(write_parquet)


@pytest.fixture
def tools() -> type[Tools]:
    return Tools
