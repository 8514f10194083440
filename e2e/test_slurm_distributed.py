"""Scenario 7: `srun -n 2` on CPU/gloo with `--distributed --use-torch-distributed-ckpt`, stopped by
SLURM's time limit; then a 1-task job resumes the same experiment: DCP reshards 2 -> 1 and the
data goes on from the global position both ranks reached, neither repeating nor skipping."""

from __future__ import annotations

from typing import Any

import pytest
from e2e_helpers import LongRuns, one, runs
from train_helpers import final_state

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(3000)]

BATCH = 4  # tiny_flags' --batch-size, per rank


def test_two_tasks_stop_for_time_then_one_resumes(long: LongRuns, figures: dict[str, Any]) -> None:
    """7. distributed: srun -n 2 stopped by time, resumed on 1 process"""
    seen = long.background.result("distributed", timeout=2400)
    two, single = seen["two"], seen["one"]
    assert two.info["JobState"] == "COMPLETED", two.log
    assert "; not requeueing (the next array task / chained job resumes)" in two.log, two.log
    assert single.info["JobState"] == "COMPLETED", single.log

    first, second = runs(seen["metrics"])  # rank 0 writes the metrics: one run per job
    start, stop = one(first, "start"), one(first, "stop")
    assert start["world_size"] == 2 and start["deadline_source"] == "squeue", start
    assert stop["cause"] in ("time", "signal") and stop["exit_code"] == 75, stop
    stopped = stop["step"]
    assert 0 < stopped < 3000

    resume = one(second, "resume")
    assert one(second, "start")["world_size"] == 1
    assert resume["step"] == stopped
    # The global data position: both ranks' batches of every step before the stop ...
    assert resume["data_state"]["position"] == stopped * 2 * BATCH, resume["data_state"]
    # ... then one rank's batch per step, continuing from there.
    steps = [e for e in second if e["event"] == "step"]
    for e in steps:
        assert e["data_position"] == stopped * 2 * BATCH + (e["step"] - stopped) * BATCH, e
    assert one(second, "stop")["cause"] == "done" and steps[-1]["step"] == 3000
    assert "world size changed (2 in the checkpoint, 1 now)" in single.log, single.log

    manifest, state = final_state(seen["ckpt"].parent, seen["ckpt"].name)
    assert manifest.format == "dcp" and manifest.world_size == 1 and manifest.step == 3000
    assert state["data"]["position"] == stopped * 2 * BATCH + (3000 - stopped) * BATCH
    figures["stopped at"] = f"step {stopped} on 2 ranks ({stop['cause']})"
    figures["resumed"] = "1 rank, DCP resharded"
