"""The byte layer: pieces, gaps, O_DIRECT and its fallback, chunked checksums, S3 multipart."""

from __future__ import annotations

import os
import uuid
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointError, CorruptCheckpointError, IOOptions
from ckptstore.buffers import aligned_empty, memview
from ckptstore.manifest import CRC_CHUNK
from ckptstore.storage import (
    BufferPayload,
    Dest,
    IOEngine,
    SegmentPayload,
    needed_chunks,
    open_storage,
)

MiB = 1 << 20


def payload_of(size: int, seed: int = 0) -> tuple[SegmentPayload, bytes]:
    """Segments with gaps between them (gaps must read as zeros)."""
    g = torch.Generator().manual_seed(seed)
    segs, expect = [], bytearray(size)
    pos = 100
    while pos < size - 10:
        n = min(int(torch.randint(1, 3 * MiB, (1,), generator=g)), size - pos)
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        segs.append((pos, data))
        expect[pos : pos + n] = bytes(data.tolist()) if n < 4096 else memview(data).tobytes()
        pos += n + int(torch.randint(0, 5000, (1,), generator=g))
    return SegmentPayload(size, segs), bytes(expect)


def crcs_of(data: bytes) -> tuple[int, ...]:
    return tuple(zlib.crc32(data[i : i + CRC_CHUNK]) for i in range(0, len(data), CRC_CHUNK))


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_local_write_read_verify(tmp_path: Path, where: str) -> None:
    base = tmp_path if where == "disk" else Path("/dev/shm")  # tmpfs has no O_DIRECT
    d = base / f"ckpt-storage-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    try:
        st = open_storage(str(d))
        io = IOEngine(IOOptions(piece_bytes=4 * MiB, threads=3))
        payload, expect = payload_of(13 * MiB + 12345)
        entry = st.write_payload(str(d / "f.bin"), payload, io)
        assert (d / "f.bin").read_bytes() == expect
        assert entry.size == len(expect) and entry.checksum.values == crcs_of(expect)
        assert st.verify(str(d / "f.bin"), entry, io) is None
        # partial, unaligned reads into several destinations, some sharing a chunk
        dests = [
            Dest(5, torch.empty(10, dtype=torch.uint8)),
            Dest(4 * MiB - 3, torch.empty(7, dtype=torch.uint8)),
            Dest(8 * MiB, aligned_empty(5 * MiB + 12345)),
        ]
        st.read_into(str(d / "f.bin"), entry, dests, io)
        for dst in dests:
            assert memview(dst.buf).tobytes() == expect[dst.offset : dst.end]
        # a flipped bit in the last chunk: found by verify and by reads that touch it only
        with open(d / "f.bin", "r+b") as f:
            f.seek(len(expect) - 1)
            f.write(bytes([expect[-1] ^ 1]))
        assert "chunk 3" in (st.verify(str(d / "f.bin"), entry, io) or "")
        st.read_into(str(d / "f.bin"), entry, dests[:2], io)  # chunks 0 and 1: fine
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            st.read_into(str(d / "f.bin"), entry, dests[2:], io)
        io.close()
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


def test_buffer_payload_writes_without_copy(tmp_path: Path) -> None:
    buf = aligned_empty(8 * MiB + 4096)
    buf.random_(0, 256)
    st = open_storage(str(tmp_path))
    io = IOEngine()
    entry = st.write_payload(str(tmp_path / "b"), BufferPayload(buf, 8 * MiB + 100), io)
    assert (tmp_path / "b").read_bytes() == memview(buf[: 8 * MiB + 100]).tobytes()
    assert entry.size == 8 * MiB + 100
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_needed_chunks_merge_runs() -> None:
    d = [
        Dest(0, torch.empty(1, dtype=torch.uint8)),
        Dest(CRC_CHUNK * 2 + 5, torch.empty(CRC_CHUNK, dtype=torch.uint8)),
        Dest(CRC_CHUNK * 9, torch.empty(0)),
    ]
    assert needed_chunks(d, CRC_CHUNK * 10) == [(0, 1), (2, 4)]


@pytest.mark.s3
def test_s3_multipart_and_streaming_reads(moto: Any) -> None:
    st = open_storage(f"s3://ckpt/storage-{uuid.uuid4().hex[:6]}", moto.storage_options())
    io = IOEngine(IOOptions(s3_part_bytes=8 * MiB, s3_concurrency=3))
    payload, expect = payload_of(20 * MiB + 7)
    path = st.join(st.root, "f.bin")
    entry = st.write_payload(path, payload, io)  # 3 parts
    assert entry.checksum.values == crcs_of(expect)
    assert st.verify(path, entry, io) is None
    dest = Dest(9 * MiB + 3, torch.empty(MiB, dtype=torch.uint8))
    st.read_into(path, entry, [dest], io)
    assert memview(dest.buf).tobytes() == expect[dest.offset : dest.end]
    st.write_small(path, expect[:-1])  # truncate
    assert "truncated" in (st.verify(path, entry, io) or "")
    io.close()


def test_io_options_say_how_to_fix() -> None:
    with pytest.raises(ValueError, match="multiple of"):
        IOOptions(piece_bytes=1000)
    with pytest.raises(ValueError, match="5 MiB"):
        IOOptions(s3_part_bytes=MiB)
    with pytest.raises(ValueError, match="threads"):
        IOOptions(threads=0)


def test_unknown_protocol_is_a_clear_error() -> None:
    with pytest.raises(CheckpointError, match="nosuchproto"):
        open_storage("nosuchproto://x/y")


@pytest.mark.parametrize("engine", ["pool", "inline"])
def test_stream_reads_in_order_and_raises_after_every_finish(engine: str) -> None:
    from ckptstore.storage import InlineIO

    io = IOEngine(IOOptions(threads=4))
    eng = io if engine == "pool" else InlineIO(io)
    read_order, finished = [], []

    def read(x: int) -> int:
        read_order.append(x)
        if x == 7:
            raise OSError("disk gone at 7")
        return x

    def finish(x: int) -> None:
        if x == 3:
            raise CorruptCheckpointError("chunk 3")
        finished.append(x)

    with pytest.raises((OSError, CorruptCheckpointError)) as e:
        eng.stream(range(10), read, finish)
    # in order, in the caller's thread; the pool finished everything read before raising
    assert read_order == (list(range(8)) if engine == "pool" else [0, 1, 2, 3])
    want = [0, 1, 2, 4, 5, 6] if engine == "pool" else [0, 1, 2]
    assert sorted(finished) == want
    # the first error: a checksum of the pool's finishes comes after the reader's own error
    assert isinstance(e.value, OSError if engine == "pool" else CorruptCheckpointError)
    io.close()


def test_an_idle_worker_keeps_nothing_of_its_last_job() -> None:
    import gc
    import time
    import weakref

    io = IOEngine(IOOptions(threads=2))

    class Big:
        pass

    obj = Big()
    ref = weakref.ref(obj)
    io.map(lambda o: None, [obj], background=False)
    io.stream([obj], lambda o: o, lambda o: None)
    del obj
    deadline = time.monotonic() + 10  # a worker drops its job just after setting the result
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert ref() is None  # a mapped file or a snapshot buffer would stay alive here
    io.close()
