"""ParquetSource: one or many parquet files (local or any fsspec URL) read as a stream of texts.

Reading goes row group by row group, in small record batches, so memory stays bounded by one batch
whatever the size of the dataset. Null rows are skipped and counted.
"""

from __future__ import annotations

import glob as _glob
import hashlib
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import EmptyDatasetError, MissingExtraError, SourceError

PathLike = str | os.PathLike[str]
_GLOB_CHARS = frozenset("*?[")
# Small record batches keep memory flat even when a writer made one huge row group.
READ_BATCH_ROWS = 8192
_FINGERPRINT_HEAD = 1 << 20


@dataclass(frozen=True, slots=True)
class Unit:
    """Rows ``[row_start, row_stop)`` of one row group of one file: a unit of parallel
    tokenization, numbered in dataset order."""

    index: int
    file_index: int
    row_group: int
    num_rows: int
    row_start: int = 0
    row_stop: int = -1  # -1: to the end of the row group


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _fsspec_fs(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    try:
        from fsspec.core import url_to_fs
    except ImportError as e:
        raise MissingExtraError(
            f"reading {url!r} needs fsspec: pip install 'parquetlm[fsspec]' (and s3fs/gcsfs for "
            "s3:// or gs:// URLs)"
        ) from e
    try:
        return url_to_fs(url, **storage_options)
    except (ImportError, ValueError) as e:
        raise MissingExtraError(
            f"cannot open {url!r}: {e}; install the fsspec backend for this protocol"
        ) from e


class ParquetSource:
    """Text from parquet files: a file, a directory (recursive), a glob, or a list of those.

    Local paths or fsspec URLs (``s3://bucket/data/*.parquet``; ``storage_options`` go to fsspec).
    Files are validated when the source is made: each must be parquet and hold ``column`` as a
    string column. Directories skip hidden entries (``.parquetlm-cache``, ``_SUCCESS``...).
    """

    __slots__ = (
        "_fingerprint",
        "_num_rows",
        "_storage_options",
        "_units",
        "column",
        "files",
        "null_rows",
    )

    def __init__(
        self,
        paths: PathLike | Sequence[PathLike],
        *,
        column: str = "text",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(column, str) or not column:
            raise SourceError("column must be a non-empty column name, e.g. column='text'")
        self.column = column
        self._storage_options = dict(storage_options or {})
        entries = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        if not entries:
            raise EmptyDatasetError("no paths given: pass a parquet file, a directory or a glob")
        self.files: list[str] = []
        for entry in entries:
            self.files.extend(self._expand(os.fspath(entry)))
        self._units: list[Unit] = []
        self._num_rows = 0
        for i, path in enumerate(self.files):
            self._inspect(i, path)
        if self._num_rows == 0:
            raise EmptyDatasetError(
                f"empty dataset: {len(self.files)} parquet file(s) hold 0 rows ({self.files[0]})"
            )
        self._fingerprint: str | None = None
        #: Null rows skipped by the last complete pass of iter_texts()/iter_arrays().
        self.null_rows = 0

    # -- finding files -------------------------------------------------------------------------

    def _expand(self, entry: str) -> list[str]:
        if _is_url(entry):
            return self._expand_url(entry)
        path = entry.removeprefix("file://")
        if os.path.exists(path) and not os.path.isdir(path):
            if not os.path.isfile(path):  # a FIFO or a device: reading it would block or never end
                raise SourceError(f"{path!r} is not a regular file: give a parquet file")
            return [path]  # as named, even with glob characters in its name (data[1].parquet)
        if any(c in path for c in _GLOB_CHARS) and not os.path.isdir(path):
            found = sorted(p for p in _glob.glob(path, recursive=True) if os.path.isfile(p))
            if not found:
                raise SourceError(f"no files match {entry!r}: check the pattern")
            return found
        if os.path.isdir(path):
            found = sorted(_walk_parquet(path))
            if not found:
                raise EmptyDatasetError(f"no *.parquet files under directory {path!r}")
            return found
        if not os.path.exists(path):
            raise SourceError(f"no such file: {path!r}: check the path")
        return [path]

    def _expand_url(self, url: str) -> list[str]:
        fs, path = _fsspec_fs(url, self._storage_options)
        if any(c in path for c in _GLOB_CHARS):
            found = sorted(p for p in fs.glob(path) if fs.isfile(p))
            if not found:
                raise SourceError(f"no files match {url!r}: check the pattern")
        elif fs.isdir(path):
            found = sorted(
                p
                for p in fs.find(path)
                if p.endswith(".parquet") and not _hidden(os.path.relpath(p, path))
            )
            if not found:
                raise EmptyDatasetError(f"no *.parquet files under {url!r}")
        elif fs.exists(path):
            found = [path]
        else:
            raise SourceError(f"no such file: {url!r}: check the URL")
        return [fs.unstrip_protocol(p) for p in found]

    # -- validating ----------------------------------------------------------------------------

    def _inspect(self, file_index: int, path: str) -> None:
        with self._open(path) as f:
            try:
                meta = pq.ParquetFile(f).metadata
            except (pa.ArrowInvalid, OSError) as e:
                raise SourceError(f"{path} is not a parquet file ({e})") from e
            schema = meta.schema.to_arrow_schema()
        if self.column not in schema.names:
            raise SourceError(
                f"{path} has no column {self.column!r}; its columns are: "
                f"{', '.join(schema.names) or '(none)'}: pick one with column=/--column"
            )
        kind = schema.field(self.column).type
        if not _is_string(kind):
            strings = [f.name for f in schema if _is_string(f.type)]
            hint = f"string columns here: {', '.join(strings)}" if strings else "it has none"
            raise SourceError(
                f"column {self.column!r} in {path} has type {kind}, not string: "
                f"pick a text column with column=/--column ({hint})"
            )
        for rg in range(meta.num_row_groups):
            rows = meta.row_group(rg).num_rows
            if rows:
                self._units.append(Unit(len(self._units), file_index, rg, rows))
        self._num_rows += meta.num_rows

    def _open(self, path: str) -> IO[bytes]:
        if _is_url(path):
            fs, p = _fsspec_fs(path, self._storage_options)
            return fs.open(p, "rb")
        try:
            return open(path.removeprefix("file://"), "rb")
        except FileNotFoundError as e:
            raise SourceError(f"no such file: {path!r} (was it deleted?)") from e
        except IsADirectoryError as e:
            raise SourceError(f"{path} is a directory, not a parquet file") from e

    # -- reading -------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        """Rows in all files, null rows included (from the parquet footers; nothing is read)."""
        return self._num_rows

    @property
    def units(self) -> list[Unit]:
        """Row groups in dataset order: the work items of a parallel tokenization."""
        return list(self._units)

    def read_unit(self, unit: Unit) -> Iterator[tuple[pa.Array, int]]:
        """Non-null texts of a unit as Arrow string arrays, each with its null count."""
        path = self.files[unit.file_index]
        try:
            yield from self._read(path, unit)
        except (pa.ArrowException, OSError) as e:
            raise SourceError(
                f"cannot read {path} ({' '.join(str(e).split())}): was it changed or damaged "
                "since the source was made?"
            ) from e

    def _read(self, path: str, unit: Unit) -> Iterator[tuple[pa.Array, int]]:
        stop = unit.num_rows if unit.row_stop < 0 else unit.row_stop
        seen = 0
        with self._open(path) as f:
            pf = pq.ParquetFile(f)
            for batch in pf.iter_batches(
                batch_size=READ_BATCH_ROWS, row_groups=[unit.row_group], columns=[self.column]
            ):
                first, seen = seen, seen + batch.num_rows
                if seen <= unit.row_start:
                    continue
                lo = max(unit.row_start - first, 0)
                arr = batch.column(0).slice(lo, min(stop, seen) - first - lo)
                if pa.types.is_dictionary(arr.type):  # pandas "category", Arrow dictionary
                    arr = arr.dictionary_decode()
                nulls = arr.null_count
                yield (arr.drop_null() if nulls else arr), nulls
                if seen >= stop:
                    break

    def iter_arrays(self) -> Iterator[pa.Array]:
        """All non-null texts as Arrow string arrays (bounded memory); counts ``null_rows``."""
        nulls = 0
        for unit in self._units:
            for arr, n in self.read_unit(unit):
                nulls += n
                yield arr
        self.null_rows = nulls

    def iter_texts(self) -> Iterator[str]:
        """All non-null texts, in order, one row group batch at a time (bounded memory)."""
        for arr in self.iter_arrays():
            yield from arr.to_pylist()

    # -- identity ------------------------------------------------------------------------------

    def fingerprint(self, *, full: bool = False) -> str:
        """A key for the dataset's content (not its paths: moving the files keeps it).

        Quick by default: per file, its size, its parquet footer (row counts, every column
        chunk's sizes and statistics) and its first MiB; plus the column name. ``full=True``
        hashes every byte instead (slow on big data, certain).
        """
        if self._fingerprint is not None and not full:
            return self._fingerprint
        h = hashlib.sha256(f"parquetlm-source-v1\0{self.column}\0{len(self.files)}\0".encode())
        for path in self.files:
            with self._open(path) as f:
                _hash_file(h, f, full=full)
        digest = h.hexdigest()
        if not full:
            self._fingerprint = digest
        return digest

    def describe(self) -> str:
        first = self.files[0]
        more = f" (+{len(self.files) - 1} more)" if len(self.files) > 1 else ""
        return f"{first}{more} column {self.column!r}"

    def __repr__(self) -> str:
        return f"ParquetSource({self.describe()}, rows={self._num_rows})"

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)


def _hash_file(h: Any, f: IO[bytes], *, full: bool) -> None:
    size = f.seek(0, os.SEEK_END)
    h.update(struct.pack("<Q", size))
    f.seek(0)
    if full:
        while chunk := f.read(1 << 22):
            h.update(chunk)
        return
    h.update(f.read(_FINGERPRINT_HEAD))
    if size >= 12:
        f.seek(size - 8)
        footer_len = struct.unpack("<I", f.read(4))[0]
        start = max(0, size - 8 - footer_len)
        f.seek(start)
        h.update(f.read(size - start))


def _is_string(t: pa.DataType) -> bool:
    """Text: string, large_string, string_view, or a dictionary of them (what pandas writes for
    a ``category`` column; read back decoded)."""
    if pa.types.is_dictionary(t):
        return _is_string(t.value_type)
    checks = [pa.types.is_string, pa.types.is_large_string]
    if hasattr(pa.types, "is_string_view"):
        checks.append(pa.types.is_string_view)
    return any(check(t) for check in checks)


def _hidden(rel: str) -> bool:
    return any(part.startswith((".", "_")) for part in rel.split(os.sep))


def _walk_parquet(root: str) -> Iterator[str]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "_"))]
        for name in filenames:
            if name.endswith(".parquet") and not name.startswith((".", "_")):
                yield os.path.join(dirpath, name)
