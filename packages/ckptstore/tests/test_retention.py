"""Retention: by step number, milestones, best-K; never the newest verified, never foreign."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_helpers import corrupt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import CheckpointStore, RetentionPolicy


def test_steps_compare_as_numbers() -> None:
    steps = {9000: {}, 10000: {}, 500: {}, 99999: {}}
    assert RetentionPolicy(keep_last=2).select(steps, head=99999) == [500, 9000]


def test_keep_every_and_best() -> None:
    loss = {1: 9.0, 2: 8.0, 3: 4.0, 4: 7.0, 5: 5.0, 6: 6.0, 7: 5.0, 8: 8.5, 9: 9.5}
    steps = {s: {"val_loss": v} for s, v in loss.items()}
    steps[10] = {"val_loss": float("nan")}  # not a number to rank: ignored by keep_best
    steps[11] = {}
    p = RetentionPolicy(keep_last=1, keep_every=4, keep_best=2)
    assert p.best(steps, steps) == [3, 7]  # 5.0 at steps 5 and 7: the newer wins the tie
    assert sorted(set(steps) - set(p.select(steps, head=11))) == [3, 4, 7, 8, 11]
    assert RetentionPolicy(keep_best=1, best_mode="max").best(steps, steps) == [9]


def test_steps_above_the_pointer_and_protected_ones_stay() -> None:
    steps = {s: {} for s in range(1, 11)}
    doomed = RetentionPolicy(keep_last=2).select(steps, head=5, protected={1})
    assert doomed == [2, 3]  # 4, 5 kept; 6..10 are an abandoned future: untouched


def test_inactive_policy_deletes_nothing() -> None:
    assert RetentionPolicy().select({1: {}, 2: {}}, head=2) == []


@pytest.mark.parametrize(
    "kw", [{"keep_last": 0}, {"keep_every": -1}, {"keep_best": True}, {"best_mode": "avg"}]
)
def test_bad_policies_say_how_to_fix(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be"):
        RetentionPolicy(**kw)  # type: ignore[arg-type]


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sets(st.integers(0, 10**9), min_size=1, max_size=30),
    st.integers(1, 5),
    st.one_of(st.none(), st.integers(1, 100)),
    st.sets(st.integers(0, 10**9), max_size=3),
)
def test_policy_invariants(
    steps: set[int], keep_last: int, keep_every: int | None, protected: set[int]
) -> None:
    head = max(steps)
    doomed = RetentionPolicy(keep_last=keep_last, keep_every=keep_every).select(
        {s: {} for s in steps}, head=head, protected=protected
    )
    assert head not in doomed and not (set(doomed) & protected)
    newest = sorted(steps)[-keep_last:]
    assert not set(doomed) & set(newest)
    assert doomed == sorted(doomed) and set(doomed) <= steps


def test_never_deletes_the_newest_verified_checkpoint(tmp_path: Path) -> None:
    url = str(tmp_path)
    with CheckpointStore(url) as store:
        for step in (1, 2, 3):
            store.save(step, {"w": torch.full((4,), float(step))})
    corrupt(f"{url}/step-00000003", {}, "flip")
    with CheckpointStore(url, keep_last=1) as fresh:  # knows nothing: must verify
        assert fresh.prune() == [1]
        assert fresh.steps() == [2, 3]  # 3 is newest, 2 is the newest that verifies
        loaded = {"w": torch.zeros(4)}
        with pytest.warns(UserWarning, match="checksum"):
            assert fresh.load(loaded).step == 2


def test_prune_touches_only_checkpoints(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        for step in (1, 2, 3):
            store.save(step, {"w": torch.ones(2)})
    (tmp_path / "step-00000001" / "my-notes.txt").write_text("keep me")
    (tmp_path / "step-00000099").mkdir()  # not committed, not ours to judge
    (tmp_path / "step-00000099" / "data.bin").write_bytes(b"x")
    (tmp_path / "other.pt").write_bytes(b"y")
    with CheckpointStore(str(tmp_path), keep_last=1) as store:
        assert store.prune(dry_run=True) == [1, 2]
        assert store.steps() == [1, 2, 3]
        assert store.prune() == [1, 2]
        assert store.steps() == [3]
    assert (tmp_path / "step-00000001" / "my-notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in (tmp_path / "step-00000001").iterdir()) == ["my-notes.txt"]
    assert not (tmp_path / "step-00000002").exists()
    assert (tmp_path / "step-00000099" / "data.bin").exists()
    assert (tmp_path / "other.pt").exists()


def test_keep_best_by_metric(tmp_path: Path) -> None:
    losses = {1: 0.9, 2: 0.3, 3: 0.8, 4: 0.7, 5: 0.6}
    with CheckpointStore(str(tmp_path), keep_last=1, keep_best=1) as store:
        for step, loss in losses.items():
            store.save(step, {"w": torch.ones(2)}, metadata={"val_loss": loss})
        assert store.steps() == [2, 5]


def test_a_checkpoint_being_loaded_is_not_pruned(tmp_path: Path) -> None:
    from typing import Any

    from ckptstore import register_format
    from ckptstore.formats.torchfile import TorchFormat

    pruned: list[list[int]] = []
    holder: dict[str, CheckpointStore] = {}

    class PruneWhileLoading(TorchFormat):
        def load(self, manifest: Any, ctx: Any, keys: Any, like: Any) -> dict[str, Any]:
            pruned.append(holder["store"].prune())  # e.g. another thread pruning right now
            return super().load(manifest, ctx, keys, like)

    register_format("prune-probe", PruneWhileLoading, clobber=True)
    with CheckpointStore(str(tmp_path), format="prune-probe") as store:
        for step in (1, 2, 3):
            store.save(step, {"w": torch.full((2,), float(step))})
    with CheckpointStore(str(tmp_path), format="prune-probe", keep_last=1) as store:
        holder["store"] = store
        loaded = {"w": torch.zeros(2)}
        assert store.load(loaded, step=1).step == 1
        assert pruned == [[2]] and float(loaded["w"][0]) == 1.0
        assert store.steps() == [1, 3]


def test_a_checkpoint_being_written_is_not_pruned(tmp_path: Path) -> None:
    """Step 1 saved again (a rewind) while a prune runs: its directory is being written, so the
    prune leaves it alone even though the policy alone would delete it."""
    import threading
    from typing import Any

    from ckptstore import register_format
    from ckptstore.formats.torchfile import TorchFormat

    gate, writing = threading.Event(), threading.Event()

    class Gated(TorchFormat):
        def persist(self, staged: Any, ctx: Any) -> None:
            writing.set()
            assert gate.wait(60)
            super().persist(staged, ctx)

    register_format("prune-gated", Gated, clobber=True)
    gate.set()
    with CheckpointStore(str(tmp_path), format="prune-gated") as store:
        for step in (1, 2, 3):
            store.save(step, {"w": torch.full((2,), float(step))})
    gate.clear()
    writing.clear()
    with CheckpointStore(str(tmp_path), format="prune-gated", keep_last=1) as store:
        handle = store.save(1, {"w": torch.full((2,), 10.0)}, blocking=False)
        assert writing.wait(60)
        try:
            assert store.prune() == [2]  # the policy alone says [1, 2]
        finally:
            gate.set()
        handle.result()
        loaded = {"w": torch.zeros(2)}
        assert store.load(loaded).step == 1 and float(loaded["w"][0]) == 10.0
