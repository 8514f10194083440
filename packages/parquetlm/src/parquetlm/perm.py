"""A keyed pseudo-random permutation of [0, n) with O(1) access to any element.

A balanced Feistel network over the smallest even number of bits that covers n is a bijection of
[0, 2**bits); "cycle walking" (apply it again while the result is >= n) restricts it to a
bijection of [0, n). Since 2**bits < 4n, a walk takes under 4 steps on average. So the k-th
element of an epoch's shuffle costs a few integer operations, however large the epoch, and
nothing of size n is ever stored.
"""

from __future__ import annotations

import hashlib

import numpy as np

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
ROUNDS = 6


def derive_key(*parts: object) -> int:
    """A 64-bit key from any printable parts (seed, epoch, purpose...), stable across runs."""
    digest = hashlib.blake2b("\0".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class FeistelPermutation:
    """``perm(indices)`` maps an array of indices in [0, n) to their images, bijectively."""

    __slots__ = ("_half", "_keys", "_mask", "n")

    def __init__(self, n: int, key: int, rounds: int = ROUNDS) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = [np.uint64(derive_key(key, r)) for r in range(rounds)]

    def _network(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for k in self._keys:
            z = right ^ k
            z = (z ^ (z >> np.uint64(30))) * _M1  # splitmix64's finalizer as the round function
            z = (z ^ (z >> np.uint64(27))) * _M2
            z ^= z >> np.uint64(31)
            left, right = right, left ^ (z & self._mask)
        return (left << self._half) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        x = np.asarray(indices, dtype=np.uint64)
        if x.ndim == 0:
            x = x.reshape(1)
        out = self._network(x)
        n = np.uint64(self.n)
        outside = out >= n
        while outside.any():
            out[outside] = self._network(out[outside])
            outside = out >= n
        return out.astype(np.int64)
