"""What a checkpoint is on disk (its manifest), and the small records the store hands back.

``manifest.json`` is the commit marker: it is written only after every payload file is durable,
it lists every file with its size and chunked CRC32s, and it carries its own checksum so a torn or
bit-flipped manifest reads as "no checkpoint" instead of as a wrong one.
"""

from __future__ import annotations

import builtins
import re
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from .errors import CorruptCheckpointError, IncompatibleCheckpointError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
CRC_CHUNK = 4 << 20  # checksum granularity: a reader verifies only the 4 MiB chunks it reads
STEP_DIR_RE = re.compile(r"step-(\d{8,})")
# Payload names are single path components we generate; anything else in a manifest is refused,
# so a crafted manifest cannot make a reader open files outside the checkpoint directory.
# ".metadata" is the one exception: the name torch.distributed.checkpoint's readers look for.
FILE_NAME_RE = re.compile(r"\.metadata|[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    m = STEP_DIR_RE.fullmatch(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class Checksum:
    """CRC32 of each ``chunk``-byte piece of a file (the last piece may be shorter)."""

    chunk: int
    values: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"chunk": self.chunk, "values": list(self.values)}


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One payload file of a checkpoint, relative to its step directory."""

    path: str
    size: int
    checksum: Checksum
    rank: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "rank": self.rank,
            "crc32": self.checksum.to_json(),
        }


@dataclass(frozen=True, slots=True)
class Manifest:
    """A committed checkpoint: what ``load()`` returns and what ``manifest.json`` holds."""

    step: int
    format: str
    time: float
    world_size: int
    files: tuple[FileEntry, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    format_data: dict[str, Any] = field(default_factory=dict)
    save_id: str = ""
    url: str = ""  # where it was read from; not stored in the file

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def body(self) -> dict[str, Any]:
        return {
            "ckptstore": SCHEMA_VERSION,
            "format": self.format,
            "step": self.step,
            "time": self.time,
            "world_size": self.world_size,
            "versions": self.versions,
            "files": [f.to_json() for f in self.files],
            "metadata": self.metadata,
            "format_data": self.format_data,
            "save_id": self.save_id,
        }

    def to_json(self) -> builtins.bytes:
        body = self.body()
        body["checksum"] = _body_checksum(body)
        return orjson.dumps(body, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)

    @classmethod
    def from_json(cls, data: builtins.bytes, *, url: str = "") -> Manifest:
        """Parse and check a manifest; CorruptCheckpointError names the problem."""
        where = url or "manifest"
        try:
            body = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise CorruptCheckpointError(f"{where}: manifest is not a JSON object")
        stored = body.pop("checksum", None)
        if stored != _body_checksum(body):
            raise CorruptCheckpointError(
                f"{where}: manifest checksum mismatch (torn or edited manifest.json)"
            )
        version = body.get("ckptstore")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            from ._version import __version__

            raise IncompatibleCheckpointError(
                f"{where} was written by a newer ckptstore (manifest schema {version!r}; this is "
                f"ckptstore {__version__}, schema {SCHEMA_VERSION}): upgrade ckptstore "
                "(pip install -U ckptstore)"
            )
        try:
            files = tuple(_file_from_json(f) for f in body["files"])
            return cls(
                step=_int(body["step"]),
                format=str(body["format"]),
                time=float(body["time"]),
                world_size=_int(body["world_size"]),
                files=files,
                metadata=dict(body.get("metadata") or {}),
                versions={str(k): str(v) for k, v in (body.get("versions") or {}).items()},
                format_data=dict(body.get("format_data") or {}),
                save_id=str(body.get("save_id", "")),
                url=url,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: malformed manifest ({e!r})") from None

    def file(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise CorruptCheckpointError(f"{self.url}: manifest lists no file {path!r}")


def _body_checksum(body: dict[str, Any]) -> str:
    return f"crc32:{zlib.crc32(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)):08x}"


def _int(x: object) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"expected an integer, got {x!r}")
    return x


def _file_from_json(d: dict[str, Any]) -> FileEntry:
    path = str(d["path"])
    if not FILE_NAME_RE.fullmatch(path) or path in (".", ".."):
        raise ValueError(f"file name {path!r} is not a plain file name")
    crc = d["crc32"]
    chunk = _int(crc["chunk"])
    size = _int(d["size"])
    values = tuple(_int(v) for v in crc["values"])
    if chunk <= 0 or size < 0 or len(values) != -(-size // chunk):
        raise ValueError(f"checksum of {path!r} does not cover its {size} bytes")
    return FileEntry(path=path, size=size, checksum=Checksum(chunk, values), rank=_int(d["rank"]))


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One committed checkpoint as ``list()`` reports it (from its manifest; not verified)."""

    step: int
    url: str
    format: str
    time: float
    bytes: int
    world_size: int
    metadata: dict[str, Any]


@dataclass(frozen=True, slots=True)
class FileReport:
    path: str
    ok: bool
    size: int
    problem: str = ""


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Result of re-reading every file of a checkpoint against its manifest."""

    step: int | None
    url: str
    ok: bool
    files: tuple[FileReport, ...] = ()
    problems: tuple[str, ...] = ()
    bytes_checked: int = 0
    verdict: str = ""  # "OK", "CORRUPT", or "NEEDS A NEWER CKPTSTORE" (default from ok)

    def __bool__(self) -> bool:
        return self.ok

    def summary(self) -> str:
        if self.ok:
            return f"OK {self.url}: {len(self.files)} files, {self.bytes_checked} bytes verified"
        return f"{self.verdict or 'CORRUPT'} {self.url}: " + "; ".join(self.problems)


@dataclass(frozen=True, slots=True)
class SaveStats:
    """One save that committed (``url`` is the checkpoint directory; a mirror copy reports its
    own). ``total_s`` runs from the ``save()`` call until the manifest is durable."""

    step: int
    bytes: int
    blocking_s: float
    total_s: float
    durable_at: float
    url: str
    format: str = ""
    target: str = "primary"  # or "mirror"
    background: bool = False  # persisted while the caller went on (an async save, a mirror copy)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class SaveTimings:
    """Measured durations of a store's committed saves (primary copies), oldest first: the
    facts a save schedule needs to decide whether a save may start now and end in time.
    ``total_s`` runs from the ``save()`` call until the commit is durable; ``blocking_s`` is
    how long ``save()`` held the caller. The tuples keep the most recent saves only."""

    total_s: tuple[float, ...] = ()
    blocking_s: tuple[float, ...] = ()
    count: int = 0  # every committed save, also those older than the tuples reach

    @property
    def last_s(self) -> float | None:
        return self.total_s[-1] if self.total_s else None

    @property
    def median_s(self) -> float | None:
        return _median(self.total_s)

    @property
    def max_s(self) -> float | None:
        return max(self.total_s) if self.total_s else None

    @property
    def blocking_median_s(self) -> float | None:
        return _median(self.blocking_s)

    def add(self, stats: SaveStats, window: int = 64) -> SaveTimings:
        return SaveTimings(
            total_s=(*self.total_s, stats.total_s)[-window:],
            blocking_s=(*self.blocking_s, stats.blocking_s)[-window:],
            count=self.count + 1,
        )


def _median(xs: tuple[float, ...]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
