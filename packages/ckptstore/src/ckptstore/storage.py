"""Where bytes go: local disks (fast path) and any fsspec URL (s3 with a streaming fast path).

Writes checksum while writing (never re-read), in large pieces on several threads; local writes
go temp -> fsync -> rename -> directory fsync and use O_DIRECT where the filesystem allows it
(the page cache would cost a copy and the fsync a second pass). Reads verify every 4 MiB chunk
they touch against the manifest, so a rank verifies exactly what it reads, in constant memory.
On S3 a file is read with one streaming GET (ranged GETs are slow on many servers) and written
with a parallel multipart upload.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import functools
import os
import queue
import threading
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from . import _testing
from .buffers import ALIGN, BufferPool, align_up, copy_bytes, memview, zero_bytes
from .errors import CheckpointError, CorruptCheckpointError
from .manifest import CRC_CHUNK, Checksum, FileEntry

MiB = 1 << 20


# --------------------------------------------------------------------------------------------
# Payloads: the bytes of one file to write, produced piece by piece
# --------------------------------------------------------------------------------------------
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
            stop = start + data.numel()
            i += 1
            if stop <= pos:
                continue
            if start >= end:
                break
            if start > pos:
                zero_bytes(out[pos - offset : start - offset])
                pos = start
            take = min(stop, end)
            copy_bytes(out[pos - offset : take - offset], data[pos - start : take - start])
            pos = take
        if pos < end:
            zero_bytes(out[pos - offset :])

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


# --------------------------------------------------------------------------------------------
# I/O engine: thread pools and reusable staging buffers
# --------------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class IOOptions:
    """How hard to push the disk. The defaults suit a node with a few cores and one disk."""

    threads: int = 4
    # Async persistence uses one thread: a measured +4% on concurrent CPU training steps, vs
    # +33% with four (each extra thread preempts a training thread that the others then wait for).
    background_threads: int = 1
    piece_bytes: int = 16 * MiB
    direct: bool | None = None  # O_DIRECT: None = where the filesystem supports it
    background_nice: int = 10  # async persistence yields CPU to training (0 = same priority)
    s3_part_bytes: int = 32 * MiB
    s3_concurrency: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.threads <= 64:
            raise ValueError(f"io threads must be in 1..64, got {self.threads}")
        if not 1 <= self.background_threads <= 64:
            raise ValueError(f"background_threads must be in 1..64, got {self.background_threads}")
        if self.piece_bytes <= 0 or self.piece_bytes % CRC_CHUNK:
            raise ValueError(
                f"piece_bytes must be a positive multiple of {CRC_CHUNK} (the checksum chunk), "
                f"got {self.piece_bytes}"
            )
        if self.s3_part_bytes < 5 * MiB or self.s3_part_bytes % CRC_CHUNK:
            raise ValueError(
                f"s3_part_bytes must be >= 5 MiB (S3's minimum part) and a multiple of "
                f"{CRC_CHUNK}, got {self.s3_part_bytes}"
            )
        if not 0 <= self.background_nice <= 19:
            raise ValueError(f"background_nice must be in 0..19, got {self.background_nice}")
        if not 1 <= self.s3_concurrency <= 64:
            raise ValueError(f"s3_concurrency must be in 1..64, got {self.s3_concurrency}")


class DaemonPool(Executor):
    """A thread pool whose workers are daemon threads.

    ``concurrent.futures.ThreadPoolExecutor`` refuses new work once the interpreter starts
    shutting down, which would break the last async save of a script that simply ends: the
    (non-daemon) save thread is still running then and must be able to finish its pieces.
    """

    def __init__(self, threads: int, name: str, nice: int = 0) -> None:
        self._q: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None]
        self._q = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, args=(nice,), name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        f: Future[Any] = Future()
        self._q.put((f, functools.partial(fn, *args, **kwargs)))
        return f

    def _work(self, nice: int) -> None:
        _lower_priority(nice)
        while (job := self._q.get()) is not None:
            f, call = job
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(call())
            except BaseException as e:
                f.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for _ in self._threads:
            self._q.put(None)
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()


class IOEngine:
    """Thread pools (foreground, and a lower-priority one for background saves) plus staging."""

    def __init__(self, options: IOOptions | None = None) -> None:
        self.options = options or IOOptions()
        self._pools: dict[bool, DaemonPool] = {}
        self._staging: BufferPool | None = None
        self._big: BufferPool | None = None
        self._lock = threading.Lock()

    def pool(self, background: bool = False) -> Executor:
        with self._lock:
            if background not in self._pools:
                nice = self.options.background_nice if background else 0
                name = "ckptstore-bg" if background else "ckptstore-io"
                n = self.options.background_threads if background else self.options.threads
                self._pools[background] = DaemonPool(n, name, nice)
            return self._pools[background]

    @property
    def staging(self) -> BufferPool:
        """Piece-sized buffers: one per thread of both pools, so a worker never waits."""
        with self._lock:
            if self._staging is None:
                self._staging = BufferPool(2 * self.options.threads + 2, self.options.piece_bytes)
            return self._staging

    def staging_for(self, nbytes: int) -> BufferPool:
        """A pool whose buffers hold ``nbytes`` (S3 parts may be larger than pieces)."""
        if nbytes <= self.options.piece_bytes:
            return self.staging
        with self._lock:
            if self._big is None or self._big.size < nbytes:
                self._big = BufferPool(self.options.s3_concurrency + 1, nbytes)
            return self._big

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], background: bool) -> list[Any]:
        """Run ``fn`` over ``items`` on the pool; wait for all; raise the first error."""
        futures: list[Future[Any]] = [self.pool(background).submit(fn, x) for x in items]
        results, first_error = [], None
        for f in futures:
            try:
                results.append(f.result())
            except BaseException as e:  # noqa: PERF203 - collect, then raise the first
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return results

    def copy_all(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, cuda: bool) -> None:
        """copy_bytes(dst, src) for every pair; CPU copies split in 16 MiB chunks over the
        foreground pool (a snapshot is memory-bound: a few threads get more bandwidth)."""
        chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dst, src in pairs:
            if src.device.type != "cpu":
                copy_bytes(dst, src, non_blocking=cuda)
                continue
            step = 16 * MiB
            chunks += [(dst[o : o + step], src[o : o + step]) for o in range(0, src.numel(), step)]
        if len(chunks) <= 2:
            for dst, src in chunks:
                copy_bytes(dst, src)
            return
        # batches of ~64 MiB per task keep the per-task overhead small for many tiny tensors
        batches: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
        size = 0
        for c in chunks:
            batches[-1].append(c)
            size += c[1].numel()
            if size >= 4 * step:
                batches.append([])
                size = 0
        self.map(_copy_batch, [b for b in batches if b], background=False)

    def close(self) -> None:
        with self._lock:
            pools, self._pools = self._pools, {}
            self._staging = self._big = None
        for p in pools.values():
            p.shutdown(wait=True)


def _copy_batch(batch: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in batch:
        copy_bytes(dst, src)


def _lower_priority(nice: int) -> None:
    if nice and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError, AttributeError):
            # On Linux a thread id works as a "process" here: only this worker is reniced.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def crc_chunks(mv: memoryview, offset: int) -> list[tuple[int, int]]:
    """(chunk index, crc32) of each CRC_CHUNK piece of ``mv``, which starts at file ``offset``."""
    assert offset % CRC_CHUNK == 0
    return [
        ((offset + a) // CRC_CHUNK, zlib.crc32(mv[a : a + CRC_CHUNK]))
        for a in range(0, len(mv), CRC_CHUNK)
    ]


def _pieces(size: int, piece: int) -> list[tuple[int, int]]:
    return [(off, min(piece, size - off)) for off in range(0, size, piece)]


def _n_chunks(size: int) -> int:
    return -(-size // CRC_CHUNK)


def _disk_error(e: OSError, what: str) -> CheckpointError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointError(
            f"no space left writing {what} ({e.strerror}); nothing was committed and the previous "
            "checkpoint is intact: free space, lower keep_last, or point the store elsewhere"
        )
    return CheckpointError(f"I/O error writing {what}: {e}")


# --------------------------------------------------------------------------------------------
# Destinations for verified reads
# --------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Dest:
    """Read file bytes ``[offset, offset + buf.numel())`` into ``buf`` (a CPU uint8 tensor)."""

    offset: int
    buf: torch.Tensor

    @property
    def end(self) -> int:
        return self.offset + self.buf.numel()


def needed_chunks(dests: Sequence[Dest], size: int) -> list[tuple[int, int]]:
    """Merged runs [first, last+1) of checksum chunks that cover every destination."""
    idx = sorted(
        {
            c
            for d in dests
            if d.buf.numel()
            for c in range(d.offset // CRC_CHUNK, _n_chunks(min(d.end, size)))
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


# --------------------------------------------------------------------------------------------
# Storage protocol
# --------------------------------------------------------------------------------------------
class Storage(Protocol):
    """One filesystem. Paths are plain strings as that filesystem spells them."""

    root: str
    is_object_store: bool

    def join(self, *parts: str) -> str: ...
    def url(self, path: str) -> str: ...
    def makedirs(self, path: str) -> None: ...
    def list_dir(self, path: str) -> list[str]: ...
    def exists(self, path: str) -> bool: ...
    def read_small(self, path: str) -> bytes: ...
    def write_small(self, path: str, data: bytes, *, pause: str = "") -> None: ...
    def write_payload(
        self, path: str, payload: Payload, io: IOEngine, *, background: bool = False
    ) -> FileEntry: ...
    def read_into(
        self, path: str, entry: FileEntry, dests: Sequence[Dest], io: IOEngine
    ) -> None: ...
    def verify(self, path: str, entry: FileEntry, io: IOEngine) -> str | None: ...
    def delete(self, path: str) -> None: ...
    def rmdir(self, path: str) -> None: ...


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """Local paths and ``file://`` get the local fast path; anything else goes through fsspec."""
    opts = dict(storage_options or {})
    if "://" not in url or url.startswith(("file://", "local://")):
        path = url.split("://", 1)[1] if "://" in url else url
        return LocalStorage(os.path.abspath(os.path.expanduser(path)))
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        fs, path = fsspec.core.url_to_fs(url, **opts)
    except ImportError as e:
        hint = "pip install 'ckptstore[s3]'" if protocol in ("s3", "s3a") else str(e)
        raise CheckpointError(f"cannot open {url}: {protocol}:// needs an extra: {hint}") from e
    except ValueError as e:
        raise CheckpointError(f"cannot open {url}: {e}") from e
    if type(fs).__name__ == "LocalFileSystem":
        return LocalStorage(os.path.abspath(path))
    return FsspecStorage(fs, path.rstrip("/"))


