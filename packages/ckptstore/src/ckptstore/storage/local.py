"""Local disks (and NFS/Lustre mounts): atomic renames, fsync, O_DIRECT where supported."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..buffers import ALIGN, align_up, memview, zero_bytes
from ..errors import CorruptCheckpointError, disk_error
from ..manifest import CRC_CHUNK, Checksum, FileEntry
from ..smallfile import read_small_file
from .engine import IOEngine
from .payload import (
    Dest,
    MiB,
    Payload,
    check_chunks,
    crc_chunks,
    n_chunks,
    needed_chunks,
    pieces,
    scatter,
)

# errnos of filesystems without hard links (some FUSE mounts): exclusive create falls back to
# O_EXCL, which NFSv3+ also makes atomic.
_NO_LINK = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}
BREAKER_STALE_S = 10.0  # a compare-and-swap holds its breaker for milliseconds


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


def _tmp_name(path: str) -> str:
    return f"{path}.tmp-{uuid.uuid4().hex[:12]}"


def _discard(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_new(path: str, data: bytes) -> None:
    """Create ``path`` (it must not exist) holding ``data``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _pwrite_all(fd, memoryview(data), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _reserve(fd: int, size: int) -> None:
    """Reserve the space first: a full disk fails here, before any byte moves."""
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise


def _age_s(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return 0.0


class LocalStorage:
    """A POSIX directory tree: atomic renames, fsync, O_DIRECT where supported."""

    is_object_store = False

    def __init__(self, root: str) -> None:
        self.root = root
        self._direct_ok: dict[str, bool] = {}

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any]) -> LocalStorage:
        """A plain path, ``file://PATH`` or ``local://PATH`` (``~`` expanded; no options)."""
        path = url.split("://", 1)[1] if "://" in url else url
        return cls(os.path.abspath(os.path.expanduser(path)))

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def url(self, path: str) -> str:
        return path

    def local_path(self, path: str) -> str | None:
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
        return read_small_file(path)  # another process wrote it: never a FIFO, never 2 GB

    def write_small(self, path: str, data: bytes) -> None:
        tmp = _tmp_name(path)
        try:
            _write_new(tmp, data)
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(path))
        except OSError as e:
            _discard(tmp)
            raise disk_error(e, path) from e

    # -- payload writes --------------------------------------------------------------------
    def write_payload(
        self, path: str, payload: Payload, io: IOEngine, *, background: bool = False
    ) -> FileEntry:
        tmp = _tmp_name(path)
        try:
            fd, direct = self._open_write(tmp, io.options.direct, payload.size)
        except OSError as e:
            raise disk_error(e, path) from e
        try:
            crcs = self._write_all(fd, direct, payload, io, background)
        except BaseException as e:
            _discard(tmp)
            if isinstance(e, OSError):
                raise disk_error(e, path) from e
            raise
        finally:
            os.close(fd)
        self._rename_durably(tmp, path)
        return FileEntry(os.path.basename(path), payload.size, Checksum(CRC_CHUNK, tuple(crcs)))

    def _open_write(self, tmp: str, want_direct: bool | None, size: int) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        direct_flag = getattr(os, "O_DIRECT", 0)
        d = os.path.dirname(tmp)
        wanted = want_direct is not False and direct_flag and size >= MiB
        if wanted and self._direct_ok.get(d, True):
            try:
                return os.open(tmp, flags | direct_flag, 0o644), True
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT (tmpfs)
                    raise
                self._direct_ok[d] = False
        return os.open(tmp, flags, 0o644), False

    def _write_all(
        self, fd: int, direct: bool, payload: Payload, io: IOEngine, background: bool
    ) -> list[int]:
        crcs = [0] * n_chunks(payload.size)
        _reserve(fd, payload.size)
        write = functools.partial(self._write_piece, fd, direct, payload, io, crcs)
        io.map(write, pieces(payload.size, io.options.piece_bytes), background)
        if direct and payload.size % ALIGN:
            os.ftruncate(fd, payload.size)  # O_DIRECT wrote whole pages
        os.fsync(fd)
        return crcs

    def _write_piece(
        self,
        fd: int,
        direct: bool,
        payload: Payload,
        io: IOEngine,
        crcs: list[int],
        piece: tuple[int, int],
    ) -> None:
        off, n = piece
        wlen = align_up(n) if direct else n  # O_DIRECT: whole pages; truncated afterwards
        src = payload.view(off, wlen)
        if src is not None and (not direct or src.data_ptr() % ALIGN == 0):
            self._write_mv(fd, memview(src), off, n, crcs)
            return
        with io.staging.get() as buf:
            payload.fill(off, buf[:n])
            if wlen > n:
                zero_bytes(buf[n:wlen])
            self._write_mv(fd, memview(buf[:wlen]), off, n, crcs)

    @staticmethod
    def _write_mv(fd: int, mv: memoryview, off: int, n: int, crcs: list[int]) -> None:
        for i, crc in crc_chunks(mv[:n], off):
            crcs[i] = crc
        _pwrite_all(fd, mv, off)

    @staticmethod
    def _rename_durably(tmp: str, path: str) -> None:
        try:
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(path))
        except OSError as e:
            raise disk_error(e, path) from e

    # -- verified reads --------------------------------------------------------------------
    def _open_read(self, path: str, io: IOEngine) -> tuple[int, int | None]:
        """A normal fd, and an O_DIRECT one only when asked for (``direct=True``): buffered
        reads measured as fast cold and several times faster from the page cache."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: missing file listed in the manifest") from None
        direct_flag = getattr(os, "O_DIRECT", 0)
        d = os.path.dirname(path)
        if not direct_flag or io.options.direct is not True or not self._direct_ok.get(d, True):
            return fd, None
        try:
            return fd, os.open(path, os.O_RDONLY | os.O_CLOEXEC | direct_flag)
        except OSError:
            self._direct_ok[d] = False
            return fd, None

    @contextlib.contextmanager
    def _reader(
        self, path: str, entry: FileEntry, dests: Sequence[Dest], io: IOEngine
    ) -> Iterator[_PieceReader]:
        fd, dfd = self._open_read(path, io)
        try:
            actual = os.fstat(fd).st_size
            if actual != entry.size:
                what = "truncated" if actual < entry.size else "longer than recorded"
                raise CorruptCheckpointError(
                    f"{path}: {what}: {actual} bytes on disk, manifest says {entry.size}"
                )
            yield _PieceReader(fd, dfd, entry, path, dests, io)
        finally:
            os.close(fd)
            if dfd is not None:
                os.close(dfd)

    def read_into(self, path: str, entry: FileEntry, dests: Sequence[Dest], io: IOEngine) -> None:
        with self._reader(path, entry, dests, io) as reader:
            io.stream(reader.jobs(), reader.fetch, reader.place)

    def verify(self, path: str, entry: FileEntry, io: IOEngine) -> str | None:
        try:
            with self._reader(path, entry, (), io) as reader:
                io.stream(pieces(entry.size, io.options.piece_bytes), reader.fetch, reader.place)
        except CorruptCheckpointError as e:
            return str(e)
        return None

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def rmdir(self, path: str) -> None:
        with contextlib.suppress(OSError):  # not empty (foreign files stay) or already gone
            os.rmdir(path)
            fsync_dir(os.path.dirname(path))

    # -- atomic primitives (the writer lock) -------------------------------------------------
    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        try:
            data = self.read_small(path)
        except FileNotFoundError:
            return None
        return data, _digest(data)

    def create_exclusive(self, path: str, data: bytes) -> str | None:
        """Create ``path`` holding ``data`` unless it exists; its version, or None. Atomic on
        local disks and NFS: the complete file is hard-linked into place, so no reader ever
        sees it half written."""
        self.makedirs(os.path.dirname(path))
        tmp = _tmp_name(path)
        _write_new(tmp, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return None
        except OSError as e:
            if e.errno not in _NO_LINK:
                raise
            return self._create_excl(path, data)
        finally:
            _discard(tmp)
        fsync_dir(os.path.dirname(path))
        return _digest(data)

    def _create_excl(self, path: str, data: bytes) -> str | None:
        try:
            _write_new(path, data)
        except FileExistsError:
            return None
        fsync_dir(os.path.dirname(path))
        return _digest(data)

    def replace_if(self, path: str, data: bytes, version: str) -> str | None:
        """Replace ``path`` with ``data`` if it is still at ``version``; the new version."""
        with self._breaker(path):
            cur = self.read_versioned(path)
            if cur is None or cur[1] != version:
                return None
            self.write_small(path, data)
            return _digest(data)

    def delete_if(self, path: str, version: str) -> bool:
        with self._breaker(path):
            cur = self.read_versioned(path)
            if cur is None or cur[1] != version:
                return False
            self.delete(path)
            return True

    @contextlib.contextmanager
    def _breaker(self, path: str) -> Iterator[None]:
        """Serialises compare-and-swap on ``path`` between processes (and hosts, on NFS) with
        a second file held for milliseconds; one older than BREAKER_STALE_S is left by a kill."""
        brk = path + ".break"
        deadline = time.monotonic() + 1.5 * BREAKER_STALE_S
        while self.create_exclusive(brk, b"") is None:
            if _age_s(brk) > BREAKER_STALE_S:
                _discard(brk)
            elif time.monotonic() > deadline:
                raise OSError(errno.EBUSY, f"{brk} stays held; remove it if no ckptstore runs")
            else:
                time.sleep(0.01)
        try:
            yield
        finally:
            _discard(brk)


class _PieceReader:
    """Reads pieces of one open file into destinations, verifying every checksum chunk."""

    def __init__(
        self,
        fd: int,
        dfd: int | None,
        entry: FileEntry,
        path: str,
        dests: Sequence[Dest],
        io: IOEngine,
    ) -> None:
        self.fd, self.dfd, self.entry, self.path = fd, dfd, entry, path
        self.dests, self.io = dests, io

    def jobs(self) -> list[tuple[int, int]]:
        piece, out = self.io.options.piece_bytes, []
        for c0, c1 in needed_chunks(self.dests, self.entry.size):
            start, stop = c0 * CRC_CHUNK, min(c1 * CRC_CHUNK, self.entry.size)
            out += [(off, min(piece, stop - off)) for off in range(start, stop, piece)]
        return out

    def fetch(self, job: tuple[int, int]) -> _Fetched:
        """Read one piece (in the reading thread): straight into the destination that holds
        all of it, else into a staging buffer."""
        off, n = job
        target = next((d for d in self.dests if d.offset <= off and off + n <= d.end), None)
        if target is not None:
            dst = target.buf[off - target.offset :]
            aligned = dst.numel() >= align_up(n) and dst.data_ptr() % ALIGN == 0
            if self.dfd is not None and aligned:
                mv = memview(dst[: align_up(n)])
                self._read(self.dfd, mv, off, n)
            else:
                mv = memview(dst[:n])
                self._read(self.fd, mv, off, n)
            return off, n, mv, None
        buf = self.io.staging.take()
        try:
            use, length = (self.fd, n) if self.dfd is None else (self.dfd, align_up(n))
            mv = memview(buf[:length])
            self._read(use, mv, off, n)
        except BaseException:
            self.io.staging.give(buf)
            raise
        return off, n, mv, buf

    def place(self, fetched: _Fetched) -> None:
        """Verify a fetched piece (on a worker) and copy a staged one where it belongs."""
        off, n, mv, buf = fetched
        try:
            check_chunks(crc_chunks(mv[:n], off), self.entry, self.path)
            if buf is not None:
                scatter(mv[:n], off, self.dests)
        finally:
            if buf is not None:
                self.io.staging.give(buf)

    def _read(self, fd: int, mv: memoryview, off: int, n: int) -> None:
        got = _pread_all(fd, mv, off)
        if got < n:
            raise CorruptCheckpointError(
                f"{self.path}: truncated while reading at byte {off + got}"
            )


_Fetched = tuple[int, int, memoryview, "torch.Tensor | None"]
