"""A disk that fills up during a save: a clear error, nothing half-committed, the previous
checkpoint intact and loadable. Uses a real 8 MiB tmpfs (needs root / CAP_SYS_ADMIN)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ckpt_helpers import FORMATS, assert_same_state, load_tool

from ckptstore import CheckpointError, CheckpointStore

tmpfs = load_tool("tmpfs")


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    try:
        with tmpfs.mounted(tmp_path / "tiny", "8m") as mnt:
            yield mnt
    except tmpfs.Unavailable as e:
        pytest.skip(str(e))


def state_of(n: int, seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(n, generator=torch.Generator().manual_seed(seed))}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_disk_full_during_save(tiny_disk: Path, fmt: str, blocking: bool) -> None:
    root = str(tiny_disk / "ckpt")
    small = state_of(250_000, 1)  # 1 MB
    with CheckpointStore(root, format=fmt) as store:
        store.save(1, small)
        full = "no space left.*previous checkpoint is intact"
        if blocking:
            with pytest.raises(CheckpointError, match=full):
                store.save(2, state_of(2_500_000, 2))  # 10 MB > 8 MiB
        else:
            handle = store.save(2, state_of(2_500_000, 2), blocking=False)
            with pytest.raises(CheckpointError, match=full):
                store.wait()  # the background error surfaces here...
            store.wait()  # ...once
            with pytest.raises(CheckpointError, match=full):
                handle.result()  # and the handle still tells what happened
        assert [c.step for c in store.list()] == [1]
        assert store.verify(1).ok
        loaded = {"w": torch.zeros(250_000)}
        assert store.load(loaded).step == 1
        assert_same_state(small, loaded)
    leftovers = [f for _, _, fs in os.walk(tiny_disk) for f in fs if ".tmp-" in f]
    assert leftovers == []
    assert (tiny_disk / "ckpt" / "latest").read_text().strip() == "step-00000001"


def test_disk_full_error_is_raised_by_the_blocking_call(tiny_disk: Path) -> None:
    with CheckpointStore(str(tiny_disk / "c")) as store, pytest.raises(CheckpointError) as info:
        store.save(1, state_of(2_500_000, 0))
    msg = str(info.value)
    assert "no space left" in msg and "free space" in msg and "\n" not in msg
