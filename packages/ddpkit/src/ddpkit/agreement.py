""":meth:`Dist.agree`'s encoding: a few small ints agreed in one all-reduce of one 8-byte word.

gloo's all-reduce time grows with the element count at these sizes (2 ranks on CPU: 3 int64
elements take about 2-3x as long as one), so the values travel as one int64 word: value ``v`` of
field ``i`` sets bit ``i * width + v`` (one-hot), a bitwise-OR all-reduce unions every rank's
bits, and each field's highest set bit is the maximum, its lowest the minimum. NCCL has no
bitwise reduction (and no per-element cost at this size): there the values go as they are, in a
reused buffer, with MAX or MIN.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as tdist

WORD_BITS = 63  # the sign bit stays clear: the word reads back as a plain non-negative int
OPS = ("max", "min")


def field_width(n: int) -> int:
    """Bits per value when ``n`` values share one word; values must be below it."""
    return WORD_BITS // n


def check(values: Sequence[Any], op: str) -> int:
    """The field width for ``values``, or a one-line error naming the allowed range."""
    if op not in OPS:
        raise ValueError(f"op={op!r} is unknown; use 'max' or 'min' (sums: all_reduce)")
    n = len(values)
    if not 1 <= n <= WORD_BITS:
        raise ValueError(f"agree() takes 1 to {WORD_BITS} values, got {n}")
    width = field_width(n)
    for v in values:
        if not isinstance(v, int) or not 0 <= v < width:
            raise ValueError(
                f"agree() takes small ints: with {n} value(s) each must be in 0..{width - 1}, "
                f"got {v!r}; use all_reduce for other numbers"
            )
    return width


def pack(values: Sequence[int], width: int) -> int:
    word = 0
    for i, v in enumerate(values):
        word |= 1 << (i * width + int(v))
    return word


def unpack(word: int, n: int, width: int, op: str) -> tuple[int, ...]:
    mask = (1 << width) - 1
    fields = [(word >> (i * width)) & mask for i in range(n)]
    if op == "max":
        return tuple(f.bit_length() - 1 for f in fields)
    return tuple((f & -f).bit_length() - 1 for f in fields)


class IntSlot:
    """A reused int64 buffer, written and read through ctypes (no tensor made per call, no
    numpy). With NCCL a pinned host copy feeds the GPU buffer."""

    def __init__(self, n: int, comm_device: torch.device) -> None:
        cuda = comm_device.type == "cuda"
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=cuda)
        self.values = (ctypes.c_int64 * n).from_address(self.host.data_ptr())
        self.dev = torch.zeros(n, dtype=torch.int64, device=comm_device) if cuda else self.host

    def reduce(self, op: Any) -> None:
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)
        tdist.all_reduce(self.dev, op=op)
        if self.dev is not self.host:
            self.host.copy_(self.dev)  # blocking: the reduced values are on the host after this
