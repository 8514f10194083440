"""Page-aligned CPU buffers (for O_DIRECT), memoryviews of tensors, and reusable pools.

Memory touched for the first time costs far more than a copy into memory touched before, so the
store keeps its snapshot arena and staging buffers across saves instead of allocating each time.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ALIGN = 4096  # O_DIRECT wants file offsets, lengths and memory addresses on this boundary
TENSOR_ALIGN = 64  # tensors inside a payload start here, enough for any vectorized dtype view


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose data starts on a page boundary (plus a page of slack
    after it, so an O_DIRECT read rounded up to a page never runs off the allocation)."""
    raw = torch.empty(nbytes + 2 * ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


def memview(t: torch.Tensor) -> memoryview:
    """A writable byte memoryview of a contiguous CPU tensor's memory (no numpy needed).

    The view keeps ``t`` alive through the ctypes object it wraps.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("memview needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    arr = (ctypes.c_char * n).from_address(t.data_ptr())
    arr._keep = t  # type: ignore[attr-defined]
    return memoryview(arr).cast("B")


def copy_bytes(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for flat uint8 tensors of equal length.

    CPU to CPU goes through one plain ``memmove`` (GIL released) instead of ATen's OpenMP copy:
    on a node whose cores are busy (training, other jobs) a parallel copy waits for its slowest
    thread and crawls, while one memmove runs at memory speed.
    """
    n = src.numel()
    if n != dst.numel():
        raise ValueError(f"copy_bytes: {n} bytes into {dst.numel()}")
    if n == 0:
        return
    if (
        src.device.type == "cpu"
        and dst.device.type == "cpu"
        and src.is_contiguous()
        and (dst.is_contiguous())
    ):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    else:
        dst.copy_(src, non_blocking=non_blocking)


def zero_bytes(dst: torch.Tensor) -> None:
    if dst.numel() and dst.device.type == "cpu" and dst.is_contiguous():
        ctypes.memset(dst.data_ptr(), 0, dst.numel())
    elif dst.numel():
        dst.zero_()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's data (contiguous copy first if needed)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


class BufferPool:
    """A fixed set of page-aligned buffers handed out one per worker and reused forever."""

    def __init__(self, count: int, size: int, *, pin: bool = False) -> None:
        self.size = size
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._count, self._pin, self._made = count, pin, 0
        self._lock = threading.Lock()

    @contextmanager
    def get(self) -> Iterator[torch.Tensor]:
        buf = self.take()
        try:
            yield buf
        finally:
            self.give(buf)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from :meth:`take` (another thread may return it)."""
        self._free.put(buf)

    def take(self) -> torch.Tensor:
        """A free buffer (waits for one); hand it back with :meth:`give`."""
        with self._lock:
            if self._made < self._count:
                self._made += 1
                return aligned_empty(self.size, pin=self._pin)
        return self._free.get()


class Arena:
    """One growing page-aligned buffer for snapshots, reused by every async save."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._pinned = False
        self._warming: threading.Thread | None = None

    def take(self, nbytes: int, *, pin: bool = False) -> torch.Tensor:
        if self._warming is not None:
            self._warming.join()
            self._warming = None
        buf = self._buf
        if buf is None or buf.numel() < nbytes or (pin and not self._pinned):
            self._buf = None  # free the old one before touching a bigger one
            # 1/8 headroom: optimizer state appearing after step 1 should not force a regrow.
            buf = aligned_empty(align_up(nbytes + nbytes // 8), pin=pin)
            self._buf, self._pinned = buf, pin
        return buf[:nbytes]

    def reserve(self, nbytes: int, *, pin: bool = False, nice: int = 0) -> None:
        """Allocate and touch the buffer in a background thread: memory touched for the first
        time is slow (page faults), so the first async save should not be the one to do it."""
        if self._warming is not None or (
            self._buf is not None and self._buf.numel() >= nbytes and (self._pinned or not pin)
        ):
            return

        def warm() -> None:
            if nice and hasattr(os, "setpriority"):
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            buf = aligned_empty(align_up(nbytes + nbytes // 8), pin=pin)
            step = 64 << 20
            for off in range(0, buf.numel(), step):
                zero_bytes(buf[off : off + step])
            self._buf, self._pinned = buf, pin

        self._buf = None
        self._warming = threading.Thread(target=warm, name="ckptstore-reserve", daemon=True)
        self._warming.start()

    def release(self) -> None:
        if self._warming is not None:
            self._warming.join()
            self._warming = None
        self._buf = None
