"""Which checkpoints to keep: pure logic over (step, metadata), so it is tested without I/O.

Steps compare as integers (step 10000 is newer than step 9000, whatever the names sort like).
The "head" is the newest commit (what ``load("latest")`` takes). Steps above the head belong to
an abandoned timeline (training resumed from an older checkpoint) or to a save in flight: they
are never deleted here; training overwrites them when it gets there.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True, slots=True)
class RetentionPolicy:
    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str = "val_loss"
    best_mode: str = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(
                    f"{name} must be a positive integer or None (keep everything), got {v!r}"
                )
        if self.best_mode not in ("min", "max"):
            raise ValueError(
                f"best_mode must be 'min' (e.g. a loss) or 'max' (e.g. an accuracy), "
                f"got {self.best_mode!r}"
            )
        if not self.best_metric:
            raise ValueError("best_metric must name a key of the save() metadata, e.g. 'val_loss'")

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best))

    def select(
        self,
        steps: Mapping[int, Mapping[str, Any]],
        *,
        head: int | None,
        protected: Iterable[int] = (),
    ) -> list[int]:
        """Steps to delete, oldest first. ``steps`` maps step -> its save() metadata."""
        if not self.active or not steps:
            return []
        if head is None or head not in steps:
            head = max(steps)
        considered = sorted(s for s in steps if s <= head)
        keep = set(protected) | {head}
        if self.keep_last is not None:
            keep.update(considered[-self.keep_last :])
        if self.keep_every is not None:
            keep.update(s for s in considered if s % self.keep_every == 0)
        if self.keep_best is not None:
            keep.update(self.best(steps, considered))
        return [s for s in considered if s not in keep]

    def best(self, steps: Mapping[int, Mapping[str, Any]], candidates: Iterable[int]) -> list[int]:
        """The ``keep_best`` steps by ``best_metric``; steps without a finite number are ignored."""
        scored = []
        for s in candidates:
            v = steps[s].get(self.best_metric)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                scored.append((v if self.best_mode == "min" else -v, -s, s))
        scored.sort()
        return [s for *_, s in scored[: self.keep_best or 0]]


class InUse:
    """Steps being written, read or mirrored right now (thread-safe, counted: a load and a save
    of the same step overlap fine): retention never deletes them."""

    def __init__(self) -> None:
        self._steps: Counter[int] = Counter()
        self._mutex = threading.Lock()

    def add(self, step: int) -> None:
        with self._mutex:
            self._steps[step] += 1

    def discard(self, step: int) -> None:
        with self._mutex:
            self._steps[step] -= 1
            if self._steps[step] <= 0:
                del self._steps[step]

    def snapshot(self) -> set[int]:
        with self._mutex:
            return set(self._steps)

    @contextlib.contextmanager
    def holding(self, step: int) -> Iterator[None]:
        self.add(step)
        try:
            yield
        finally:
            self.discard(step)
