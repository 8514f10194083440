"""RNG capture and restore: every generator, packed as tensors, loadable with weights_only, and
numpy optional (checked in a subprocess in which numpy cannot be imported)."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch

import ddpkit
from ddpkit import reseed_rng, rng_state, set_rng_state

KEYS = {"python_mt", "python_meta", "numpy_keys", "numpy_meta", "torch_cpu"}


def draws() -> tuple[float, float, float, float]:
    return random.random(), random.gauss(0, 1), float(np.random.rand()), float(torch.rand(1))


def test_round_trip_through_a_weights_only_file() -> None:
    ddpkit.seed_everything(3)
    random.gauss(0, 1)  # leaves a cached gauss value in python's state
    state = rng_state()
    assert set(state) == KEYS  # the on-disk names of pyrecover-train checkpoints
    assert all(isinstance(t, torch.Tensor) for t in state.values())
    expected = draws()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    ddpkit.seed_everything(99)
    set_rng_state(loaded)
    assert draws() == expected


def test_a_view_into_a_larger_buffer_restores() -> None:
    """Loaded tensors can be views with a storage offset; set_rng_state must copy them."""
    state = rng_state()
    expected = float(torch.rand(1))
    big = torch.cat([torch.zeros(8, dtype=torch.uint8), state["torch_cpu"]])
    set_rng_state({**state, "torch_cpu": big[8:]})
    assert float(torch.rand(1)) == expected


def test_reseed_formula_is_pinned() -> None:
    derived = reseed_rng(1234, 50, 3)
    assert derived == (1234 * 1_000_003 + 50 * 9_176 + 3 * 7_919) % (2**31 - 1) == 1234486259
    got = draws()
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)
    assert draws() == got


def test_restore_without_a_group_uses_rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    with ddpkit.init(env={}) as dist:
        saved = ddpkit.capture_rng(dist)
        assert list(saved) == ["rank0"]
        expected = draws()
        how = ddpkit.restore_rng(saved, dist, seed=1, step=2)
        assert how.how == "restored" and draws() == expected
        assert how.describe(1) == "RNG states restored (same world size)"
        two = {"rank0": saved["rank0"], "rank1": saved["rank0"]}
        how = ddpkit.restore_rng(two, dist, seed=1, step=2)
        assert (how.how, how.saved_world_size, how.seed) == ("reseeded", 2, 1018355)
        assert "2 in the checkpoint, 1 now" in how.describe(1)
        assert ddpkit.restore_rng({}, dist, seed=1, step=2).how == "reseeded"


def test_cuda_state_is_captured_for_a_gpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[Any] = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda dev: torch.arange(4).byte())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda t, dev: got.append((t, dev)))
    state = rng_state(torch.device("cuda", 1))
    assert torch.equal(state["torch_cuda"], torch.arange(4).byte())
    set_rng_state(state, "cuda:1")
    assert torch.equal(got[0][0], torch.arange(4).byte()) and got[0][1] == torch.device("cuda", 1)
    set_rng_state(state, "cpu")  # a CPU run ignores the GPU part
    assert len(got) == 1


BLOCK_NUMPY = """
import sys
class NoNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoNumpy())
"""

WITHOUT_NUMPY = """
import json, random, warnings
warnings.simplefilter("always")
import ddpkit  # first, as `python -m ddpkit` does: torch comes in through it
import torch
assert ddpkit.seed_everything(5) == 5
state = ddpkit.rng_state()
a = (random.random(), float(torch.rand(1)))
ddpkit.set_rng_state({**state, "numpy_keys": torch.zeros(624, dtype=torch.int64),
                      "numpy_meta": torch.zeros(3, dtype=torch.float64)})
b = (random.random(), float(torch.rand(1)))
with ddpkit.init(env={}) as dist:
    saved = ddpkit.capture_rng(dist)
    gathered = dist.all_gather_object({"x": 1})
    how = ddpkit.restore_rng({}, dist, seed=5, step=1)
print(json.dumps({
    "keys": sorted(state), "same": a == b, "gathered": gathered, "how": how.how,
    "numpy_loaded": "numpy" in sys.modules, "saved": sorted(saved),
}))
"""


def test_numpy_is_optional_for_ddpkit() -> None:
    """Issue 17: this ran nowhere (skipped wherever numpy was installed). It blocks the import
    in a subprocess, so it runs in every session and fails if ddpkit starts needing numpy."""
    code = textwrap.dedent(BLOCK_NUMPY) + textwrap.dedent(WITHOUT_NUMPY)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {
        "keys": ["python_meta", "python_mt", "torch_cpu"],
        "same": True,
        "gathered": [{"x": 1}],
        "how": "reseeded",
        "numpy_loaded": False,
        "saved": ["rank0"],
    }
    assert "Failed to initialize NumPy" not in out.stderr, out.stderr  # issue 17's warning