# --------------------------------------------------------------------------------------------
# Local disk
# --------------------------------------------------------------------------------------------
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    done = 0
    while done < len(mv):
        n = os.pwrite(fd, mv[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


def _pread_all(fd: int, mv: memoryview, offset: int) -> int:
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class LocalStorage:
    """A POSIX directory tree: atomic renames, fsync, O_DIRECT where supported."""

    is_object_store = False

    def __init__(self, root: str) -> None:
        self.root = root
        self._direct_ok: dict[str, bool] = {}

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def url(self, path: str) -> str:
        return path

    def makedirs(self, path: str) -> None:
        missing = []
        p = path
        while not os.path.isdir(p):
            missing.append(p)
            parent = os.path.dirname(p)
            if parent == p:
                break
            p = parent
        os.makedirs(path, exist_ok=True)
        for d in reversed(missing):  # each new entry must survive a crash: fsync its parent
            fsync_dir(os.path.dirname(d))

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read_small(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write_small(self, path: str, data: bytes, *, pause: str = "") -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                _pwrite_all(fd, memoryview(data), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            if pause:
                _testing.pause_point(pause)
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(path))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise _disk_error(e, path) from e

    def _open_write(self, tmp: str, want_direct: bool | None, size: int) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        direct_flag = getattr(os, "O_DIRECT", 0)
        d = os.path.dirname(tmp)
        if (
            want_direct is not False
            and direct_flag
            and size >= MiB
            and self._direct_ok.get(d, True)
        ):
            try:
                return os.open(tmp, flags | direct_flag, 0o644), True
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT (tmpfs)
                    raise
                self._direct_ok[d] = False
        return os.open(tmp, flags, 0o644), False

    def write_payload(
        self, path: str, payload: Payload, io: IOEngine, *, background: bool = False
    ) -> FileEntry:
        size = payload.size
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        crcs = [0] * _n_chunks(size)
        try:
            fd, direct = self._open_write(tmp, io.options.direct, size)
        except OSError as e:
            raise _disk_error(e, path) from e
        first_piece_done = threading.Event()

        def write_piece(piece: tuple[int, int]) -> None:
            off, n = piece
            wlen = align_up(n) if direct else n  # O_DIRECT: whole pages; truncated below
            src = payload.view(off, wlen)
            if src is not None and (not direct or src.data_ptr() % ALIGN == 0):
                self._write_mv(fd, memview(src), off, n, crcs)
            else:
                with io.staging.get() as buf:
                    payload.fill(off, buf[:n])
                    if wlen > n:
                        zero_bytes(buf[n:wlen])
                    self._write_mv(fd, memview(buf[:wlen]), off, n, crcs)
            if not first_piece_done.is_set():
                first_piece_done.set()
                _testing.pause_point("payload-partial")

        try:
            try:
                if size:
                    # Reserve the space first: a full disk fails here, before any byte moves.
                    os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise
            io.map(write_piece, _pieces(size, io.options.piece_bytes), background)
            if direct and size % ALIGN:
                os.ftruncate(fd, size)
            os.fsync(fd)
        except BaseException as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError):
                raise _disk_error(e, path) from e
            raise
        os.close(fd)
        try:
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(path))
        except OSError as e:
            raise _disk_error(e, path) from e
        return FileEntry(os.path.basename(path), size, Checksum(CRC_CHUNK, tuple(crcs)))

    @staticmethod
    def _write_mv(fd: int, mv: memoryview, off: int, n: int, crcs: list[int]) -> None:
        for i, crc in crc_chunks(mv[:n], off):
            crcs[i] = crc
        _pwrite_all(fd, mv, off)

    def _check_size(self, fd: int, entry: FileEntry, url: str) -> None:
        actual = os.fstat(fd).st_size
        if actual != entry.size:
            what = "truncated" if actual < entry.size else "longer than recorded"
            raise CorruptCheckpointError(
                f"{url}: {what}: {actual} bytes on disk, manifest says {entry.size}"
            )

    def _open_read(self, path: str) -> tuple[int, int | None]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: missing file listed in the manifest") from None
        dfd = None
        direct_flag = getattr(os, "O_DIRECT", 0)
        d = os.path.dirname(path)
        if direct_flag and self._direct_ok.get(d, True):
            try:
                dfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | direct_flag)
            except OSError:
                self._direct_ok[d] = False
        return fd, dfd

    def read_into(self, path: str, entry: FileEntry, dests: Sequence[Dest], io: IOEngine) -> None:
        fd, dfd = self._open_read(path)
        try:
            self._check_size(fd, entry, path)
            piece = io.options.piece_bytes
            jobs = []
            for c0, c1 in needed_chunks(dests, entry.size):
                start, stop = c0 * CRC_CHUNK, min(c1 * CRC_CHUNK, entry.size)
                jobs += [(off, min(piece, stop - off)) for off in range(start, stop, piece)]

            def read_piece(job: tuple[int, int]) -> None:
                off, n = job
                rlen = align_up(n)
                target = next((d for d in dests if d.offset <= off and off + n <= d.end), None)
                if target is not None and dfd is not None and io.options.direct is not False:
                    dst = target.buf[off - target.offset :]
                    if dst.numel() >= rlen and dst.data_ptr() % ALIGN == 0:
                        mv = memview(dst[:rlen])
                        self._read_checked(dfd, mv, off, n, entry, path)
                        return
                if target is not None:
                    mv = memview(target.buf[off - target.offset : off - target.offset + n])
                    self._read_checked(fd, mv, off, n, entry, path)
                    return
                with io.staging.get() as buf:
                    use_direct = dfd is not None and io.options.direct is not False
                    mv = memview(buf[: rlen if use_direct else n])
                    self._read_checked(dfd if use_direct else fd, mv, off, n, entry, path)  # type: ignore[arg-type]
                    scatter(mv[:n], off, dests)

            io.map(read_piece, jobs, background=False)
        finally:
            os.close(fd)
            if dfd is not None:
                os.close(dfd)

    @staticmethod
    def _read_checked(
        fd: int, mv: memoryview, off: int, n: int, entry: FileEntry, url: str
    ) -> None:
        got = _pread_all(fd, mv, off)
        if got < n:
            raise CorruptCheckpointError(f"{url}: truncated while reading at byte {off + got}")
        check_chunks(crc_chunks(mv[:n], off), entry, url)

    def verify(self, path: str, entry: FileEntry, io: IOEngine) -> str | None:
        try:
            fd, dfd = self._open_read(path)
        except CorruptCheckpointError as e:
            return str(e)
        try:
            self._check_size(fd, entry, path)

            def check(job: tuple[int, int]) -> None:
                off, n = job
                with io.staging.get() as buf:
                    use = dfd if dfd is not None and io.options.direct is not False else fd
                    mv = memview(buf[: align_up(n) if use == dfd else n])
                    self._read_checked(use, mv, off, n, entry, path)

            io.map(check, _pieces(entry.size, io.options.piece_bytes), background=False)
        except CorruptCheckpointError as e:
            return str(e)
        finally:
            os.close(fd)
            if dfd is not None:
                os.close(dfd)
        return None

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def rmdir(self, path: str) -> None:
        with contextlib.suppress(OSError):  # not empty (foreign files stay) or already gone
            os.rmdir(path)
            fsync_dir(os.path.dirname(path))


