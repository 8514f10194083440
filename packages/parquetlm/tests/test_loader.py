"""PackedLoader: coverage, sharding, exact restore, world-size change, split, epochs.

Most properties run on in-memory token streams ``arange(N)``, where token ``t`` sits at index
``t``, so every row of a batch names its window unambiguously (row[0] // seq_len).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parquetlm import (
    ByteTokenizer,
    FeistelPermutation,
    LoaderError,
    PackedLoader,
    ParquetSource,
    TokenCache,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def stream(n_tokens: int) -> np.ndarray:
    return np.arange(n_tokens, dtype=np.uint32)


def window_ids(batch: np.ndarray, seq_len: int) -> list[int]:
    """Which windows a batch holds, checking each row is exactly that window's tokens."""
    ids = []
    for row in batch:
        w = int(row[0]) // seq_len
        assert row[0] == w * seq_len
        np.testing.assert_array_equal(row, np.arange(w * seq_len, w * seq_len + seq_len + 1))
        ids.append(w)
    return ids


def global_steps(loaders: list[PackedLoader], steps: int) -> list[int]:
    """Window ids of ``steps`` global batches: rank 0's rows, then rank 1's, ..."""
    out: list[int] = []
    for _ in range(steps):
        for loader in loaders:
            out.extend(window_ids(loader.next_batch(), loader.seq_len))
    return out


def ranks(tokens: np.ndarray, world: int, **kw: object) -> list[PackedLoader]:
    return [PackedLoader(tokens, rank=r, world_size=world, **kw) for r in range(world)]  # type: ignore[arg-type]


@given(n=st.integers(1, 5000), key=st.integers(0, 2**64 - 1))
@SETTINGS
def test_feistel_is_a_bijection(n: int, key: int) -> None:
    perm = FeistelPermutation(n, key)
    out = perm(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))
    # Random access agrees with the bulk evaluation.
    k = n // 2
    assert perm(np.array([k]))[0] == out[k]


