"""PackedLoader: fixed-length, shuffled, sharded, exactly resumable windows over a token stream.

Windows. The cache is one token stream: every document followed by EOT. Window ``w`` is
``tokens[w*seq_len : w*seq_len + seq_len + 1]``: consecutive windows overlap by one token, so
every token after the first is a prediction target exactly once (``x = batch[:, :-1]``,
``y = batch[:, 1:]``). No padding; documents run across window edges. ``(num_tokens - 1) //
seq_len`` windows; the last ``< seq_len`` tokens of the corpus are never used.

Split. With ``val_fraction > 0`` a fixed permutation of all windows (keyed by ``split_seed``, not
by ``seed``) puts its first ``ceil(val_fraction * windows)`` windows in "val" and the rest in
"train": disjoint, spread over the whole corpus, the same whatever the training seed.

Order. The stream of a split is epoch 0's windows, then epoch 1's, ... forever; each epoch is a
permutation of the split keyed by ``(seed, epoch)`` (a Feistel network: the k-th window of any
epoch is computed in O(1), nothing of the epoch's size is stored). ``position`` counts the
windows consumed by all ranks together (global): a batch starting at ``position`` uses windows
``[position, position + world_size * batch_size)`` of the stream, and rank ``r`` takes the
contiguous slice ``[position + r*batch_size, position + (r+1)*batch_size)``. So the ranks' shards
are disjoint, their union is the whole epoch, and a batch may hold the end of one epoch and the
start of the next (no window is dropped or repeated).

State. ``state_dict()`` is a few ints and strings; ``load_state_dict()`` sets ``position`` (O(1))
and the next batches are exactly those the uninterrupted run would have made. Because the
position is global, a resume with another ``world_size`` or ``batch_size`` continues the same
global order: no window repeated or skipped.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .errors import LoaderError
from .perm import FeistelPermutation, derive_key

STATE_FORMAT = "parquetlm.PackedLoader/1"
SPLITS = ("train", "val")
_AHEAD_BATCHES = 64  # window indices computed in one vectorized go


class TokenSource(Protocol):
    """What the loader reads: a 1-D token array and a key naming its content (a TokenCache).

    A source with a ``check_windows(starts, width) -> bool`` method (a TokenCache: checksums) is
    asked to check each batch's tokens before they are handed out, until it returns True."""

    @property
    def tokens(self) -> np.ndarray: ...

    @property
    def key(self) -> str: ...


