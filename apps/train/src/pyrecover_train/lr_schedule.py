"""The learning-rate schedule: linear warm-up, then cosine decay (``--warmup-steps``,
``--learning-rate``, ``--min-lr``, ``--training-steps``)."""

from __future__ import annotations

import math
from collections.abc import Callable


def warmup_cosine(*, warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier for LambdaLR: linear warmup to 1, cosine decay to ``min_ratio`` at ``total``.

    A plain function (not an object) on purpose: LambdaLR then stores nothing of it in its
    state dict, so a resumed run follows the schedule of its own flags.
    """

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
