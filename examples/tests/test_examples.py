"""The examples, run as a user runs them, against the real libraries (CPU).

Each one: a straight run finishes with exit 0; a run given a deadline (``PYRECOVER_END_TIME`` a few
seconds out) stops with a committed checkpoint and exit 75; run again it resumes, finishes with
exit 0 and ends with the very weights of the straight run; a fourth run finds it finished.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[1]
REQUIRES = {
    "own_loop": ("ddpkit", "ckptstore", "parquetlm", "slurmclock"),
    "lightning_time_aware": ("lightning", "torchdata", "ckptstore", "slurmclock"),
    "hf_trainer_time_aware": ("transformers", "accelerate", "slurmclock"),
}
# A deadline this close is reached during start-up or the first seconds of training, however
# fast or loaded the machine: the run always stops early (at the latest after its first step).
DEADLINE_S = 5


def run(name: str, cwd: Path, deadline: float | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYRECOVER_"))}
    env["PYTHONUNBUFFERED"] = "1"
    if deadline is not None:
        env["PYRECOVER_END_TIME"] = f"{deadline:.3f}"
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / f"{name}.py")],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 240) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def digest(out: str) -> str:
    m = re.search(r"^weights ([0-9a-f]{16})$", out, re.MULTILINE)
    assert m, f"no weights line in:\n{out[-2000:]}"
    return m.group(1)


@pytest.mark.parametrize("name", list(REQUIRES))
def test_example_stops_in_time_and_resumes_exactly(name: str, tmp_path: Path) -> None:
    for module in REQUIRES[name]:
        pytest.importorskip(module)
    straight_dir, stopped_dir = tmp_path / "straight", tmp_path / "stopped"
    straight_dir.mkdir()
    stopped_dir.mkdir()
    straight = run(name, straight_dir)  # side by side with the interrupted run
    rc, out = finish(run(name, stopped_dir, deadline=time.time() + DEADLINE_S))
    assert rc == 75, out[-3000:]
    assert re.search(r"^stopped at step \d+/\d+", out, re.MULTILINE), out[-3000:]
    # Start-up counts against the deadline: said, so "-12.5 s left" on a loaded machine does
    # not read as broken (issue 30). The deadline was DEADLINE_S after the test's clock read.
    used = re.search(r"; start-up used (\d+\.\d) s of (-?\d+\.\d) s$", out, re.MULTILINE)
    assert used, out[-3000:]
    assert float(used.group(1)) > 0 and 0 < float(used.group(2)) <= DEADLINE_S + 0.1, used[0]
    assert_committed(name, stopped_dir)

    rc_straight, out_straight = finish(straight)
    assert rc_straight == 0, out_straight[-3000:]
    rc, out = finish(run(name, stopped_dir))
    assert rc == 0, out[-3000:]
    assert digest(out) == digest(out_straight)  # bitwise the weights of the straight run

    rc, out = finish(run(name, stopped_dir))
    assert rc == 0 and "finished step" in out, out[-3000:]


def assert_committed(name: str, cwd: Path) -> None:
    """The stop left a checkpoint that verifies (ckptstore) or is complete (HF)."""
    if name == "hf_trainer_time_aware":
        from slurmclock.hf import last_checkpoint

        ckpt = last_checkpoint(cwd / "example-runs" / "hf")
        assert ckpt is not None and (Path(ckpt) / "optimizer.pt").is_file()
        return
    from ckptstore import CheckpointStore

    root = {"own_loop": "own_loop", "lightning_time_aware": "lightning/timeaware.ckpt"}[name]
    with CheckpointStore(str(cwd / "example-runs" / root), distributed=False) as store:
        assert store.latest_step() is not None
        report = store.verify()
        assert report.ok, report.problems


@pytest.mark.slurm
def test_own_loop_under_a_real_slurm_deadline(tmp_path: Path) -> None:
    """In a real SLURM job the end time comes from squeue: the loop stops before the kill with a
    committed checkpoint, exits 75, and requeue-on-75.sh puts the job back in the queue; there
    the loop is SIGKILLed after it resumed, and the job comes back again (a crash, retried)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "localslurm", EXAMPLES.parent / "tools" / "localslurm.py"
    )
    assert spec and spec.loader
    localslurm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(localslurm)
    if (why := localslurm.unavailable_reason()) is not None:
        if os.environ.get("PYRECOVER_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    pytest.importorskip("parquetlm")
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYRECOVER_END_TIME": ""}
    env["EXAMPLE_STEPS"] = "1000000"  # far more than one minute of training
    with localslurm.LocalCluster(tmp_path / "slurm", cpus=2) as cluster:
        job = cluster.sbatch(
            EXAMPLES / "slurm" / "requeue-on-75.sh",
            "--time=1",
            f"--output={tmp_path}/job.out",
            cwd=tmp_path,
            env=env,
            script_args=[sys.executable, str(EXAMPLES / "own_loop.py")],
        )
        log_path = tmp_path / "job.out"

        def said(what: str) -> bool:
            return log_path.exists() and what in log_path.read_text(errors="replace")

        wait(lambda: said("resumed from step"), 300)
        pids = own_loop_pids(tmp_path)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        wait(lambda: said("restart 2:"), 120)
        cluster.run(["scancel", job], check=False)
        log = log_path.read_text(errors="replace")
        assert "training step exited with status 137" in log, log[-3000:]
        assert "training failed (exit 137 (killed by SIGKILL), failure 1 of 3" in log, log
        assert "exited with status 75" in log and "stopped early with steps left" in log, log
        assert f"requeued job {job} (restart 1)" in log, log[-3000:]
        assert re.search(r"stopped at step \d+/1000000 \(stop: [\d.]+ s left <", log), log[-3000:]
        assert_committed("own_loop", tmp_path)


def wait(ok: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def own_loop_pids(cwd: Path) -> list[int]:
    """The ``python own_loop.py`` processes working in ``cwd`` (this test's task, not its srun,
    not the supervisor, not another test's)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            here = os.readlink(proc / "cwd")
        except OSError:
            continue
        if len(argv) > 1 and argv[1].endswith(b"own_loop.py") and Path(here) == cwd:
            found.append(int(proc.name))
    return found


def test_what_the_examples_and_the_sbatch_scripts_write_is_ignored_by_git() -> None:
    """`example-runs/` (the examples' checkpoints) and `pyrecover-JOB.out` (the sbatch scripts'
    log, written where they are submitted) showed as untracked files (issue 30)."""
    root = EXAMPLES.parent
    inside = subprocess.run(["git", "rev-parse"], cwd=root, capture_output=True, timeout=60)
    if inside.returncode != 0:
        pytest.skip("not a git checkout")
    paths = ["example-runs/hf/checkpoint-3/trainer_state.json", "pyrecover-4242.out"]
    out = subprocess.run(
        ["git", "check-ignore", *paths], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == paths, out.stdout + out.stderr
