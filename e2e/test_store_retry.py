"""The checkpoint store down when a run starts (exit 74, issue 30): the shipped script's
supervisor starts the step again inside the allocation after a pause, one line each time, never
counting it as a failure; once the real S3 endpoint (moto_server behind a proxy the test cuts)
answers again, training goes on and the job finishes -- no requeue, no crash budget spent.

Two trainers: a stand-in that only reaches the store (boto3) and exits 74 when it does not
answer (the supervisor's side, whatever the trainer), and pyrecover-train itself once it exits
74 when its store is down at its start (issue 30's storage item)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import Job, short_flags, wait_until

from pyrecover_train import trainer

pytestmark = [pytest.mark.slurm, pytest.mark.s3]

STAND_IN = """#!{python}
import sys
import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError

once = Config(connect_timeout=2, read_timeout=5, retries={{"max_attempts": 1}})
s3 = boto3.client("s3", config=once)
try:
    s3.list_objects_v2(Bucket="ckpt")
except BotoCoreError as e:
    print(f"the checkpoint store does not answer ({{type(e).__name__}}): exit 74", flush=True)
    sys.exit(74)
print("the checkpoint store answers: training", flush=True)
"""
RETRIED = re.compile(
    r"the checkpoint store could not be reached \(exit 74: nothing lost, not a failure\): "
    r"trying again in (\d+) s in this allocation"
)


@pytest.mark.parametrize("who", ["stand-in", "pyrecover-train"])
def test_a_start_the_store_refused_is_tried_again_in_the_allocation(
    who: str, cluster: Any, moto: Any, corpus: Path, cache_dir: Path, tmp_path: Path,
    figures: dict[str, Any],
) -> None:  # fmt: skip
    """12. the store down at the start: tried again, not a failure"""
    if who == "pyrecover-train" and getattr(trainer, "EXIT_STORE_UNAVAILABLE", None) != 74:
        pytest.skip("pyrecover-train does not exit 74 for a store that is down at its start yet")
    job = Job(cluster, tmp_path, who)
    env = moto.env()
    if who == "stand-in":
        command = tmp_path / "stand_in.py"
        command.write_text(STAND_IN.format(python=sys.executable))
        command.chmod(0o755)
        env["TRAIN_CMD"], flags = str(command), []
    else:
        flags = short_flags(corpus, cache_dir, tmp_path / "unused")
        flags += ["--checkpoint-url", "s3://ckpt/store"]
    moto.disconnect()
    try:
        record = job.submit(["--time=10"], flags, **env)
        wait_until(f"{who}: a retry", lambda: RETRIED.search(job.log()) is not None, 600)
    finally:
        moto.reconnect()
    job.finish(record, timeout=900)
    log = record.log
    assert record.info["JobState"] == "COMPLETED" and record.info["RestartCnt"] == "0", log
    assert "training finished" in log and "requeued job" not in log, log
    pauses = [int(p) for p in RETRIED.findall(log)]
    assert pauses and pauses == [5 * 2**i for i in range(len(pauses))], pauses  # doubling
    timeline = job.dir / "timelines" / f"{cluster.cluster_name}-{job.id}.jsonl"
    names = [json.loads(line)["event"] for line in timeline.read_text().splitlines()]
    assert "failed" not in names and names.count("relaunched") == len(pauses), names
    figures["tries"] = len(pauses) + 1
    figures["pauses"] = ", ".join(f"{p} s" for p in pauses)