# --------------------------------------------------------------------------------------------
# fsspec (object stores and anything else)
# --------------------------------------------------------------------------------------------
class FsspecStorage:
    """Any fsspec filesystem. On object stores a PUT is atomic, so the manifest's presence is
    the commit; there are no directories to fsync."""

    def __init__(self, fs: Any, root: str) -> None:
        self.fs, self.root = fs, root
        self.is_s3 = type(fs).__name__ == "S3FileSystem"
        self.is_object_store = not getattr(fs, "local_file", False)

    def join(self, *parts: str) -> str:
        return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))

    def url(self, path: str) -> str:
        return str(self.fs.unstrip_protocol(path))

    def makedirs(self, path: str) -> None:
        with contextlib.suppress(FileExistsError):
            self.fs.makedirs(path, exist_ok=True)

    def list_dir(self, path: str) -> list[str]:
        self.fs.invalidate_cache(path)
        try:
            names = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = path.rstrip("/")
        return sorted({n.rstrip("/").rsplit("/", 1)[-1] for n in names if n.rstrip("/") != base})

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(self.fs.exists(path))

    def read_small(self, path: str) -> bytes:
        self.fs.invalidate_cache(path)
        return bytes(self.fs.cat_file(path))

    def write_small(self, path: str, data: bytes, *, pause: str = "") -> None:
        if pause:
            _testing.pause_point(pause)
        try:
            self.fs.pipe_file(path, data)
        except OSError as e:
            raise _disk_error(e, self.url(path)) from e
        self.fs.invalidate_cache(path)

    # -- writes ----------------------------------------------------------------------------
    def write_payload(
        self, path: str, payload: Payload, io: IOEngine, *, background: bool = False
    ) -> FileEntry:
        if self.is_s3 and payload.size > io.options.s3_part_bytes:
            crcs = self._s3_multipart(path, payload, io, background)
        else:
            crcs = self._sequential_write(path, payload, io)
        self.fs.invalidate_cache(path)
        name = path.rstrip("/").rsplit("/", 1)[-1]
        return FileEntry(name, payload.size, Checksum(CRC_CHUNK, tuple(crcs)))

    def _piece_bytes(
        self, payload: Payload, off: int, n: int, io: IOEngine
    ) -> tuple[bytes, list[tuple[int, int]]]:
        src = payload.view(off, n)
        if src is not None:
            mv = memview(src)[:n]
            return bytes(mv), crc_chunks(mv, off)
        with io.staging_for(n).get() as buf:
            payload.fill(off, buf[:n])
            mv = memview(buf[:n])
            return bytes(mv), crc_chunks(mv, off)

    def _sequential_write(self, path: str, payload: Payload, io: IOEngine) -> list[int]:
        crcs = [0] * _n_chunks(payload.size)
        try:
            with self.fs.open(path, "wb") as f:
                for i, (off, n) in enumerate(_pieces(payload.size, io.options.piece_bytes)):
                    data, got = self._piece_bytes(payload, off, n, io)
                    for c, crc in got:
                        crcs[c] = crc
                    f.write(data)
                    if i == 0:
                        _testing.pause_point("payload-partial")
        except OSError as e:
            raise _disk_error(e, self.url(path)) from e
        return crcs

    def _s3_multipart(
        self, path: str, payload: Payload, io: IOEngine, background: bool
    ) -> list[int]:
        import asyncio

        from fsspec.asyn import sync

        fs = self.fs
        bucket, key, _ = fs.split_path(path)
        part = max(io.options.s3_part_bytes, align_up(-(-payload.size // 9000), CRC_CHUNK))
        crcs = [0] * _n_chunks(payload.size)
        pool = io.pool(background)

        async def upload() -> None:
            mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
            upload_id = mpu["UploadId"]
            sem = asyncio.Semaphore(io.options.s3_concurrency)
            loop = asyncio.get_running_loop()

            async def one(i: int, off: int, n: int) -> dict[str, Any]:
                async with sem:
                    data, got = await loop.run_in_executor(
                        pool, self._piece_bytes, payload, off, n, io
                    )
                    for c, crc in got:
                        crcs[c] = crc
                    out = await fs._call_s3(
                        "upload_part",
                        Bucket=bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=i + 1,
                        Body=data,
                    )
                    if i == 0:
                        await loop.run_in_executor(None, _testing.pause_point, "payload-partial")
                    return {"PartNumber": i + 1, "ETag": out["ETag"]}

            try:
                parts = await asyncio.gather(
                    *(one(i, off, n) for i, (off, n) in enumerate(_pieces(payload.size, part)))
                )
                await fs._call_s3(
                    "complete_multipart_upload",
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": list(parts)},
                )
            except BaseException:
                with contextlib.suppress(Exception):
                    await fs._call_s3(
                        "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id
                    )
                raise

        try:
            sync(fs.loop, upload)
        except OSError as e:
            raise _disk_error(e, self.url(path)) from e
        return crcs

    # -- reads -----------------------------------------------------------------------------
    def _stream(self, path: str, start: int, stop: int, piece: int) -> Iterator[bytes]:
        """Bytes [start, stop) of a file, in order, with as few requests as possible."""
        if stop <= start:
            return
        if self.is_s3:
            yield from self._s3_stream(path, start, stop)
            return
        with self.fs.open(path, "rb", block_size=piece, cache_type="none") as f:
            f.seek(start)
            pos = start
            while pos < stop:
                data = f.read(min(piece, stop - pos))
                if not data:
                    return
                pos += len(data)
                yield data

    def _s3_stream(self, path: str, start: int, stop: int) -> Iterator[bytes]:
        """One streaming GET; chunks are handed over through a small bounded queue."""
        import asyncio
        import queue as _queue

        from fsspec.asyn import sync

        fs = self.fs
        bucket, key, version = fs.split_path(path)
        q: _queue.Queue[bytes | BaseException | None] = _queue.Queue(maxsize=8)
        cancelled = threading.Event()

        async def pump() -> None:
            kw: dict[str, Any] = {"Bucket": bucket, "Key": key}
            if version:
                kw["VersionId"] = version
            kw["Range"] = f"bytes={start}-{stop - 1}"
            resp = await fs._call_s3("get_object", **kw)
            body = resp["Body"]
            try:
                buf = bytearray()
                while not cancelled.is_set():
                    chunk = await body.read(4 * MiB)
                    if not chunk:
                        break
                    buf += chunk
                    if len(buf) >= 4 * MiB:
                        await asyncio.get_running_loop().run_in_executor(None, q.put, bytes(buf))
                        buf.clear()
                if buf:
                    await asyncio.get_running_loop().run_in_executor(None, q.put, bytes(buf))
            finally:
                body.close()

        def run() -> None:
            try:
                sync(fs.loop, pump)
                q.put(None)
            except BaseException as e:
                q.put(e)

        t = threading.Thread(target=run, name="ckptstore-s3-get", daemon=True)
        t.start()
        try:
            while True:
                item = q.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()
            while t.is_alive():  # drain so the producer never blocks on a full queue
                with contextlib.suppress(_queue.Empty):
                    q.get(timeout=0.05)

    def _size(self, path: str) -> int:
        self.fs.invalidate_cache(path)
        try:
            return int(self.fs.size(path))
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{self.url(path)}: missing file listed in the manifest"
            ) from None

    def _check_size(self, path: str, entry: FileEntry) -> None:
        actual = self._size(path)
        if actual != entry.size:
            what = "truncated" if actual < entry.size else "longer than recorded"
            raise CorruptCheckpointError(
                f"{self.url(path)}: {what}: {actual} bytes stored, manifest says {entry.size}"
            )

    def _verified_runs(
        self, path: str, entry: FileEntry, runs: Sequence[tuple[int, int]], io: IOEngine
    ) -> Iterator[tuple[int, memoryview]]:
        """(offset, bytes) of each checksum chunk in ``runs``, verified, in file order."""
        url = self.url(path)
        chunk = bytearray()
        for c0, c1 in runs:
            start, stop = c0 * CRC_CHUNK, min(c1 * CRC_CHUNK, entry.size)
            pos = start
            for data in self._stream(path, start, stop, io.options.piece_bytes):
                mv = memoryview(data)
                while len(mv):
                    want = min(CRC_CHUNK, stop - pos) - len(chunk)
                    chunk += mv[:want]
                    mv = mv[want:]
                    if len(chunk) == min(CRC_CHUNK, stop - pos):
                        check_chunks([(pos // CRC_CHUNK, zlib.crc32(chunk))], entry, url)
                        yield pos, memoryview(chunk)
                        pos += len(chunk)
                        chunk = bytearray()
            if pos != stop:
                raise CorruptCheckpointError(f"{url}: truncated while reading at byte {pos}")

    def read_into(self, path: str, entry: FileEntry, dests: Sequence[Dest], io: IOEngine) -> None:
        self._check_size(path, entry)
        for off, data in self._verified_runs(path, entry, needed_chunks(dests, entry.size), io):
            scatter(data, off, dests)

    def verify(self, path: str, entry: FileEntry, io: IOEngine) -> str | None:
        try:
            self._check_size(path, entry)
            runs = [(0, _n_chunks(entry.size))] if entry.size else []
            for _ in self._verified_runs(path, entry, runs, io):
                pass
        except CorruptCheckpointError as e:
            return str(e)
        except OSError as e:
            return f"{self.url(path)}: cannot read ({e})"
        return None

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)
        self.fs.invalidate_cache(path)

    def rmdir(self, path: str) -> None:
        if self.list_dir(path):
            return  # foreign files stay, and so does their directory
        with contextlib.suppress(OSError, ValueError):
            self.fs.rmdir(path)
        self.fs.invalidate_cache(path)
