"""Checksums of a token cache, so damage on disk is found before it is trained on.

At build time tokens.bin is cut into pieces of ``CHUNK_BYTES`` and the crc32 of each piece is
written to ``tokens.crc32`` (little-endian uint32, one per piece); docs.bin gets one crc32 in
meta.json. On read, a piece is checked the first time anything in it is used (by this process):
the cost is bounded by one crc32 pass over what is read (zlib's crc32 runs at several GB/s,
several times the loader's own speed), paid once, and nothing is read that is not used.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from .errors import CacheError

CHUNK_BYTES = 1 << 20
SUMS_FILE = "tokens.crc32"


class ChunkCrc:
    """crc32 of each ``chunk``-byte piece of a stream fed in blocks of any size."""

    def __init__(self, chunk: int = CHUNK_BYTES) -> None:
        self.chunk = chunk
        self._sums: list[int] = []
        self._crc = self._fill = 0

    def update(self, block: bytes | memoryview) -> None:
        view = memoryview(block).cast("B")
        while len(view):
            take = min(self.chunk - self._fill, len(view))
            self._crc = zlib.crc32(view[:take], self._crc)
            self._fill += take
            view = view[take:]
            if self._fill == self.chunk:
                self._sums.append(self._crc)
                self._crc = self._fill = 0

    def sums(self) -> np.ndarray:
        """The checksums so far, the last (partial) piece included."""
        tail = [self._crc] if self._fill else []
        return np.array(self._sums + tail, dtype="<u4")


def pieces(nbytes: int, chunk: int) -> int:
    return -(-nbytes // chunk)


def read_sums(path: Path, *, count: int, crc: int, fix: str) -> np.ndarray:
    """The piece checksums in ``path``, checked against their count and their own crc32."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CacheError(f"{path} is missing: the cache is damaged; {fix}") from None
    if len(raw) != 4 * count or zlib.crc32(raw) != crc:
        raise CacheError(f"{path} does not match meta.json: the cache is damaged; {fix}")
    return np.frombuffer(raw, dtype="<u4")


class LazyCheck:
    """Checks pieces of an array's bytes against their crc32 the first time they are used."""

    def __init__(self, data: np.ndarray, sums: np.ndarray, chunk: int, path: Path, fix: str):
        if chunk <= 0 or chunk % data.itemsize:
            raise CacheError(f"{path}: checksum piece size {chunk} is impossible; {fix}")
        self._bytes = data.reshape(-1).view(np.uint8)
        self._sums, self._chunk, self._per_piece = sums, chunk, chunk // data.itemsize
        self._path, self._fix = path, fix
        self._flags = bytearray(len(sums))  # 1 = checked; Python indexing is fastest here
        self._left = len(sums)

    @property
    def complete(self) -> bool:
        """Every piece has been checked (then checks cost nothing)."""
        return self._left == 0

    def items(self, starts: np.ndarray, width: int) -> None:
        """Check the pieces that the element ranges ``[s, s + width)`` for each ``s`` touch."""
        if self._left == 0 or width <= 0 or len(starts) == 0:
            return
        per, flags = self._per_piece, self._flags
        if len(starts) > 64:  # a big batch: find the unchecked pieces in one vectorized go
            first, last = starts // per, (starts + width - 1) // per
            done = np.frombuffer(flags, dtype=bool)
            if done[first].all() and done[last].all() and int((last - first).max()) <= 1:
                return
        for s in np.asarray(starts).tolist():
            for piece in range(s // per, (s + width - 1) // per + 1):
                if not flags[piece]:
                    self._check(piece)

    def all(self) -> None:
        for piece in range(len(self._flags)):
            if not self._flags[piece]:
                self._check(piece)

    def _check(self, piece: int) -> None:
        lo = piece * self._chunk
        hi = min(lo + self._chunk, len(self._bytes))
        if zlib.crc32(self._bytes[lo:hi].data) != int(self._sums[piece]):
            raise CacheError(
                f"{self._path} is damaged: bytes {lo:,}..{hi:,} do not match the checksum "
                f"written when the cache was built; {self._fix}"
            )
        self._flags[piece] = 1
        self._left -= 1
