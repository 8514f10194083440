"""Per-rank seeding of every generator a training script touches."""

from __future__ import annotations

import random

import torch

MAX_SEED = 2**32 - 1  # numpy's legacy generator takes 32-bit seeds


def seed_everything(seed: int, rank: int = 0) -> int:
    """Seed ``random``, numpy (if importable) and torch (CPU and every CUDA device) with
    ``seed + rank``, and return that effective seed.

    The per-rank offset gives ranks different streams (dropout masks, augmentation) while the run
    stays reproducible: rank r of any run with the same ``seed`` gets the same stream. Pass
    ``rank=0`` on every rank instead for identical streams (e.g. to initialise weights the same
    way everywhere -- though DDP broadcasts rank 0's weights at wrap time anyway). DataLoader
    workers are reseeded by torch from this state, so they need nothing more.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")
    effective = seed + rank
    if not 0 <= effective <= MAX_SEED:
        raise ValueError(
            f"seed + rank = {effective} is outside 0..{MAX_SEED} (numpy's limit); "
            "use a smaller seed"
        )
    random.seed(effective)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(effective)
    # manual_seed covers the CPU generator and every CUDA device (also one initialised later).
    torch.manual_seed(effective)
    return effective
