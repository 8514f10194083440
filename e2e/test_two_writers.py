"""Scenario 8: two writers on one experiment. A second `pyrecover-train` started on the experiment
a first one is training (the same job submitted twice) is refused with one line naming the first,
before it does any work; the first is unharmed: nothing of the second is in its metrics, and it
finishes bitwise equal to a run that was alone."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import SHORT_EVERY, SHORT_STEPS, events, short_flags
from train_helpers import (
    assert_bitwise_equal,
    final_state,
    run_cli,
    running_cli,
    wait_for_step,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_a_second_writer_is_refused(
    corpus: Path, cache_dir: Path, short_reference: Path, tmp_path: Path, figures: dict[str, Any]
) -> None:
    """8. two writers: a second trainer on the same experiment"""
    ckpt = tmp_path / "ckpt"
    metrics = ckpt / "default-exp" / "metrics.jsonl"
    args = short_flags(corpus, cache_dir, ckpt)
    with running_cli(args) as first:
        wait_for_step(first, metrics, 0, SHORT_EVERY + 1)  # it has committed a checkpoint
        t0 = time.monotonic()
        second = run_cli([*args, "--resume-from-checkpoint", "latest"])  # the job, again
        refused_after = time.monotonic() - t0
        at = max(e["step"] for e in events(metrics) if e["event"] == "step")
        out, _ = first.communicate(timeout=900)
    assert second.returncode == 2, second.stdout + second.stderr
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and second.stdout == "", second.stdout + second.stderr
    assert "is being written by another run" in lines[0] and f"pid {first.pid}," in lines[0]
    assert first.returncode == 0, out
    assert "writer lock" not in out  # the first never heard of the second
    assert len({e["run"] for e in events(metrics)}) == 1  # nothing of the second was written
    _, want = final_state(short_reference)
    manifest, got = final_state(ckpt)
    assert manifest.step == SHORT_STEPS
    assert_bitwise_equal(want, got)
    figures["second"] = f"refused at step {at} of the first, exit 2 in {refused_after:.1f} s"
    said = lines[0][lines[0].index("is being written") :]
    figures["line"] = said[:60] + "..."
    figures["first"] = "unharmed, bitwise equal"