@given(
    n_tokens=st.integers(2, 3000),
    seq_len=st.integers(1, 64),
    batch=st.integers(1, 8),
    world=st.integers(1, 5),
    seed=st.integers(0, 2**31),
)
@SETTINGS
def test_ranks_cover_each_epoch_exactly_once(
    n_tokens: int, seq_len: int, batch: int, world: int, seed: int
) -> None:
    tokens = stream(n_tokens)
    if (n_tokens - 1) // seq_len < 1:
        with pytest.raises(LoaderError, match="seq_len"):
            PackedLoader(tokens, seq_len=seq_len, batch_size=batch)
        return
    loaders = ranks(tokens, world, seq_len=seq_len, batch_size=batch, seed=seed)
    n = loaders[0].windows_per_epoch
    assert n == (n_tokens - 1) // seq_len
    steps = -(-2 * n // (world * batch)) + 1  # past two whole epochs
    got = global_steps(loaders, steps)
    assert sorted(got[:n]) == list(range(n))  # epoch 0: every window exactly once
    assert sorted(got[n : 2 * n]) == list(range(n))  # epoch 1 too
    # The global order does not depend on world size or batch size: compare with one rank.
    single = PackedLoader(tokens, seq_len=seq_len, batch_size=1, seed=seed)
    assert got == global_steps([single], len(got))
    assert all(ld.epoch == len(got) // n for ld in loaders)


def test_epochs_roll_over_with_a_new_permutation() -> None:
    loader = PackedLoader(stream(10_001), seq_len=10, batch_size=1000, seed=3)
    epoch0 = window_ids(loader.next_batch(), 10)
    assert loader.epoch == 1
    epoch1 = window_ids(loader.next_batch(), 10)
    assert sorted(epoch0) == sorted(epoch1) == list(range(1000))
    assert epoch0 != epoch1
    assert epoch0 != list(range(1000))  # shuffled
    other_seed = PackedLoader(stream(10_001), seq_len=10, batch_size=1000, seed=4)
    assert window_ids(other_seed.next_batch(), 10) != epoch0
    unshuffled = PackedLoader(stream(10_001), seq_len=10, batch_size=1000, shuffle=False)
    assert window_ids(unshuffled.next_batch(), 10) == list(range(1000))


@given(
    n_tokens=st.integers(50, 3000),
    seq_len=st.integers(1, 32),
    batch=st.integers(1, 6),
    world=st.integers(1, 4),
    stop=st.integers(0, 40),
    more=st.integers(1, 20),
)
@SETTINGS
def test_stop_and_restore_equals_the_uninterrupted_stream(
    n_tokens: int, seq_len: int, batch: int, world: int, stop: int, more: int
) -> None:
    tokens = stream(n_tokens)
    kw = {"seq_len": seq_len, "batch_size": batch, "seed": 7}
    straight = ranks(tokens, world, **kw)
    expected = [[ld.next_batch() for _ in range(stop + more)] for ld in straight]
    first = ranks(tokens, world, **kw)
    for ld in first:
        for _ in range(stop):
            ld.next_batch()
    states = [json.loads(json.dumps(ld.state_dict())) for ld in first]
    assert all(s == states[0] for s in states)  # the same on every rank
    resumed = ranks(tokens, world, **kw)
    for ld in resumed:
        ld.load_state_dict(states[0])
        assert ld.step == stop
    for r, ld in enumerate(resumed):
        for i in range(more):
            np.testing.assert_array_equal(ld.next_batch(), expected[r][stop + i])


@given(
    n_tokens=st.integers(50, 3000),
    seq_len=st.integers(1, 32),
    shape1=st.tuples(st.integers(1, 4), st.integers(1, 6)),
    shape2=st.tuples(st.integers(1, 4), st.integers(1, 6)),
    stop=st.integers(0, 30),
    more=st.integers(1, 20),
)
@SETTINGS
def test_restore_on_another_world_size_continues_the_global_order(
    n_tokens: int,
    seq_len: int,
    shape1: tuple[int, int],
    shape2: tuple[int, int],
    stop: int,
    more: int,
) -> None:
    (w1, b1), (w2, b2) = shape1, shape2
    tokens = stream(n_tokens)
    before = ranks(tokens, w1, seq_len=seq_len, batch_size=b1, seed=11)
    seen = global_steps(before, stop)
    state = json.loads(json.dumps(before[0].state_dict()))
    after = ranks(tokens, w2, seq_len=seq_len, batch_size=b2, seed=11)
    for ld in after:
        ld.load_state_dict(state)
    seen += global_steps(after, more)
    reference = PackedLoader(tokens, seq_len=seq_len, batch_size=1, seed=11)
    # No window repeated or skipped: exactly the global stream's prefix.
    assert seen == global_steps([reference], len(seen))


def test_state_is_tiny_plain_and_restores_in_o1_at_any_position() -> None:
    tokens = stream(100_001)
    loader = PackedLoader(tokens, seq_len=100, batch_size=4, world_size=2, rank=1, seed=5)
    state = loader.state_dict()
    assert all(isinstance(v, (int, str)) for v in state.values())
    assert len(json.dumps(state)) < 600
    far = dict(state, position=10**15 + 3, step=123)
    loader.load_state_dict(far)
    assert loader.epoch == (10**15 + 3) // 1000
    got = window_ids(loader.next_batch(), 100)
    expect = loader.windows_at(np.arange(4) + 10**15 + 3 + 4).tolist()  # rank 1's slice
    assert got == expect
    assert loader.step == 124 and loader.position == 10**15 + 3 + 8


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"seed": 1}, "seed"),
        ({"seq_len": 9}, "seq_len"),
        ({"split": "val", "val_fraction": 0.1}, "split"),
        ({"val_fraction": 0.2}, "val_windows"),
        ({"shuffle": False}, "shuffle"),
    ],
)
def test_mismatched_state_is_refused(change: dict[str, object], match: str) -> None:
    tokens = stream(5000)
    base = {"seq_len": 10, "batch_size": 2, "seed": 0}
    state = PackedLoader(tokens, **base).state_dict()  # type: ignore[arg-type]
    other = PackedLoader(tokens, **{**base, **change})  # type: ignore[arg-type]
    with pytest.raises(LoaderError, match=match):
        other.load_state_dict(state)


def test_state_of_another_dataset_is_refused() -> None:
    state = PackedLoader(stream(5000), seq_len=10, batch_size=2).state_dict()
    with pytest.raises(LoaderError, match="another dataset"):
        PackedLoader(stream(5001), seq_len=10, batch_size=2).load_state_dict(state)
    with pytest.raises(LoaderError, match="not a PackedLoader state"):
        PackedLoader(stream(5000), seq_len=10, batch_size=2).load_state_dict({"position": 3})


