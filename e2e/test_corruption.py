"""Scenario 4: the newest checkpoint is damaged on disk after the run stopped (a flipped byte, a
truncated file). `ckptstore verify` exits 1 naming the file; the trainer warns, resumes from the
checkpoint before it, and still ends bitwise equal to a straight run."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import SHORT_STEPS, short_flags
from train_helpers import assert_bitwise_equal, events, final_state, run_cli, start_cli

import ckptstore

pytestmark = [pytest.mark.slow]


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x10
    else:
        del data[len(data) // 2 :]
    path.write_bytes(bytes(data))


def stop_after(args: list[str], metrics: Path, step: int) -> str:
    """Start a run and send it SLURM's warning signal once it passed ``step``."""
    from train_helpers import wait_for_step

    proc = start_cli(args)
    try:
        wait_for_step(proc, metrics, 0, step)
        proc.send_signal(signal.SIGUSR2)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, out
    return out


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_damaged_newest_checkpoint(
    how: str,
    corpus: Path,
    cache_dir: Path,
    short_reference: Path,
    tmp_path: Path,
    figures: dict[str, Any],
) -> None:
    """4. corruption: a damaged newest checkpoint"""
    ckpt = tmp_path / "ckpt"
    args = short_flags(corpus, cache_dir, ckpt)
    stop_after(args, ckpt / "default-exp" / "metrics.jsonl", 12)
    with ckptstore.CheckpointStore(str(ckpt), experiment="default-exp") as store:
        *_, previous, newest = [c.step for c in store.list()]
    step_dir = ckpt / "default-exp" / f"step-{newest:08d}"
    payload = max(
        (p for p in step_dir.rglob("*") if p.is_file() and p.name != "manifest.json"),
        key=lambda p: p.stat().st_size,
    )
    damage(payload, how)

    verify = subprocess.run(
        [sys.executable, "-m", "ckptstore", "verify", str(ckpt), "--experiment", "default-exp"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 1, verify.stdout + verify.stderr
    said = verify.stdout + verify.stderr
    assert payload.name in said and re.search("checksum|truncated|size", said), said

    r = run_cli([*args, "--resume-from-checkpoint", "latest"])
    assert r.returncode == 0, r.stdout + r.stderr
    warned = r.stdout + r.stderr
    # One warning names what was skipped, why, and where it went instead.
    assert "ckptstore: skipped" in warned and f"trying step {previous}" in warned, warned
    assert payload.name in warned, warned
    resumes = [e for e in events(ckpt) if e["event"] == "resume"]
    assert [e["step"] for e in resumes] == [previous], resumes

    _, want = final_state(short_reference)
    manifest, got = final_state(ckpt)
    assert manifest.step == SHORT_STEPS
    assert_bitwise_equal(want, got)
    figures[how] = f"verify exit 1 naming {payload.name}; resumed from {previous} not {newest}"
    figures["bitwise"] = "equal"
