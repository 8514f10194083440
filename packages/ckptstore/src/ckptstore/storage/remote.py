"""Any fsspec filesystem (object stores and the rest): the generic backend. Backends with fast
paths of their own (``s3.py``) subclass it and override the methods they do better."""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..buffers import memview
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    StoreConfigError,
    StoreUnreachableError,
    config_error,
    disk_error,
    unreachable,
    unreachable_error,
)
from ..limits import CallLimits, run_async
from ..manifest import CRC_CHUNK, Checksum, FileEntry
from ..smallfile import MAX_SMALL_BYTES, UnreadableFileError
from .engine import IOEngine
from .payload import (
    Dest,
    Payload,
    check_chunks,
    crc_chunks,
    n_chunks,
    needed_chunks,
    pieces,
    scatter,
)

if TYPE_CHECKING:
    from . import Storage

F = TypeVar("F", bound=Callable[..., Any])


def _translated(fn: F) -> F:
    """Storage failures surface as OSError (what every caller handles), never as a client
    library's own exception type with a traceback; a store that does not answer (or answers
    "not now"), as StoreUnreachableError (an OSError too); an answer that means a wrong
    setting, as StoreConfigError. The backend classifies (:meth:`FsspecStorage.classify`)."""

    @functools.wraps(fn)
    def wrapper(self: FsspecStorage, path: str, *args: Any, **kw: Any) -> Any:
        try:
            return fn(self, path, *args, **kw)
        except (StoreUnreachableError, StoreConfigError):
            raise  # said already, by a call inside this one
        except self.storage_errors() as e:
            if (said := self.classified(e, self.url(path))) is not None:
                raise said from e
            if isinstance(e, OSError):
                raise
            raise OSError(errno.EIO, f"{self.url(path)}: {type(e).__name__}: {e}") from e

    return wrapper  # type: ignore[return-value]


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


@functools.cache
def _lookup(names: tuple[tuple[str, str], ...]) -> tuple[type[BaseException], ...]:
    out = []
    for module, name in names:
        with contextlib.suppress(ImportError, AttributeError):
            out.append(getattr(importlib.import_module(module), name))
    return tuple(out)