@given(
    n_tokens=st.integers(30, 3000),
    seq_len=st.integers(1, 16),
    fraction=st.floats(0.01, 0.5),
    world=st.integers(1, 3),
    batch=st.integers(1, 4),
)
@SETTINGS
def test_val_split_is_disjoint_fixed_and_complete(
    n_tokens: int, seq_len: int, fraction: float, world: int, batch: int
) -> None:
    tokens = stream(n_tokens)
    kw = {"seq_len": seq_len, "batch_size": batch, "val_fraction": fraction}
    try:
        train = PackedLoader(tokens, split="train", seed=1, **kw)  # type: ignore[arg-type]
    except LoaderError as e:
        assert "no training window" in str(e)
        return
    val = PackedLoader(tokens, split="val", seed=99, **kw)  # type: ignore[arg-type]
    train_ids = set(global_steps([train], train.windows_per_epoch // batch + 1))
    val_ids = set(global_steps([val], val.windows_per_epoch // batch + 1))
    assert train_ids.isdisjoint(val_ids)
    assert train_ids | val_ids == set(range(train.num_windows))
    assert len(val_ids) == val.windows_per_epoch == val.val_windows
    # eval_batches: a fixed pass over the split, the same for every rank count, state untouched.
    loaders = ranks(tokens, world, split="val", seed=5, drop_last=False, **kw)  # type: ignore[arg-type]
    per_rank = [list(ld.eval_batches()) for ld in loaders]
    assert len({len(p) for p in per_rank}) == 1
    once = [w for step in zip(*per_rank, strict=True) for b in step for w in window_ids(b, seq_len)]
    assert sorted(once) == sorted(val_ids)
    assert all(ld.position == 0 for ld in loaders)
    fresh = PackedLoader(tokens, split="val", seed=5, **kw)  # type: ignore[arg-type]
    if fresh.windows_per_epoch >= batch:
        first = next(iter(fresh.eval_batches(max_batches=1)))
        np.testing.assert_array_equal(first, fresh.next_batch())


def test_eval_batches_drop_last_and_max_batches() -> None:
    def loader(rank: int, batch: int, drop_last: bool = True) -> PackedLoader:
        return PackedLoader(
            stream(1001), seq_len=10, batch_size=batch, world_size=2, rank=rank, drop_last=drop_last
        )

    assert len(list(loader(1, 3).eval_batches())) == 100 // 6
    # 100 windows, global batch 14: 7 full steps, then 2 windows, both on rank 0.
    tail0 = list(loader(0, 7, drop_last=False).eval_batches())
    tail1 = list(loader(1, 7, drop_last=False).eval_batches())
    assert len(tail0) == len(tail1) == 8
    assert tail0[-1].shape == (2, 11) and tail1[-1].shape == (0, 11)
    assert len(list(loader(0, 3).eval_batches(max_batches=5))) == 5
    assert next(iter(loader(0, 3).iter_once())).shape == (3, 11)


def test_batches_shape_dtype_and_take() -> None:
    tokens = stream(2000).astype(np.uint16)
    loader = PackedLoader(tokens, seq_len=16, batch_size=3)
    batches = list(loader.take(4))
    assert len(batches) == 4 and loader.step == 4 and loader.position == 12
    assert batches[0].shape == (3, 17) and batches[0].dtype == np.int64
    native = PackedLoader(tokens, seq_len=16, batch_size=3, dtype=None)
    assert native.next_batch().dtype == np.uint16
    np.testing.assert_array_equal(native.batch_at(0), batches[0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 0, "batch_size": 1}, "seq_len"),
        ({"seq_len": 4, "batch_size": 0}, "batch_size"),
        ({"seq_len": 4, "batch_size": 1, "rank": 2, "world_size": 2}, "rank"),
        ({"seq_len": 4, "batch_size": 1, "split": "test"}, "split"),
        ({"seq_len": 4, "batch_size": 1, "split": "val"}, "val_fraction>0"),
        ({"seq_len": 4, "batch_size": 1, "val_fraction": 1.0}, "val_fraction"),
        ({"seq_len": 4, "batch_size": 1, "dtype": "float32"}, "integer dtype"),
        ({"seq_len": 100, "batch_size": 1}, "needs at least 101 tokens but the corpus has 50"),
        ({"seq_len": 4, "batch_size": 1, "val_fraction": 0.95}, "no training window"),
    ],
)
def test_bad_settings_say_how_to_fix_them(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(LoaderError, match=match):
        PackedLoader(stream(50), **kwargs)  # type: ignore[arg-type]


def test_windows_pack_documents_with_eot_and_no_padding(tmp_path: Path, tools: Any) -> None:
    texts = tools.make_texts(60, seed=4)
    tools.write_parquet(tmp_path / "d.parquet", texts, row_group_size=7)
    cache = TokenCache.build(ParquetSource(tmp_path / "d.parquet"), ByteTokenizer(), tmp_path / "c")
    loader = PackedLoader(cache, seq_len=32, batch_size=5, shuffle=False)
    rows = [row for b in loader.take(loader.windows_per_epoch // 5) for row in b]
    # Consecutive windows overlap by one token; dropping it rebuilds the stream exactly.
    joined = np.concatenate([rows[0]] + [r[1:] for r in rows[1:]])
    expect = b"".join(t.encode() + b"\xff" for t in texts)  # 0xff marks the EOT (256)
    got = bytes(np.where(joined == 256, 255, joined).astype(np.uint8))
    assert got == expect[: len(got)]
    assert len(got) == len(rows) * 32 + 1 > len(expect) - 5 * 32 - 32
