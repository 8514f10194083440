"""Every random generator of every rank, captured for a checkpoint and restored on resume.

A process's generators are python's ``random``, numpy's legacy global generator (when numpy is
installed: it is optional for ddpkit), torch's CPU generator and the current CUDA device's. Each
state is packed into plain int64/float64/uint8 tensors, so a checkpoint holding them loads with
``torch.load(weights_only=True)`` and through any tensor format (ckptstore's ``dcp`` included).

:func:`capture_rng` gathers every rank's state into one dict keyed ``rank0``, ``rank1``, ...
(the same on every rank, so a sharded format writes it once). :func:`restore_rng` gives each rank
its own state back when the world size is unchanged, and otherwise re-seeds every generator from
(seed, step, rank): a resume on another world size stays reproducible, just not equal to a run
that never stopped (its data order changes anyway).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

# Key names are the on-disk format of pyrecover-train checkpoints: do not rename.
_PY_MT, _PY_META = "python_mt", "python_meta"
_NP_KEYS, _NP_META = "numpy_keys", "numpy_meta"
_TORCH_CPU, _TORCH_CUDA = "torch_cpu", "torch_cuda"
_MODULUS = 2**31 - 1


class GatherLike(Protocol):
    """What :func:`capture_rng` / :func:`restore_rng` need from :class:`ddpkit.Dist`."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...


@dataclass(frozen=True, slots=True)
class RngRestored:
    """How :func:`restore_rng` set this rank's generators."""

    how: Literal["restored", "reseeded"]
    saved_world_size: int  # ranks found in the checkpoint (0: none)
    seed: int | None = None  # the derived seed when re-seeded

    def describe(self, world_size: int) -> str:
        if self.how == "restored":
            return "RNG states restored (same world size)"
        return (
            f"world size changed ({self.saved_world_size} in the checkpoint, {world_size} now): "
            f"RNGs re-seeded from (seed, step, rank) -> {self.seed}"
        )


def rank_key(rank: int) -> str:
    return f"rank{rank}"


def rng_state(device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """This process's generator states as tensors (CUDA: ``device``'s, when it is a GPU)."""
    version, mt, gauss = random.getstate()
    state = {
        _PY_MT: torch.tensor(mt, dtype=torch.int64),
        _PY_META: torch.tensor(
            [float(version), 0.0 if gauss is None else 1.0, gauss or 0.0], dtype=torch.float64
        ),
        _TORCH_CPU: torch.get_rng_state(),
    }
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        if name == "MT19937":
            state[_NP_KEYS] = torch.from_numpy(np.asarray(keys, dtype=np.int64).copy())
            state[_NP_META] = torch.tensor(
                [float(pos), float(has_gauss), float(cached)], dtype=torch.float64
            )
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        state[_TORCH_CUDA] = torch.cuda.get_rng_state(dev)
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device | str | None = None) -> None:
    """Set this process's generators from :func:`rng_state`'s output.

    numpy's part is skipped when numpy is not installed (nothing then draws from it); CUDA's when
    ``device`` is not a GPU or the state has none.
    """
    meta = state[_PY_META].tolist()
    gauss = meta[2] if meta[1] else None
    random.setstate((int(meta[0]), tuple(int(x) for x in state[_PY_MT].tolist()), gauss))
    np = _numpy()
    if np is not None and _NP_KEYS in state:
        pos, has_gauss, cached = state[_NP_META].tolist()
        keys = state[_NP_KEYS].cpu().numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, int(pos), int(has_gauss), float(cached)))
    # clone(): a loaded tensor may be a view into a larger buffer (storage offset != 0), and
    # set_rng_state reads the storage from its start.
    torch.set_rng_state(_bytes(state[_TORCH_CPU]))
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and _TORCH_CUDA in state:
        torch.cuda.set_rng_state(_bytes(state[_TORCH_CUDA]), dev)


def reseed_rng(seed: int, step: int, rank: int, device: torch.device | str | None = None) -> int:
    """Seed every generator from (seed, step, rank); return the derived seed.

    The formula is part of the checkpoint contract: a resume on another world size draws the
    same numbers whichever ddpkit version runs it.
    """
    derived = (seed * 1_000_003 + step * 9_176 + rank * 7_919) % _MODULUS
    random.seed(derived)
    np = _numpy()
    if np is not None:
        np.random.seed(derived)
    torch.manual_seed(derived)
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        torch.cuda.manual_seed(derived)
    return derived


def capture_rng(dist: GatherLike) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's generator states, ``{"rank0": {...}, "rank1": {...}, ...}``, on every rank.

    A collective (every rank must call it, e.g. when building the checkpoint state): put the
    result in the state you save. One rank without a process group gets ``{"rank0": ...}``.
    """
    states = dist.all_gather_object(rng_state(dist.device))
    return {rank_key(r): s for r, s in enumerate(states)}


def restore_rng(saved: Mapping[str, Any], dist: GatherLike, *, seed: int, step: int) -> RngRestored:
    """This rank's states from :func:`capture_rng`'s dict when the checkpoint was written by the
    same number of ranks; else every generator re-seeded from (``seed``, ``step``, rank)."""
    ranks = {k for k in saved if k.startswith("rank") and k[4:].isdigit()}
    same_world = ranks == {rank_key(r) for r in range(dist.world_size)}
    if same_world:
        set_rng_state(saved[rank_key(dist.rank)], dist.device)
        return RngRestored("restored", len(ranks))
    derived = reseed_rng(seed, step, dist.rank, dist.device)
    return RngRestored("reseeded", len(ranks), derived)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.uint8).cpu().clone()


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy
