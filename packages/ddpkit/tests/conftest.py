"""Launching real gloo process groups for the tests: by torchrun, or as a simulated srun step."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from ddpkit import master_port_for_job

WORKER = Path(__file__).with_name("_worker.py")
# Variables of an enclosing launcher (the tests may run inside torchrun or a SLURM job).
_LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "MASTER_", "GROUP_", "ROLE_", "LOCAL_")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "PYRECOVER_DIST_TIMEOUT")


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_VARS
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def one_rank_env(port: int, **over: str) -> dict[str, str]:
    """torchrun's variables for rank 0 of a world of one on 127.0.0.1:``port`` (``over`` wins)."""
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    env.update(over)
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def job_id_with_free_port() -> str:
    """A fake SLURM job id whose derived master port nobody uses right now."""
    rng = random.Random()
    for _ in range(200):
        job = str(rng.randrange(100_000, 9_999_999))
        if port_is_free(master_port_for_job(job, 0)):
            return job
    raise RuntimeError("no free port in the derived range")


@contextmanager
def processes(
    cmds: Sequence[tuple[list[str], Mapping[str, str]]],
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start the commands; on exit kill (by PID) whatever still runs, also when the test failed."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for argv, env in cmds:
            procs.append(
                subprocess.Popen(
                    argv, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
            )
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            with suppress(subprocess.TimeoutExpired):
                p.communicate(timeout=30)


def wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> list[str]:
    """Wait for every process (a hang shows as a TimeoutExpired failure); their outputs."""
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        outs.append(out.decode(errors="replace"))
    return outs


def read_ranks(outdir: Path, n: int) -> list[dict[str, Any]]:
    files = {p.name: p for p in outdir.glob("rank*.json")}
    missing = [f"rank{r}.json" for r in range(n) if f"rank{r}.json" not in files]
    assert not missing, f"ranks wrote no result: {missing}"
    return [json.loads(files[f"rank{r}.json"].read_text()) for r in range(n)]


def torchrun_cmd(
    n: int, scenario: str, outdir: Path, timeout: float = 60
) -> tuple[list[str], dict[str, str]]:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        str(WORKER),
        scenario,
        str(outdir),
    ]
    # torchrun leaves a torchelastic_* folder in its temp folder: make that the test's own.
    return argv, clean_env(TEST_TIMEOUT=str(timeout), TMPDIR=str(outdir))


def srun_cmds(
    n: int,
    scenario: str,
    outdir: Path,
    *,
    nodes: int = 1,
    timeout: float = 60,
    nodelist: str = "localhost",
    extra: Mapping[str, str] | None = None,
) -> list[tuple[list[str], dict[str, str]]]:
    """The environments srun would give ``n`` tasks on ``nodes`` nodes (block distribution)."""
    assert n % nodes == 0
    per_node = n // nodes
    job = job_id_with_free_port()
    cmds = []
    for rank in range(n):
        env = clean_env(
            TEST_TIMEOUT=str(timeout),
            SLURM_JOB_ID=job,
            SLURM_JOBID=job,
            SLURM_STEP_ID="0",
            SLURM_STEPID="0",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank % per_node),
            SLURM_NODEID=str(rank // per_node),
            SLURM_NTASKS=str(n),
            SLURM_NPROCS=str(n),
            SLURM_STEP_NUM_TASKS=str(n),
            SLURM_NNODES=str(nodes),
            SLURM_STEP_NUM_NODES=str(nodes),
            SLURM_TASKS_PER_NODE=f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
            SLURM_STEP_TASKS_PER_NODE=f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
            SLURM_JOB_NODELIST=nodelist,
            SLURM_STEP_NODELIST=nodelist,
            SLURM_NODELIST=nodelist,
        )
        env.update(extra or {})
        cmds.append(([sys.executable, str(WORKER), scenario, str(outdir)], env))
    return cmds


def signal_a_rank(
    argv: Sequence[str], env: Mapping[str, str], out: Path, n: int, victim: int, sig: str
) -> tuple[subprocess.Popen[str], str, float]:
    """Start a launcher of ``n`` _watchdog_child.py ranks writing to ``out``; once every rank is
    in its loop, send ``SIG<sig>`` to rank ``victim``. (the launcher, its output, seconds from
    the signal to the launcher's exit). The launcher is killed if the test fails."""
    proc = subprocess.Popen(
        list(argv), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 180  # 2-3 Pythons importing torch on a loaded machine
        while not all((out / f"ready{r}").exists() for r in range(n)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        time.sleep(3)  # a heartbeat or two
        t0 = time.monotonic()
        os.kill(int((out / f"ready{victim}").read_text().split()[0]), getattr(signal, f"SIG{sig}"))
        text, _ = proc.communicate(timeout=180)
        return proc, text, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def fault_lines(out: Path) -> list[dict[str, Any]]:
    """The lines of ``out/faults.jsonl`` (the tests' DDPKIT_FAULT_FILE)."""
    path = out / "faults.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def outdir(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


@pytest.fixture
def launch() -> Any:
    """This module, for the helpers above (tests cannot import conftest by name)."""
    return sys.modules[__name__]
