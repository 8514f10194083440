"""Every RNG state of a process (python, numpy, torch CPU, torch CUDA) as plain tensors.

Checkpoints are loaded with ``weights_only=True``, which refuses numpy arrays and arbitrary
tuples, so each state is packed into int64/float64/uint8 tensors and unpacked on restore.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture(device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """This process's RNG states (CUDA: the state of ``device`` when it is a GPU)."""
    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    assert np_name == "MT19937"
    state = {
        "python_mt": torch.tensor(mt, dtype=torch.int64),
        "python_meta": torch.tensor(
            [float(version), 0.0 if gauss is None else 1.0, gauss or 0.0], dtype=torch.float64
        ),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64).copy()),
        "numpy_meta": torch.tensor(
            [float(np_pos), float(np_has_gauss), np_gauss], dtype=torch.float64
        ),
        "torch_cpu": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Set this process's RNGs from :func:`capture`'s output."""
    meta = state["python_meta"].tolist()
    gauss = meta[2] if meta[1] else None
    random.setstate((int(meta[0]), tuple(int(x) for x in state["python_mt"].tolist()), gauss))
    pos, has_gauss, cached = state["numpy_meta"].tolist()
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, int(pos), int(has_gauss), float(cached)))
    # clone(): a loaded tensor may be a view into a larger buffer (storage offset != 0), and
    # set_rng_state reads the storage from its start (it segfaulted on such a view).
    torch.set_rng_state(state["torch_cpu"].to(torch.uint8).cpu().clone())
    if device is not None and device.type == "cuda" and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"].to(torch.uint8).cpu().clone(), device)


def reseed(seed: int, step: int, rank: int, device: torch.device | None = None) -> int:
    """Deterministic fresh states from (seed, step, rank): used when the world size changed and a
    rank has no saved state of its own."""
    derived = (seed * 1_000_003 + step * 9_176 + rank * 7_919) % (2**31 - 1)
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)
    if device is not None and device.type == "cuda":
        torch.cuda.manual_seed(derived)
    return derived


def rank_key(rank: int) -> str:
    return f"rank{rank}"
