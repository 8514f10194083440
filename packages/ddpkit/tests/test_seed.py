from __future__ import annotations

import random
import sys
import types

import pytest
import torch

from ddpkit import seed_everything


def draw() -> tuple[float, float]:
    return random.random(), float(torch.rand(1))


def test_same_seed_same_streams_and_rank_offset() -> None:
    assert seed_everything(42) == 42
    a = draw()
    seed_everything(42)
    assert draw() == a
    assert seed_everything(42, rank=3) == 45
    b = draw()
    assert b != a
    seed_everything(45)
    assert draw() == b  # documented: the effective seed is seed + rank


def test_numpy_is_seeded_when_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    fake = types.ModuleType("numpy")
    fake.random = types.SimpleNamespace(seed=seen.append)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "numpy", fake)
    seed_everything(10, rank=1)
    assert seen == [11]


def test_works_without_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "numpy", None)  # `import numpy` raises ImportError
    assert seed_everything(3) == 3
    x = torch.rand(1)
    seed_everything(3)
    assert torch.equal(torch.rand(1), x)


def test_every_cuda_device_is_seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's CUDA generators get the same effective seed (lazily, so also without a GPU)."""
    seen: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seen.append)
    seed_everything(7, rank=2)
    assert seen == [9]


def test_real_numpy_stream() -> None:
    import numpy as np  # a test requirement; test_rng.py proves ddpkit works without it

    seed_everything(5)
    a = np.random.rand()
    seed_everything(5)
    assert np.random.rand() == a


@pytest.mark.parametrize(
    ("seed", "rank", "error"),
    [
        (-1, 0, ValueError),
        (2**32, 0, ValueError),
        (2**32 - 1, 1, ValueError),
        (1, -1, ValueError),
        (1.5, 0, TypeError),
        (True, 0, TypeError),
    ],
)
def test_bad_seeds(seed: object, rank: int, error: type[Exception]) -> None:
    with pytest.raises(error):
        seed_everything(seed, rank)  # type: ignore[arg-type]
