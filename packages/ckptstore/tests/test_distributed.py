"""Real multi-process runs (gloo, 2 ranks): DCP dedup, resharding 1 -> 2 -> 1, async saves next
to training collectives, and ranks agreeing on a fallback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import TESTS, assert_same_state, blank_state, make_state

from ckptstore import CheckpointStore

WORKER = TESTS / "ckpt_dist_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_two_ranks(tmp_path: Path) -> None:
    # single-process checkpoints, for the 1 -> 2 direction
    for fmt in ("dcp", "torch"):
        with CheckpointStore(str(tmp_path / f"{fmt}1"), format=fmt) as store:
            store.save(1, make_state(1))
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(tmp_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results, problems = [], []
    for rank in range(2):
        f = tmp_path / f"result-{rank}.json"
        r = json.loads(f.read_text()) if f.exists() else {"ok": False, "error": "no result"}
        results.append(r)
        if not r["ok"]:
            problems.append(f"rank {rank}: {r.get('error')}\noutput:\n{outputs[rank][-3000:]}")
    assert not problems, "\n\n".join(problems)
    assert [p.returncode for p in procs] == [0, 0]
    # only the coordinator reports commits
    assert [s["step"] for s in results[0]["stats"]] == [3]
    assert results[1]["stats"] == []

    # DCP wrote each replicated tensor once, spread over both ranks' files
    with (
        CheckpointStore(str(tmp_path / "dcp2"), format="dcp") as two,
        CheckpointStore(str(tmp_path / "dcp1"), format="dcp") as one,
    ):
        m2, m1 = two.manifest(2), one.manifest(1)
        assert m2.world_size == 2 and len(m2.files) == 2
        assert sorted(f.rank for f in m2.files) == [0, 1]
        assert all(f.size > 0 for f in m2.files)
        assert m2.bytes < 1.1 * m1.bytes  # not two copies
        # 2 -> 1
        for step in (2, 3):
            loaded = blank_state()
            assert two.load(loaded, step=step).step == step
            assert_same_state(make_state(step), loaded)
    # sharded 2 -> 1: the two shards come back as one full tensor
    with CheckpointStore(str(tmp_path / "sharded"), format="dcp") as store:
        assert len(store.manifest(1).files) == 2
        got: dict = {"w": None}
        store.load(got)
        assert torch.equal(got["w"]["x"], torch.arange(64 * 3, dtype=torch.float32).reshape(64, 3))
    with CheckpointStore(str(tmp_path / "torch2")) as store:
        m = store.manifest(2)
        assert m.world_size == 2 and len(m.files) == 1  # rank 0 alone writes the 'torch' format
        loaded = blank_state()
        store.load(loaded, step=2)
        assert_same_state(make_state(2), loaded)
