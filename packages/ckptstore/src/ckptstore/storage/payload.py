"""The bytes of one file: what a writer copies out (payloads) and where a reader copies in
(destinations), with the chunked CRC32 helpers both sides share."""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..buffers import align_up, copy_bytes, zero_bytes
from ..errors import CorruptCheckpointError
from ..manifest import CRC_CHUNK, FileEntry

MiB = 1 << 20


class Payload(Protocol):
    """The bytes of one file. ``fill`` copies ``[offset, offset+len(out))`` into ``out``;
    ``view`` returns those bytes without copying when they already sit in page-aligned memory."""

    size: int

    def fill(self, offset: int, out: torch.Tensor) -> None: ...

    def view(self, offset: int, length: int) -> torch.Tensor | None: ...


class SegmentPayload:
    """A file made of byte segments (header, tensors) at fixed offsets; gaps are zeros."""

    def __init__(self, size: int, segments: Sequence[tuple[int, torch.Tensor]]) -> None:
        self.size = size
        self._segs = sorted(segments, key=lambda s: s[0])
        self._starts = [s[0] for s in self._segs]

    def fill(self, offset: int, out: torch.Tensor) -> None:
        end = offset + out.numel()
        pos = offset
        i = max(bisect.bisect_right(self._starts, offset) - 1, 0)
        while i < len(self._segs) and pos < end:
            start, data = self._segs[i]
            i += 1
            if start + data.numel() <= pos:
                continue
            if start >= end:
                break
            pos = self._copy_segment(out, offset, pos, end, start, data)
        if pos < end:
            zero_bytes(out[pos - offset :])

    @staticmethod
    def _copy_segment(
        out: torch.Tensor, offset: int, pos: int, end: int, start: int, data: torch.Tensor
    ) -> int:
        """Zero the gap before ``start``, copy the overlap; return the new position."""
        if start > pos:
            zero_bytes(out[pos - offset : start - offset])
            pos = start
        take = min(start + data.numel(), end)
        copy_bytes(out[pos - offset : take - offset], data[pos - start : take - start])
        return take

    def view(self, offset: int, length: int) -> torch.Tensor | None:
        return None


class BufferPayload:
    """A file whose whole image already sits in one page-aligned CPU buffer (a snapshot)."""

    def __init__(self, buf: torch.Tensor, size: int) -> None:
        if buf.numel() < align_up(size):
            raise ValueError("buffer must cover the file size rounded up to a page")
        self.buf, self.size = buf, size

    def fill(self, offset: int, out: torch.Tensor) -> None:
        copy_bytes(out, self.buf[offset : offset + out.numel()])

    def view(self, offset: int, length: int) -> torch.Tensor | None:
        return self.buf[offset : offset + length]


@dataclass(slots=True)
class Dest:
    """Read file bytes ``[offset, offset + buf.numel())`` into ``buf`` (a CPU uint8 tensor)."""

    offset: int
    buf: torch.Tensor

    @property
    def end(self) -> int:
        return self.offset + self.buf.numel()


def crc_chunks(mv: memoryview, offset: int) -> list[tuple[int, int]]:
    """(chunk index, crc32) of each CRC_CHUNK piece of ``mv``, which starts at file ``offset``."""
    assert offset % CRC_CHUNK == 0
    return [
        ((offset + a) // CRC_CHUNK, zlib.crc32(mv[a : a + CRC_CHUNK]))
        for a in range(0, len(mv), CRC_CHUNK)
    ]


def pieces(size: int, piece: int) -> list[tuple[int, int]]:
    """(offset, length) of consecutive pieces covering ``size`` bytes."""
    return [(off, min(piece, size - off)) for off in range(0, size, piece)]


def n_chunks(size: int) -> int:
    return -(-size // CRC_CHUNK)


def needed_chunks(dests: Sequence[Dest], size: int) -> list[tuple[int, int]]:
    """Merged runs [first, last+1) of checksum chunks that cover every destination."""
    idx = sorted(
        {
            c
            for d in dests
            if d.buf.numel()
            for c in range(d.offset // CRC_CHUNK, n_chunks(min(d.end, size)))
        }
    )
    runs: list[tuple[int, int]] = []
    for c in idx:
        if runs and runs[-1][1] == c:
            runs[-1] = (runs[-1][0], c + 1)
        else:
            runs.append((c, c + 1))
    return runs


def scatter(data: memoryview, offset: int, dests: Sequence[Dest]) -> None:
    """Copy ``data`` (file bytes from ``offset``) into every destination it overlaps."""
    end = offset + len(data)
    src: torch.Tensor | None = None
    for d in dests:
        a, b = max(offset, d.offset), min(end, d.end)
        if a < b:
            if src is None:
                src = torch.frombuffer(data, dtype=torch.uint8) if len(data) else None
            if src is not None:
                copy_bytes(d.buf[a - d.offset : b - d.offset], src[a - offset : b - offset])


def check_chunks(got: Iterable[tuple[int, int]], entry: FileEntry, url: str) -> None:
    for i, crc in got:
        if entry.checksum.values[i] != crc:
            a = i * entry.checksum.chunk
            b = min(a + entry.checksum.chunk, entry.size)
            raise CorruptCheckpointError(
                f"{url}: checksum mismatch in bytes {a}-{b} (chunk {i}); the file is corrupt"
            )