class FsspecStorage:
    """Any fsspec filesystem. On object stores a PUT is atomic, so the manifest's presence is
    the commit; there are no directories to fsync."""

    # What this backend's client library raises, declared here (by module and class name: no
    # import of a library the store may not use) and classified once (:meth:`classify`). The
    # generic backend: fsspec's async filesystems talk through aiohttp.
    client_errors: ClassVar[tuple[tuple[str, str], ...]] = (("aiohttp", "ClientError"),)
    unreachable_types: ClassVar[frozenset[str]] = frozenset(
        {"ClientConnectionError", "ServerTimeoutError"}  # refused, reset, disconnected, timed out
    )
    permanent_types: ClassVar[frozenset[str]] = frozenset()
    small_limit: ClassVar[int] = MAX_SMALL_BYTES  # a manifest, the lock, ``latest``: bytes

    def __init__(self, fs: Any, root: str) -> None:
        self.fs, self.root = fs, root
        self.is_object_store = not getattr(fs, "local_file", False)
        self.limits = CallLimits()  # the store's owner sets its own (CheckpointStore.set_limits)

    # -- what the store answered -----------------------------------------------------------
    def storage_errors(self) -> tuple[type[BaseException], ...]:
        """What a call of this backend raises when the storage fails."""
        return (OSError, *_lookup(self.client_errors))

    def classify(self, e: BaseException) -> tuple[str, float | None, str] | None:
        """``("down", retry_after, answered)`` for an outage (retried later), ``("config",
        None, fix)`` for an answer that means a wrong setting (never retried), None for
        neither. Backends with answers of their own (S3's status codes) extend it."""
        for x in _chain(e):
            names = {c.__name__ for c in type(x).__mro__}
            if names & self.permanent_types:
                return ("config", None, "check the storage options and credentials")
            if names & self.unreachable_types:
                return ("down", None, "")
        return ("down", None, "") if unreachable(e) else None

    def classified(self, e: BaseException, what: str) -> CheckpointError | None:
        """``e`` as StoreUnreachableError or StoreConfigError, or None (an I/O error)."""
        verdict = self.classify(e)
        if verdict is None:
            return None
        kind, retry_after, said = verdict
        if kind == "config":
            return config_error(e, what, said)
        return unreachable_error(e, what, retry_after=retry_after, answered=said)

    def run(self, coro: Any, what: str) -> Any:
        """One call of an async filesystem, within :attr:`limits` (given up past them)."""
        return run_async(self.fs.loop, coro, self.limits, what)

    def _fs(self, method: str, path: str, *args: Any, **kw: Any) -> Any:
        """``fs.method(path, ...)``; an async filesystem's within the limits."""
        if getattr(self.fs, "async_impl", False):
            return self.run(getattr(self.fs, "_" + method)(path, *args, **kw), self.url(path))
        return getattr(self.fs, method)(path, *args, **kw)

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any]) -> Storage:
        """fsspec's filesystem for ``url``; a local one gets the local fast path instead."""
        import fsspec

        from .local import LocalStorage

        fs, path = fsspec.core.url_to_fs(url, **storage_options)
        if type(fs).__name__ == "LocalFileSystem":
            return LocalStorage(os.path.abspath(path))
        return cls(fs, path.rstrip("/"))

    def join(self, *parts: str) -> str:
        return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))

    def url(self, path: str) -> str:
        return str(self.fs.unstrip_protocol(path))

    def local_path(self, path: str) -> str | None:
        return None

    @_translated
    def makedirs(self, path: str) -> None:
        with contextlib.suppress(FileExistsError):
            self.fs.makedirs(path, exist_ok=True)

    @_translated
    def list_dir(self, path: str) -> list[str]:
        self.fs.invalidate_cache(path)
        try:
            names = self._fs("ls", path, detail=False)
        except (FileNotFoundError, NotADirectoryError) as e:
            if self.classify(e) is not None:  # a deleted bucket is not an empty folder
                raise
            return []
        base = path.rstrip("/")
        return sorted({n.rstrip("/").rsplit("/", 1)[-1] for n in names if n.rstrip("/") != base})

    @_translated
    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return bool(self._fs("exists", path))

    @_translated
    def read_small(self, path: str) -> bytes:
        # Another process wrote it: its size asked first, so an object of gigabytes at a
        # manifest's, the lock's or ``latest``'s key is refused, never downloaded.
        self.fs.invalidate_cache(path)
        size = self._fs("size", path)
        if size is not None and int(size) > self.small_limit:
            raise UnreadableFileError(
                f"{self.url(path)}: {int(size)} bytes, more than the {self.small_limit} "
                "ckptstore ever writes there: not its file (remove or replace it)"
            )
        return bytes(self._fs("cat_file", path))

    @_translated
    def write_small(self, path: str, data: bytes) -> None:
        try:
            self._fs("pipe_file", path, data)
        except (StoreUnreachableError, StoreConfigError):
            raise
        except OSError as e:
            raise self.classified(e, self.url(path)) or disk_error(e, self.url(path)) from e
        self.fs.invalidate_cache(path)

    # -- writes ----------------------------------------------------------------------------
    def write_payload(
        self, path: str, payload: Payload, io: IOEngine, *, background: bool = False
    ) -> FileEntry:
        try:
            crcs = self._write(path, payload, io, background)
        except (StoreUnreachableError, StoreConfigError):
            raise
        except OSError as e:
            raise self.classified(e, self.url(path)) or disk_error(e, self.url(path)) from e
        self.fs.invalidate_cache(path)
        name = path.rstrip("/").rsplit("/", 1)[-1]
        return FileEntry(name, payload.size, Checksum(CRC_CHUNK, tuple(crcs)))

    @_translated
    def _write(self, path: str, payload: Payload, io: IOEngine, background: bool) -> list[int]:
        return self._sequential_write(path, payload, io)

    @staticmethod
    def _piece_bytes(
        payload: Payload, off: int, n: int, io: IOEngine
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
        crcs = [0] * n_chunks(payload.size)
        with self.fs.open(path, "wb") as f:
            for off, n in pieces(payload.size, io.options.piece_bytes):
                data, got = self._piece_bytes(payload, off, n, io)
                for c, crc in got:
                    crcs[c] = crc
                f.write(data)
        return crcs

    # -- reads -----------------------------------------------------------------------------
    def _stream(self, path: str, start: int, stop: int, piece: int) -> Iterator[bytes]:
        """Bytes [start, stop) of a file, in order, with as few requests as possible."""
        if stop <= start:
            return
        with self.fs.open(path, "rb", block_size=piece, cache_type="none") as f:
            f.seek(start)
            pos = start
            while pos < stop and (data := f.read(min(piece, stop - pos))):
                pos += len(data)
                yield data

    def _check_size(self, path: str, entry: FileEntry) -> None:
        self.fs.invalidate_cache(path)
        try:
            actual = int(self._fs("size", path))
        except FileNotFoundError as e:
            if self.classify(e) is not None:
                raise
            raise CorruptCheckpointError(
                f"{self.url(path)}: missing file listed in the manifest"
            ) from None
        if actual != entry.size:
            what = "truncated" if actual < entry.size else "longer than recorded"
            raise CorruptCheckpointError(
                f"{self.url(path)}: {what}: {actual} bytes stored, manifest says {entry.size}"
            )

    def _verified_runs(
        self, path: str, entry: FileEntry, runs: Sequence[tuple[int, int]], io: IOEngine
    ) -> Iterator[tuple[int, memoryview]]:
        """(offset, bytes) of each checksum chunk in ``runs``, verified, in file order."""
        for c0, c1 in runs:
            start, stop = c0 * CRC_CHUNK, min(c1 * CRC_CHUNK, entry.size)
            chunks = _Chunker(start, stop, entry, self.url(path))
            for data in self._stream(path, start, stop, io.options.piece_bytes):
                yield from chunks.feed(data)
            chunks.finish()

    @_translated
    def read_into(self, path: str, entry: FileEntry, dests: Sequence[Dest], io: IOEngine) -> None:
        self._check_size(path, entry)
        for off, data in self._verified_runs(path, entry, needed_chunks(dests, entry.size), io):
            scatter(data, off, dests)

    def verify(self, path: str, entry: FileEntry, io: IOEngine) -> str | None:
        try:
            self._read_all(path, entry, io)
        except CorruptCheckpointError as e:
            return str(e)
        except OSError as e:
            return f"{self.url(path)}: cannot read ({e})"
        return None

    @_translated
    def _read_all(self, path: str, entry: FileEntry, io: IOEngine) -> None:
        self._check_size(path, entry)
        runs = [(0, n_chunks(entry.size))] if entry.size else []
        for _ in self._verified_runs(path, entry, runs, io):
            pass

    @_translated
    def delete(self, path: str) -> None:
        try:
            self._fs("rm_file", path)
        except FileNotFoundError as e:
            if self.classify(e) is not None:
                raise
        self.fs.invalidate_cache(path)

    @_translated
    def rmdir(self, path: str) -> None:
        if self.list_dir(path):
            return  # foreign files stay, and so does their directory
        with contextlib.suppress(OSError, ValueError):
            self.fs.rmdir(path)
        self.fs.invalidate_cache(path)

    # -- atomic primitives (the writer lock) -------------------------------------------------
    # Best effort: check, write, read back; a race inside that window is possible. Backends
    # with conditional requests override these (S3: If-None-Match / If-Match).
    @_translated
    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        try:
            data = self.read_small(path)
        except FileNotFoundError:
            return None
        return data, f"{zlib.crc32(data):08x}-{len(data)}"

    @_translated
    def create_exclusive(self, path: str, data: bytes) -> str | None:
        if self.exists(path):
            return None
        self.write_small(path, data)
        got = self.read_versioned(path)
        return got[1] if got is not None and got[0] == data else None

    @_translated
    def replace_if(self, path: str, data: bytes, version: str) -> str | None:
        cur = self.read_versioned(path)
        if cur is None or cur[1] != version:
            return None
        self.write_small(path, data)
        return f"{zlib.crc32(data):08x}-{len(data)}"

    @_translated
    def delete_if(self, path: str, version: str) -> bool:
        cur = self.read_versioned(path)
        if cur is None or cur[1] != version:
            return False
        self.delete(path)
        return True


class _Chunker:
    """Regroups streamed bytes into whole checksum chunks and verifies each one."""

    def __init__(self, start: int, stop: int, entry: FileEntry, url: str) -> None:
        self.pos, self.stop, self.entry, self.url = start, stop, entry, url
        self.chunk = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[int, memoryview]]:
        mv = memoryview(data)
        while len(mv):
            size = min(CRC_CHUNK, self.stop - self.pos)
            want = size - len(self.chunk)
            self.chunk += mv[:want]
            mv = mv[want:]
            if len(self.chunk) == size:
                check_chunks(
                    [(self.pos // CRC_CHUNK, zlib.crc32(self.chunk))], self.entry, self.url
                )
                yield self.pos, memoryview(self.chunk)
                self.pos += size
                self.chunk = bytearray()

    def finish(self) -> None:
        if self.pos != self.stop:
            raise CorruptCheckpointError(f"{self.url}: truncated while reading at byte {self.pos}")
