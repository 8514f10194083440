"""Where bytes go: local disks (fast path), S3 (its own fast paths) and any fsspec URL.

Writes checksum while writing (never re-read), in large pieces on several threads; local writes
go temp -> fsync -> rename -> directory fsync and use O_DIRECT where the filesystem allows it
(the page cache would cost a copy and the fsync a second pass). Reads verify every 4 MiB chunk
they touch against the manifest, so a rank verifies exactly what it reads, in constant memory.
On S3 a file is read with one streaming GET (ranged GETs are slow on many servers) and written
with a parallel multipart upload.

``Storage`` is the seam: the store takes one (or a URL, opened with ``open_storage``), so a
wrapper can add behaviour (tests pause a save at a chosen point of the commit protocol this way).
Which class serves a URL is the registry's (``registry.py``: protocol -> class, lazy import,
install hint, the ``ckptstore.storage`` entry points).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import orjson
import torch

from ..manifest import FileEntry
from .engine import DaemonPool, InlineIO, IOEngine, IOOptions
from .local import LocalStorage, fsync_dir
from .payload import (
    BufferPayload,
    Dest,
    Payload,
    SegmentPayload,
    check_chunks,
    crc_chunks,
    needed_chunks,
    scatter,
)
from .registry import (
    StorageBackend,
    available_storages,
    get_storage,
    open_storage,
    register_storage,
)
from .remote import FsspecStorage

__all__ = [
    "BufferPayload",
    "DaemonPool",
    "Dest",
    "FilePayload",
    "FsspecStorage",
    "IOEngine",
    "IOOptions",
    "InlineIO",
    "LocalStorage",
    "Payload",
    "SegmentPayload",
    "Storage",
    "StorageBackend",
    "available_storages",
    "check_chunks",
    "crc_chunks",
    "fsync_dir",
    "get_storage",
    "needed_chunks",
    "open_storage",
    "parse_storage_options",
    "register_storage",
    "scatter",
]


class Storage(Protocol):
    """One filesystem. Paths are plain strings as that filesystem spells them."""

    root: str
    is_object_store: bool

    def join(self, *parts: str) -> str: ...
    def url(self, path: str) -> str: ...
    def local_path(self, path: str) -> str | None:
        """The local filesystem path of ``path``, or None when it is not on a local disk."""
        ...

    def makedirs(self, path: str) -> None: ...
    def list_dir(self, path: str) -> list[str]: ...
    def exists(self, path: str) -> bool: ...
    def read_small(self, path: str) -> bytes: ...
    def write_small(self, path: str, data: bytes) -> None:
        """Replace ``path`` atomically: readers see the old or the new bytes, never a mix."""
        ...

    def write_payload(
        self, path: str, payload: Payload, io: IOEngine, *, background: bool = False
    ) -> FileEntry: ...
    def read_into(
        self, path: str, entry: FileEntry, dests: Sequence[Dest], io: IOEngine
    ) -> None: ...
    def verify(self, path: str, entry: FileEntry, io: IOEngine) -> str | None: ...
    def delete(self, path: str) -> None: ...
    def rmdir(self, path: str) -> None: ...

    # Atomic primitives for the one-writer lock. A version is an opaque string (content
    # digest, ETag) naming what was read; the conditional calls fail (None / False) when the
    # file changed since.
    def read_versioned(self, path: str) -> tuple[bytes, str] | None: ...
    def create_exclusive(self, path: str, data: bytes) -> str | None: ...
    def replace_if(self, path: str, data: bytes, version: str) -> str | None: ...
    def delete_if(self, path: str, version: str) -> bool: ...


def parse_storage_options(text: str) -> dict[str, Any]:
    """fsspec options from a JSON object (what a command line's ``--storage-options`` takes);
    ValueError with one line otherwise."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError('must be a JSON object, e.g. \'{"endpoint_url": "http://host:9000"}\'')
    return value


class FilePayload:
    """A committed file read back chunk by chunk (verified) to be written elsewhere: how the
    mirror copies a checkpoint without holding it in memory."""

    def __init__(self, storage: Storage, path: str, entry: FileEntry) -> None:
        self.storage, self.path, self.entry, self.size = storage, path, entry, entry.size
        self._io = InlineIO(IOEngine(IOOptions(threads=1)))

    def fill(self, offset: int, out: torch.Tensor) -> None:
        # Inline: this runs inside the writer's pool already.
        self.storage.read_into(self.path, self.entry, [Dest(offset, out)], self._io)

    def view(self, offset: int, length: int) -> torch.Tensor | None:
        return None