@dataclass(kw_only=True, slots=True)
class LoaderConfig:
    """Settings of a :class:`PackedLoader`, validated on creation."""

    seq_len: int
    batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    split: str = "train"
    val_fraction: float = 0.0
    split_seed: int = 0
    shuffle: bool = True
    drop_last: bool = True
    dtype: str | None = "int64"

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LoaderError(f"{name}={value!r} must be an int >= 1")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise LoaderError(
                f"rank={self.rank!r} must be in 0..world_size-1 (world_size={self.world_size})"
            )
        for name in ("seed", "split_seed"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise LoaderError(f"{name}={getattr(self, name)!r} must be an int")
        if self.split not in SPLITS:
            raise LoaderError(f"split={self.split!r} must be 'train' or 'val'")
        if not 0.0 <= float(self.val_fraction) < 1.0:
            raise LoaderError(f"val_fraction={self.val_fraction!r} must be in [0, 1), e.g. 0.01")
        if self.split == "val" and self.val_fraction == 0:
            raise LoaderError("split='val' needs a held-out share: pass val_fraction>0, e.g. 0.01")
        if self.dtype is not None:
            try:
                kind = np.dtype(self.dtype)
            except TypeError as e:
                raise LoaderError(f"dtype={self.dtype!r} is not a numpy dtype: use 'int64'") from e
            if kind.kind not in "iu":
                raise LoaderError(f"dtype={self.dtype!r} must be an integer dtype, e.g. 'int64'")


def _tokens_and_key(cache: TokenSource | np.ndarray, key: str | None) -> tuple[np.ndarray, str]:
    """The token array (a plain view: slicing a np.memmap is slower) and the data's key."""
    if isinstance(cache, np.ndarray):
        tokens, found = cache, key or _array_key(cache)
    else:
        tokens, found = cache.tokens, key or cache.key
    if tokens.ndim != 1:
        raise LoaderError(f"tokens must be a 1-D array, got shape {tokens.shape}")
    return np.asarray(tokens), found


class PackedLoader:
    """Batches of shape ``(batch_size, seq_len + 1)`` for this rank (see the module docstring).

    ``dtype``: of the batches, int64 by default (what ``torch.nn.Embedding`` takes); None keeps
    the cache's uint16/uint32. Iterating yields forever (epochs roll over); :meth:`take` yields a
    given number of steps; :meth:`eval_batches` walks the split once without touching the state.

    Args:
        cache: The tokens: a :class:`TokenSource` (a token cache) or a 1-D numpy array.
        seq_len: Tokens per window (a batch row holds ``seq_len + 1``: inputs and targets).
        batch_size: Rows per batch on this rank.
        seed: Seeds the order of the windows in each epoch.
        rank: This rank; it takes slice ``rank`` of each global batch of ``world_size *
            batch_size`` windows.
        world_size: How many ranks share the data.
        split: ``"train"`` or ``"val"``.
        val_fraction: The share of windows held out as ``"val"``.
        split_seed: Seeds which windows are held out (the same on every rank and run).
        shuffle: Permute the windows each epoch (False: in order).
        drop_last: :meth:`eval_batches` skips the split's last incomplete global batch.
        dtype: Of the batches (default int64); None keeps the cache's uint16/uint32.
        key: Identifies the token source in the loader's state (default: from the cache).
    """

    def __init__(
        self,
        cache: TokenSource | np.ndarray,
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        split: str = "train",
        val_fraction: float = 0.0,
        split_seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        dtype: str | None = "int64",
        key: str | None = None,
    ) -> None:
        self.config = LoaderConfig(
            seq_len=seq_len,
            batch_size=batch_size,
            seed=seed,
            rank=rank,
            world_size=world_size,
            split=split,
            val_fraction=val_fraction,
            split_seed=split_seed,
            shuffle=shuffle,
            drop_last=drop_last,
            dtype=dtype,
        )
        self._cache = cache
        self._tokens, self.key = _tokens_and_key(cache, key)
        self._check_windows = getattr(cache, "check_windows", None)
        self._out_dtype = np.dtype(dtype) if dtype is not None else self._tokens.dtype
        self.num_windows = self._count_windows()
        self.val_windows, self.windows_per_epoch = self._split_sizes()
        self._split_perm = (
            FeistelPermutation(self.num_windows, derive_key("split", split_seed))
            if self.val_windows
            else None
        )
        self._split_offset = 0 if split == "val" else self.val_windows
        self._epoch_perms: dict[int, FeistelPermutation] = {}
        self.position = 0
        self.step = 0
        self._ahead: tuple[int, np.ndarray] | None = None

    # -- geometry ------------------------------------------------------------------------------

    def _count_windows(self) -> int:
        n, seq_len = len(self._tokens), self.config.seq_len
        windows = (n - 1) // seq_len if n else 0
        if windows < 1:
            raise LoaderError(
                f"seq_len={seq_len} needs at least {seq_len + 1} tokens but the corpus has {n}: "
                "lower seq_len or add data"
            )
        return windows

    def _split_sizes(self) -> tuple[int, int]:
        c = self.config
        if c.val_fraction == 0:
            return 0, self.num_windows
        val = math.ceil(c.val_fraction * self.num_windows)
        train = self.num_windows - val
        if train < 1:
            raise LoaderError(
                f"val_fraction={c.val_fraction} leaves no training window out of "
                f"{self.num_windows} (seq_len={c.seq_len}): lower val_fraction or seq_len"
            )
        return val, (val if c.split == "val" else train)

    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    @property
    def global_batch(self) -> int:
        """Windows consumed per step by all ranks together."""
        return self.config.batch_size * self.config.world_size

    @property
    def epoch(self) -> int:
        """The epoch of the next window to be read."""
        return self.position // self.windows_per_epoch

    @property
    def tokens_per_epoch(self) -> int:
        return self.windows_per_epoch * self.config.seq_len

    # -- order ---------------------------------------------------------------------------------

    def _epoch_perm(self, epoch: int) -> FeistelPermutation:
        perm = self._epoch_perms.get(epoch)
        if perm is None:
            if len(self._epoch_perms) > 4:
                self._epoch_perms.clear()
            key = derive_key("epoch", self.config.seed, epoch, self.config.split)
            perm = self._epoch_perms[epoch] = FeistelPermutation(self.windows_per_epoch, key)
        return perm

    def windows_at(self, positions: np.ndarray) -> np.ndarray:
        """Window ids (into the whole token stream) at global stream positions (any shape)."""
        g = np.asarray(positions, dtype=np.int64)
        flat = g.reshape(-1)
        if flat.size and int(flat.min()) < 0:
            raise LoaderError("stream positions must be >= 0")
        epochs, k = np.divmod(flat, self.windows_per_epoch)
        out = np.empty_like(flat)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._epoch_perm(int(e))(k[sel]) if self.config.shuffle else k[sel]
        if self._split_perm is not None:
            out = self._split_perm(out + self._split_offset)
        return out.reshape(g.shape)

    def _rank_windows(self, position: int) -> np.ndarray:
        """This rank's window ids of the batch that starts at global ``position``."""
        stride = self.global_batch
        if self._ahead is not None:
            start, block = self._ahead
            s, rem = divmod(position - start, stride)
            if rem == 0 and 0 <= s < len(block):
                return block[s]
        offsets = np.arange(_AHEAD_BATCHES, dtype=np.int64)[:, None] * stride
        rows = position + self.config.rank * self.config.batch_size
        positions = offsets + rows + np.arange(self.config.batch_size, dtype=np.int64)[None, :]
        block = self.windows_at(positions)
        self._ahead = (position, block)
        return block[0]

    def _gather(self, windows: np.ndarray) -> np.ndarray:
        width, seq_len = self.config.seq_len + 1, self.config.seq_len
        out = np.empty((len(windows), width), dtype=self._out_dtype)
        if self._check_windows is not None and self._check_windows(windows * seq_len, width):
            self._check_windows = None  # all checked: nothing more to ask in this process
        tokens = self._tokens
        for i, w in enumerate(windows.tolist()):
            start = w * seq_len
            out[i] = tokens[start : start + width]
        return out

    def batch_at(self, position: int) -> np.ndarray:
        """This rank's rows of the global batch at stream ``position`` (the state is unchanged)."""
        return self._gather(self._rank_windows(int(position)))

    # -- iteration -----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            yield self.next_batch()

    def next_batch(self) -> np.ndarray:
        """The next batch; the state counts it as consumed."""
        batch = self.batch_at(self.position)
        self.position += self.global_batch
        self.step += 1
        return batch

    def take(self, steps: int) -> Iterator[np.ndarray]:
        """Exactly ``steps`` batches (advancing the state)."""
        for _ in range(steps):
            yield self.next_batch()

    def eval_batches(self, max_batches: int | None = None) -> Iterator[np.ndarray]:
        """One pass over this split in epoch 0's order, from the start, leaving the state alone.

        Every rank yields the same number of batches. ``drop_last=True`` (default) skips the
        final incomplete global batch; with ``drop_last=False`` it is yielded, each rank getting
        its rows of it (possibly 0 rows, shape ``(0, seq_len + 1)``).
        """
        c = self.config
        n, stride = self.windows_per_epoch, self.global_batch
        count = n // stride if c.drop_last else -(-n // stride)
        if max_batches is not None:
            count = min(count, max_batches)
        for s in range(count):
            first = s * stride + c.rank * c.batch_size
            rows = np.arange(first, min(first + c.batch_size, n), dtype=np.int64)
            yield self._gather(self.windows_at(rows))

    def iter_once(self) -> Iterator[np.ndarray]:
        """Alias of ``eval_batches()``: the split once, e.g. for an evaluation loss."""
        return self.eval_batches()

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Tiny, JSON-able; the same on every rank (rank 0 can save it for all)."""
        c = self.config
        return {
            "format": STATE_FORMAT,
            "position": self.position,
            "step": self.step,
            "epoch": self.epoch,
            "key": self.key,
            "seq_len": c.seq_len,
            "seed": c.seed,
            "shuffle": int(c.shuffle),
            "split": c.split,
            "split_seed": c.split_seed,
            "val_windows": self.val_windows,
            "windows_per_epoch": self.windows_per_epoch,
            "world_size": c.world_size,
            "batch_size": c.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off: O(1), exact; world_size/batch_size may differ."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise LoaderError(
                f"not a PackedLoader state (format {got!r}, expected {STATE_FORMAT!r})"
            )
        c = self.config
        mine = {
            "key": (self.key, "the state is for another dataset or tokenizer"),
            "seq_len": (c.seq_len, "pass the same seq_len"),
            "seed": (c.seed, "pass the same seed"),
            "shuffle": (int(c.shuffle), "pass the same shuffle"),
            "split": (c.split, "pass the same split"),
            "split_seed": (c.split_seed, "pass the same split_seed"),
            "val_windows": (self.val_windows, "pass the same val_fraction"),
        }
        for name, (value, fix) in mine.items():
            if state.get(name) != value:
                raise LoaderError(
                    f"cannot resume: state has {name}={state.get(name)!r}, this loader has "
                    f"{value!r}: {fix}"
                )
        position, step = state.get("position"), state.get("step")
        if not isinstance(position, int) or position < 0 or not isinstance(step, int):
            raise LoaderError(f"corrupt loader state: position={position!r} step={step!r}")
        self.position, self.step = position, step
        self._ahead = None

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for DataLoader workers: the cache reopens its memory map by path; derived
        # tables are rebuilt lazily.
        skip = ("_tokens", "_ahead", "_check_windows")
        state = {k: v for k, v in self.__dict__.items() if k not in skip}
        state["_epoch_perms"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        cache = self._cache
        self._tokens = np.asarray(cache if isinstance(cache, np.ndarray) else cache.tokens)
        self._check_windows = getattr(cache, "check_windows", None)
        self._ahead = None

    def __repr__(self) -> str:
        c = self.config
        return (
            f"PackedLoader(seq_len={c.seq_len}, batch_size={c.batch_size}, rank={c.rank}/"
            f"{c.world_size}, split={c.split!r}, windows_per_epoch={self.windows_per_epoch}, "
            f"position={self.position})"
        )


def _array_key(tokens: np.ndarray) -> str:
    """A content key for a bare array: its length, dtype and first and last million tokens."""
    h = hashlib.sha256(f"array\0{len(tokens)}\0{tokens.dtype.str}\0".encode())
    h.update(np.ascontiguousarray(tokens[: 1 << 20]).tobytes())
    h.update(np.ascontiguousarray(tokens[-(1 << 20) :]).tobytes())
    return "array-" + h.hexdigest()[:24]
