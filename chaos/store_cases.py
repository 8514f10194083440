"""Helpers of ``chaos/test_store.py``: the real pyrecover-train against a real moto_server behind
``tools/faultproxy.py``, faults switched on at a moment the run's own output names, and what a
user checks afterwards (exit, its time, the lines about the store, the checkpoints)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUCKET = "ckpt"
STEPS = 300  # every run's --training-steps; a deadline stops the faulty ones on the way
EVERY = 25  # --checkpoint-frequency


def train_args(corpus: Path, cache: Path, experiment: str, *extra: str) -> list[str]:
    """A tiny model on one CPU core: ~20 ms a step on a quiet machine."""
    return [
        sys.executable,
        "-m",
        "pyrecover_train",
        "--dataset",
        str(corpus),
        "--cache-dir",
        str(cache),
        "--checkpoint-url",
        f"s3://{BUCKET}/runs",
        "--experiment_name",
        experiment,
        "--model-size",
        "tiny",
        "--tokenizer",
        "byte",
        "--sequence-length",
        "32",
        "--batch-size",
        "4",
        "--warmup-steps",
        "2",
        "--eval-every",
        "0",
        "--log-every",
        "1",
        "--training-steps",
        str(STEPS),
        "--checkpoint-frequency",
        str(EVERY),
        *extra,
    ]


@dataclass
class Run:
    """One pyrecover-train process: its lines (with the time each came), exit and end time."""

    lines: list[tuple[float, str]] = field(default_factory=list)
    rc: int | None = None
    started: float = 0.0
    ended: float = 0.0

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first(self, needle: str) -> float | None:
        return next((t for t, line in self.lines if needle in line), None)


def run_train(
    args: list[str],
    env: dict[str, str],
    cwd: Path,
    *,
    on_line: Callable[[str], None] = lambda line: None,
    started: Callable[[subprocess.Popen[str]], None] = lambda proc: None,
    timeout: float = 180.0,
) -> Run:
    """Run ``args`` to its end (killed past ``timeout``: the test then fails on its exit)."""
    run = Run(started=time.time())
    proc = subprocess.Popen(
        args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    started(proc)
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            run.lines.append((time.time(), line.rstrip("\n")))
            on_line(line)
        run.rc = proc.wait()
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run.ended = time.time()
    return run


def child_env(endpoint: str, server_env: dict[str, str], **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYRECOVER_", "RANK"))
    }
    env.update(server_env)
    env.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ENDPOINT_URL_S3=endpoint,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        DDPKIT_WATCHDOG="0",
    )
    env.update(extra)
    return env


@contextlib.contextmanager
def store_of(server: Any, experiment: str) -> Iterator[Any]:
    import ckptstore

    store = ckptstore.CheckpointStore(
        f"s3://{BUCKET}/runs",
        experiment=experiment,
        storage_options=server.storage_options(),  # straight to moto, not through the proxy
        lock=False,
    )
    try:
        yield store
    finally:
        store.close()


def tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every tensor of a checkpoint's state, by its path."""
    import torch

    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for k in sorted(state, key=str):
            yield from tensors(state[k], f"{prefix}/{k}")
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from tensors(v, f"{prefix}/{i}")


def differences(a: Any, b: Any) -> list[str]:
    """The tensor paths where two states differ (bitwise), or that only one has."""
    import torch

    ta, tb = dict(tensors(a)), dict(tensors(b))
    out = sorted(set(ta) ^ set(tb))
    for k in sorted(set(ta) & set(tb)):
        x, y = ta[k], tb[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            out.append(k)
    return out
