"""Real multi-process runs (gloo, 2 ranks): DCP dedup, resharding 1 -> 2 -> 1, async saves next
to training collectives, and ranks agreeing on a fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import (
    TESTS,
    assert_same_state,
    blank_state,
    communicate_all,
    make_state,
    rank_envs,
)

from ckptstore import CheckpointStore

WORKER = TESTS / "ckpt_dist_worker.py"


@pytest.mark.slow
def test_two_ranks(tmp_path: Path) -> None:
    # single-process checkpoints, for the 1 -> 2 direction
    for fmt in ("dcp", "torch"):
        with CheckpointStore(str(tmp_path / f"{fmt}1"), format=fmt) as store:
            store.save(1, make_state(1))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path)],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for env in rank_envs(2)
    ]
    outputs = communicate_all(procs)
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
        shards = [f for f in m2.files if f.path != ".metadata"]  # and DCP's own index
        assert m2.world_size == 2 and len(shards) == 2 and len(m2.files) == 3
        assert sorted(f.rank for f in shards) == [0, 1]
        assert all(f.size > 0 for f in shards)
        assert m2.bytes < 1.1 * m1.bytes  # not two copies
        # 2 -> 1
        for step in (2, 3):
            loaded = blank_state()
            assert two.load(loaded, step=step).step == step
            assert_same_state(make_state(step), loaded)
    # sharded 2 -> 1: the two shards come back as one full tensor
    with CheckpointStore(str(tmp_path / "sharded"), format="dcp") as store:
        assert len(store.manifest(1).files) == 3  # two shards and .metadata
        got: dict = {"w": None}
        store.load(got)
        assert torch.equal(got["w"]["x"], torch.arange(64 * 3, dtype=torch.float32).reshape(64, 3))
    with CheckpointStore(str(tmp_path / "torch2")) as store:
        m = store.manifest(2)
        assert m.world_size == 2 and len(m.files) == 1  # rank 0 alone writes the 'torch' format
        loaded = blank_state()
        store.load(loaded, step=2)
        assert_same_state(make_state(2), loaded)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_a_background_save_the_store_refused_reaches_every_rank(tmp_path: Path, fmt: str) -> None:
    """Rank 0 alone learned that its background save failed (the store did not answer), at
    the next save, and raised there while rank 1 waited for it in that save's agreement; now
    every rank raises StoreUnreachableError, and the next save after the outage goes through."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(TESTS / "ckpt_outage_worker.py"), str(tmp_path), fmt],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for env in rank_envs(2)
    ]
    outputs = communicate_all(procs, timeout=120)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    assert all(r["ok"] for r in results), (results, outputs)
    assert results[0]["error"].startswith("the store did not answer at "), results
    assert results[1]["error"].startswith(  # or of its own part, had DCP given it one to write
        ("preparing step 3 failed on rank 0: the store did not answer", "the store did not")
    ), results
    assert results[0]["steps"] == [1, 4]
