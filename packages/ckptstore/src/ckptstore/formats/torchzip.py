"""``torch.save`` files of one tensor, built around bytes that are written elsewhere.

A DCP checkpoint stores every tensor chunk as a ``torch.save`` archive (what DCP's
``FileSystemReader`` hands to ``torch.load(weights_only=True)``). That archive is a zip file
whose records are stored uncompressed: a small pickle (``data.pkl``) naming the dtype, shape and
strides, a few constant records, and ``data/0``: the tensor's raw bytes. ``wrap`` builds the
bytes that go before and after the raw data, so ckptstore writes the data itself (zero-copy, in
parallel, checksummed) and knows where it sits: its own reader reads the raw bytes back at that
offset and never unpickles anything.

The pickle is the one ``torch.save`` writes for a contiguous CPU tensor (tests compare it byte for
byte). The data record is padded (an extra field, as torch's own writer does) so the raw bytes
start on a chosen boundary of the file. Like ``torch.save`` with its ``compute_crc32`` switch off,
the data record carries CRC 0 (torch's reader does not check it; ckptstore's manifest holds the
checksums); sizes and offsets past 4 GiB use zip64 records.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zlib
from typing import Any

import torch

ARCHIVE = "archive"
_ZIP64_LIMIT = 0xFFFFFFFF
_DOS_DATE = 0x21  # 1980-01-01
_PAD_ID = 0x4246  # the extra-field id torch's writer pads with ("FB")
_CONSTANT_RECORDS = (
    (".format_version", b"1"),
    (".storage_alignment", b"64"),
    ("byteorder", b"little"),
    ("version", b"3\n"),
    (".data/serialization_id", b"0" * 40),
)


class _StorageRef:
    """Stands for the tensor's storage in the pickle (a persistent id, as torch.save does)."""

    def __init__(self, dtype: torch.dtype, nbytes: int) -> None:
        self.dtype, self.nbytes = dtype, nbytes

    def persistent_id(self) -> tuple[Any, ...]:
        typed = torch.storage._dtype_to_storage_type_map().get(self.dtype)
        if typed is not None:
            cls = getattr(torch, typed)
            return ("storage", cls, "0", "cpu", self.nbytes // self.dtype.itemsize)
        return ("storage", torch.storage.UntypedStorage, "0", "cpu", self.nbytes)


class _TensorStub:
    """Pickles exactly as a contiguous CPU tensor of this dtype and shape does."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, shape

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        numel = 1
        for n in self.shape:
            numel *= n
        storage = _StorageRef(self.dtype, max(numel, 1 if self.shape == () else 0) * _size(self))
        stride, acc = [], 1
        for n in reversed(self.shape):
            stride.append(acc)
            acc *= max(n, 1)
        args: tuple[Any, ...] = (
            storage,
            0,
            tuple(self.shape),
            tuple(reversed(stride)),
            False,
            collections.OrderedDict(),
        )
        if storage.persistent_id()[1] is torch.storage.UntypedStorage:
            return (torch._utils._rebuild_tensor_v3, (*args, self.dtype))
        return (torch._utils._rebuild_tensor_v2, args)


def _size(stub: _TensorStub) -> int:
    return stub.dtype.itemsize


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.persistent_id() if isinstance(obj, _StorageRef) else None


def tensor_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """``data.pkl`` of ``torch.save(t)`` for a contiguous CPU tensor ``t``."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(_TensorStub(dtype, tuple(int(n) for n in shape)))
    return buf.getvalue()


def _local_header(name: bytes, crc: int, size: int, extra: bytes) -> bytes:
    big = size >= _ZIP64_LIMIT
    if big:
        extra = struct.pack("<HHQQ", 1, 16, size, size) + extra
    field = _ZIP64_LIMIT if big else size
    return (
        struct.pack(
            "<IHHHHHIIIHH",
            0x04034B50,
            45 if big else 20,
            0,
            0,
            0,
            _DOS_DATE,
            crc,
            field,
            field,
            len(name),
            len(extra),
        )
        + name
        + extra
    )


def _central_header(name: bytes, crc: int, size: int, offset: int) -> bytes:
    z64 = b""
    if size >= _ZIP64_LIMIT:
        z64 += struct.pack("<QQ", size, size)
    if offset >= _ZIP64_LIMIT:
        z64 += struct.pack("<Q", offset)
    extra = struct.pack("<HH", 1, len(z64)) + z64 if z64 else b""
    return (
        struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            45 if z64 else 20,
            45 if z64 else 20,
            0,
            0,
            0,
            _DOS_DATE,
            crc,
            min(size, _ZIP64_LIMIT),
            min(size, _ZIP64_LIMIT),
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            min(offset, _ZIP64_LIMIT),
        )
        + name
        + extra
    )


def _end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    out = b""
    if cd_offset >= _ZIP64_LIMIT or cd_offset + cd_size >= _ZIP64_LIMIT:
        z64_at = cd_offset + cd_size
        out += struct.pack(
            "<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset
        )
        out += struct.pack("<IIQI", 0x07064B50, 0, z64_at, 1)
    return out + struct.pack(
        "<IHHHHIIH",
        0x06054B50,
        0,
        0,
        count,
        count,
        min(cd_size, _ZIP64_LIMIT),
        min(cd_offset, _ZIP64_LIMIT),
        0,
    )


def wrap(
    dtype: torch.dtype, shape: tuple[int, ...], *, start: int, align: int
) -> tuple[bytes, bytes]:
    """``(head, tail)`` such that ``head + raw + tail`` is a ``torch.save`` file of the tensor
    whose bytes are ``raw``, and ``raw`` begins at a multiple of ``align`` when the blob begins
    at file offset ``start``."""
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * dtype.itemsize
    records = [("data.pkl", tensor_pickle(dtype, shape)), *_CONSTANT_RECORDS]
    head, central = b"", []
    for name, data in records:
        full = f"{ARCHIVE}/{name}".encode()
        crc = zlib.crc32(data)
        central.append((full, crc, len(data), len(head)))
        head += _local_header(full, crc, len(data), b"") + data
    data = f"{ARCHIVE}/data/0".encode()
    bare = len(_local_header(data, 0, nbytes, b""))
    pad = -(start + len(head) + bare + 4) % align  # 4: the padding field's own id and length
    central.append((data, 0, nbytes, len(head)))
    head += _local_header(data, 0, nbytes, struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad)
    cd = b"".join(_central_header(n, c, s, o) for n, c, s, o in central)
    cd_offset = len(head) + nbytes
    return head, cd + _end_records(len(central), cd_offset, len(cd))
