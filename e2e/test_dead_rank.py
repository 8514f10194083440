"""Issue 21, case 3: one of two ranks of pyrecover-train (``srun -n 2 --kill-on-bad-exit=1`` as
in the shipped sbatch script, and ``torchrun --nproc-per-node 2``) is SIGKILLed or SIGSTOPped.
The watchdog (ddpkit, on by default, shipped thresholds) ends the other rank and the launcher
ends the rest: all ranks gone within 30 s of a dead rank and 60 s of a frozen one, measured from
the signal to the launcher's own exit, as the job script sees it. The failed rank's node is named
on stderr and in DDPKIT_FAULT_FILE; what was saved before stays loadable. (The requeue that
follows is the sbatch script's, tested with it.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from e2e_helpers import job_env, last_step, trainer_flags, wait_until
from train_helpers import child_env

import ckptstore

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

TARGET_S = {"KILL": 30.0, "STOP": 60.0}


@dataclass
class Case:
    """One run's corpus, cache, folder and summary-table figures."""

    corpus: Path
    cache_dir: Path
    tmp_path: Path
    figures: dict[str, Any]


@pytest.fixture
def case(corpus: Path, cache_dir: Path, tmp_path: Path, figures: dict[str, Any]) -> Case:
    return Case(corpus, cache_dir, tmp_path, figures)


@pytest.mark.parametrize(("sig", "victim"), [("KILL", 1), ("STOP", 1), ("KILL", 0), ("STOP", 0)])
def test_one_of_two_srun_ranks_dies_or_freezes(
    sig: str, victim: int, cluster: Any, case: Case
) -> None:
    """3. a dead or frozen rank: srun -n 2, all gone"""
    # Each task records its pid, then becomes the trainer (exec keeps the pid).
    task = f'echo $$ > {case.tmp_path}/pid$SLURM_PROCID; exec "$@"'
    argv = ["srun", "-n", "2", "--kill-on-bad-exit=1", "--time=10", "bash", "-c", task, "task"]
    env = {
        **cluster.env,
        **job_env(),
        "SLURM_CONF": str(cluster.conf_path),
        "MASTER_ADDR": "127.0.0.1",  # the test node's name does not resolve; a real one does
    }
    signal_a_rank(argv, env, sig, victim, case)


@pytest.mark.parametrize(("sig", "victim"), [("KILL", 1), ("STOP", 1)])
def test_one_of_two_torchrun_ranks_dies_or_freezes(sig: str, victim: int, case: Case) -> None:
    """3. a dead or frozen rank: torchrun 2, all gone"""
    # $BASHPID, not $$: torchrun reads its arguments as string.Template ($$ becomes $).
    task = f'echo $BASHPID > {case.tmp_path}/pid$RANK; exec "$@"'
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    argv += ["--no-python", "bash", "-c", task, "task"]
    scratch = case.tmp_path / "torchrun-tmp"  # torchrun's torchelastic_* folder
    scratch.mkdir()
    env = child_env(**job_env(), TMPDIR=str(scratch))
    signal_a_rank(argv, env, sig, victim, case)


def signal_a_rank(launcher: list[str], env: dict[str, str], sig: str, victim: int, c: Case) -> None:
    """Train under ``launcher``; past a checkpoint, signal rank ``victim``; check the end."""
    corpus, cache_dir, tmp_path, figures = c.corpus, c.cache_dir, c.tmp_path, c.figures
    ckpt, faults = tmp_path / "ckpt", tmp_path / "faults.jsonl"
    flags = trainer_flags(corpus, cache_dir, ckpt, 100_000, 20, "--log-every", "1")
    argv = [*launcher, sys.executable, "-m", "pyrecover_train", "--distributed", *flags]
    env = {**env, "DDPKIT_FAULT_FILE": str(faults)}
    metrics = ckpt / "default-exp" / "metrics.jsonl"
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_until("step 25 (a checkpoint at 20)", lambda: last_step(metrics) >= 25, 300)
        assert proc.poll() is None
        pid = int((tmp_path / f"pid{victim}").read_text())
        t0 = time.monotonic()
        os.kill(pid, getattr(signal, f"SIG{sig}"))
        out, _ = proc.communicate(timeout=TARGET_S[sig] + 120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    what = "dead" if sig == "KILL" else "frozen"
    assert proc.returncode != 0, out
    assert took < TARGET_S[sig], f"all ranks gone only after {took:.1f} s\n{out}"
    lines = [orjson.loads(x) for x in faults.read_bytes().splitlines()]
    assert [(f["rank"], f["what"], f["reporter"]) for f in lines] == [(victim, what, 1 - victim)]
    assert lines[0]["host"] and bool(lines[0]["job_id"]) == ("SLURM_CONF" in env)  # under SLURM
    said = [x for x in out.splitlines() if "ddpkit: [rank" in x]
    assert said and f"rank {victim} on " in said[0] and f"is {what}" in said[0], out
    # What was saved before the failure is whole: the next allocation resumes from it.
    with ckptstore.CheckpointStore(str(ckpt), experiment="default-exp") as store:
        newest = store.list()[-1].step
        assert newest >= 20 and store.verify(newest).ok
    figures["signal"] = f"SIG{sig} of rank {victim}"
    figures["all ranks gone"] = f"{took:.1f} s (target {TARGET_S[sig]:.0f} s)"
    figures["newest checkpoint"] = f"step {newest}, verified"
