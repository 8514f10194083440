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
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Pruning:
    """What retention did (or, in a dry run, would do): the steps deleted, and each step kept
    with why."""

    deleted: list[int] = field(default_factory=list)
    kept: dict[int, str] = field(default_factory=dict)


DEFAULT_BEST_METRIC = "val_loss"
"""The metadata key ``keep_best`` ranks by unless told: what a trainer usually validates."""


@dataclass(kw_only=True, slots=True)
class RetentionPolicy:
    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str = DEFAULT_BEST_METRIC
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
        kept = self.kept(steps, head=head, protected=dict.fromkeys(protected, "in use"))
        return [s for s in sorted(steps) if s not in kept]

    def kept(
        self,
        steps: Mapping[int, Mapping[str, Any]],
        *,
        head: int | None,
        protected: Mapping[int, str] | None = None,
    ) -> dict[int, str]:
        """Each step the policy keeps, with why (``protected``: steps kept for reasons of the
        caller's); every other step goes."""
        if not steps:
            return {}
        if not self.active:
            return dict.fromkeys(steps, "no retention policy")
        if head is None or head not in steps:
            head = max(steps)
        considered = sorted(s for s in steps if s <= head)
        why: dict[int, list[str]] = {head: ["latest"]}
        for s, reason in (protected or {}).items():
            why.setdefault(s, []).append(reason)
        newer = f"above the latest step {head} (a timeline given up, or a save in flight): kept"
        for s in steps:
            if s > head:
                why.setdefault(s, []).append(f"{newer} until training overwrites it")
        if self.keep_last is not None:
            for s in considered[-self.keep_last :]:
                why.setdefault(s, []).append(f"one of the last {self.keep_last}")
        if self.keep_every is not None:
            for s in considered:
                if s % self.keep_every == 0:
                    why.setdefault(s, []).append(f"a multiple of {self.keep_every}")
        if self.keep_best is not None:
            for s in self.best(steps, considered):
                why.setdefault(s, []).append(
                    f"one of the {self.keep_best} best by {self.best_metric}"
                )
        return {s: "; ".join(dict.fromkeys(r)) for s, r in sorted(why.items()) if s in steps}

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
