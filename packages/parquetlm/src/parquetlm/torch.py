"""PyTorch adapter (extra ``[torch]``): DataLoader workers and pinned memory, exact state kept.

``TorchLoader(loader, num_workers=2, pin_memory=True)`` yields ``torch.Tensor`` batches, the very
same as ``loader`` would, and its ``state_dict()`` counts only the batches handed to you (not the
ones workers prefetched), so a resume is exact whatever ``num_workers`` was.

How: worker ``i`` of ``K`` computes the batches at stream positions ``start + (i + jK) * G``
(``G`` = global batch); the DataLoader returns workers' outputs round-robin, i.e. in stream
order, and each batch comes with its position, which the adapter checks and records.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .loader import PackedLoader

__all__ = ["PackedDataset", "SizedLoader", "TorchLoader"]


class PackedDataset(IterableDataset[tuple[int, torch.Tensor]]):
    """``(position, batch)`` pairs from ``loader``'s stream, starting at ``start`` (default: the
    loader's position), split across DataLoader workers. Use it with ``batch_size=None``."""

    def __init__(self, loader: PackedLoader, start: int | None = None) -> None:
        self.loader = loader
        self.start = loader.position if start is None else int(start)

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        stride = self.loader.global_batch
        position = self.start + worker * stride
        while True:
            yield position, torch.from_numpy(self.loader.batch_at(position))
            position += workers * stride


class TorchLoader:
    """An exactly resumable DataLoader over a :class:`PackedLoader` (infinite, like it)."""

    def __init__(
        self,
        loader: PackedLoader,
        *,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        multiprocessing_context: Any = None,
        timeout: float = 0,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        self.loader = loader
        self._kwargs: dict[str, Any] = {
            "batch_size": None,
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "timeout": timeout,
        }
        if num_workers > 0:
            self._kwargs["prefetch_factor"] = prefetch_factor or 2
            self._kwargs["multiprocessing_context"] = multiprocessing_context

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            start = self.loader.position
            batches = DataLoader(PackedDataset(self.loader, start), **self._kwargs)
            expected = start
            for position, batch in batches:
                if self.loader.position != expected:
                    break  # load_state_dict() was called: restart the workers from there
                if position != expected:
                    raise RuntimeError(f"batch for position {position} arrived, {expected} due")
                self.loader.position = expected = position + self.loader.global_batch
                self.loader.step += 1
                yield batch

    def take(self, steps: int) -> Iterator[torch.Tensor]:
        """Exactly ``steps`` batches; the workers stop afterwards."""
        it = iter(self)
        try:
            for _ in range(steps):
                yield next(it)
        finally:
            it.close()  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    @property
    def position(self) -> int:
        return self.loader.position

    @property
    def step(self) -> int:
        return self.loader.step

    @property
    def epoch(self) -> int:
        return self.loader.epoch


class SizedLoader:
    """A :class:`TorchLoader` that says how many batches an epoch of the caller has.

    Trainers such as Lightning prefetch one batch from a loader without ``__len__`` to find the
    end of an epoch, and then save the loader's state one batch ahead: a resume would skip that
    batch. With a length they do not look ahead, so the saved position is exact. Iteration still
    continues the one endless stream; ``length`` only tells the trainer where its epoch ends.
    """

    def __init__(self, loader: TorchLoader, length: int) -> None:
        if length < 1:
            raise ValueError(f"length={length} must be >= 1 (batches per epoch of the trainer)")
        self.loader, self.length = loader, int(length)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
