"""The S3 backend (s3fs): parallel multipart uploads, one streaming GET per read, conditional
writes for the writer lock, no bucket created behind the user's back, and no asyncio noise when
the endpoint dies. :class:`S3Storage` is registered for ``s3://`` and ``s3a://``; s3fs is
imported by fsspec when a URL is opened (the registry's hint: ``pip install 'ckptstore[s3]'``)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import queue
import random
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import Storage

from ..buffers import align_up
from ..errors import StoreConfigError
from ..manifest import CRC_CHUNK
from .engine import IOEngine
from .payload import MiB, Payload, n_chunks, pieces
from .remote import FsspecStorage, _chain, _translated

log = logging.getLogger("ckptstore")
PieceBytes = Callable[[Payload, int, int, IOEngine], tuple[bytes, list[tuple[int, int]]]]


class S3Storage(FsspecStorage):
    """An S3 bucket (AWS, MinIO, moto, ...): what the generic fsspec backend does, faster and
    with S3's guarantees where S3 has them."""

    # botocore's and aiohttp's errors, classified here once (FsspecStorage.classify).
    client_errors = (
        ("botocore.exceptions", "BotoCoreError"),
        ("botocore.exceptions", "ClientError"),
        ("aiohttp", "ClientError"),
    )
    unreachable_types = frozenset(
        {
            "EndpointConnectionError",  # botocore: refused, no route, connect timed out
            "ConnectTimeoutError",
            "ReadTimeoutError",
            "ConnectionClosedError",
            "ClientConnectionError",  # aiohttp: refused, reset, server disconnected
            "ServerTimeoutError",
        }
    )
    permanent_types = frozenset(
        {"NoCredentialsError", "PartialCredentialsError", "InvalidEndpointConfigurationError"}
    )

    def __init__(self, fs: Any, root: str) -> None:
        super().__init__(fs, root)
        self._bucket_checked = False
        if getattr(fs, "retries", 0) > S3FS_TRIES:  # each of s3fs's tries is botocore's 2
            fs.retries = S3FS_TRIES
        quiet_dead_connections(fs)
        own_retry_jitter()

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any]) -> Storage:
        """As fsspec opens it, with socket timeouts and retries of its own unless the options
        set them: a stalled connection is dropped and a new one made (the caller's limits
        bound the whole call: ``CallLimits``)."""
        options = dict(storage_options)
        config = dict(options.get("config_kwargs") or {})
        for key, value in CLIENT_DEFAULTS.items():
            config.setdefault(key, value)
        options["config_kwargs"] = config
        return super().from_url(url, options)

    def classify(self, e: BaseException) -> tuple[str, float | None, str] | None:
        """What S3 answered: 5xx and throttling are an outage (with its Retry-After), 403 and
        NoSuchBucket a wrong setting; else as any backend."""
        for x in _chain(e):
            response = getattr(x, "response", None)
            if isinstance(response, dict) and "Error" in response:
                return answer_kind(response, self.root)
        return super().classify(e)

    @_translated
    def makedirs(self, path: str) -> None:
        self._require_bucket(path)  # no directories on S3; and s3fs would create a missing bucket

    def _require_bucket(self, path: str) -> None:
        if not self._bucket_checked:
            require_bucket(self, path)
            self._bucket_checked = True

    @_translated
    def _write(self, path: str, payload: Payload, io: IOEngine, background: bool) -> list[int]:
        if payload.size > io.options.s3_part_bytes:
            return upload(self, path, payload, io, background, self._piece_bytes)
        return self._one_put(path, payload, io)

    def _one_put(self, path: str, payload: Payload, io: IOEngine) -> list[int]:
        """A payload of at most one part: one PUT, within the limits."""
        crcs = [0] * n_chunks(payload.size)
        data = bytearray()
        for off, n in pieces(payload.size, io.options.piece_bytes):
            piece, got = self._piece_bytes(payload, off, n, io)
            for c, crc in got:
                crcs[c] = crc
            data += piece
        self._fs("pipe_file", path, bytes(data))
        return crcs

    def _stream(self, path: str, start: int, stop: int, piece: int) -> Iterator[bytes]:
        if stop > start:
            yield from stream(self, path, start, stop)

    # Conditional requests (If-None-Match / If-Match): atomic on AWS, MinIO and moto.
    @_translated
    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        return get_versioned(self, path)

    @_translated
    def create_exclusive(self, path: str, data: bytes) -> str | None:
        self._require_bucket(path)
        return put_if(self, path, data, IfNoneMatch="*")

    @_translated
    def replace_if(self, path: str, data: bytes, version: str) -> str | None:
        return put_if(self, path, data, IfMatch=version)

    @_translated
    def delete_if(self, path: str, version: str) -> bool:
        return delete_if(self, path, version)


def call(s: S3Storage, method: str, **kw: Any) -> Any:
    """One S3 API call on the filesystem's event loop (errors translated by s3fs), within
    the storage's limits."""
    where = f"s3://{kw.get('Bucket', '')}/{kw.get('Key', '')}"
    return s.run(s.fs._call_s3(method, **kw), where)


# -- what S3 answered -----------------------------------------------------------------------
# botocore's own retries stay few and short (an outage is the Outage's to wait out, with the
# store's Retry-After), and a silent socket is dropped.
CLIENT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 60,
    "retries": {"max_attempts": 2, "mode": "standard"},
}
S3FS_TRIES = 1  # botocore retries once; longer outages are the Outage's to wait out
OUTAGE_STATUS = frozenset({500, 502, 503, 504, 429})
OUTAGE_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "BadGateway",
    }
)
_FIXES = {
    "NoSuchBucket": "the bucket does not exist (deleted, or a typo in the URL): create it or "
    "fix the URL",
    "InvalidAccessKeyId": "the access key is not known to this endpoint: fix the credentials",
    "SignatureDoesNotMatch": "the secret key does not match the access key: fix the credentials",
    "ExpiredToken": "the session token expired: renew the credentials",
    "InvalidToken": "the session token is not valid: renew the credentials",
}
_DENIED = "access denied: fix the credentials or the bucket's policy"


def answer_kind(response: dict[str, Any], root: str) -> tuple[str, float | None, str] | None:
    """An S3 error response as ``(kind, retry_after, words)`` (see FsspecStorage.classify)."""
    error = response.get("Error") or {}
    code = str(error.get("Code", ""))
    meta = response.get("ResponseMetadata") or {}
    status = meta.get("HTTPStatusCode")
    if code in _FIXES:
        return ("config", None, _FIXES[code])
    if status == 403 or code in ("AccessDenied", "403", "AllAccessDisabled"):
        return ("config", None, _DENIED)
    if status in OUTAGE_STATUS or code in OUTAGE_CODES:
        headers = meta.get("HTTPHeaders") or {}
        said = f"HTTP {status}" + (f" {code}" if code and code != str(status) else "")
        return ("down", _seconds(headers.get("retry-after")), said)
    return None


def _seconds(text: Any) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None  # an HTTP date, or nothing: our own pause stands
    return value if 0 <= value <= 3600 else None


# -- buckets --------------------------------------------------------------------------------
def require_bucket(s: S3Storage, path: str) -> None:
    """Refuse (one line, with the fix) to write into a bucket that does not exist: s3fs would
    create it silently, with the endpoint's default settings."""
    bucket = s.fs.split_path(path)[0]
    try:
        call(s, "head_bucket", Bucket=bucket)
    except FileNotFoundError:
        raise StoreConfigError(
            f"bucket s3://{bucket} does not exist: create it first (e.g. `aws s3 mb "
            f"s3://{bucket}`, or s3fs.S3FileSystem(...).mkdir({bucket!r})); ckptstore never "
            "creates buckets"
        ) from None
    except PermissionError:
        pass  # no HEAD permission: the writes themselves will tell


# -- conditional requests (the writer lock) -------------------------------------------------
def _precondition_failed(e: OSError) -> bool:
    cause = getattr(e.__cause__, "response", None) or {}
    code = cause.get("Error", {}).get("Code", "")
    return isinstance(e, FileExistsError) or code in ("PreconditionFailed", "412", "409")


def get_versioned(s: S3Storage, path: str) -> tuple[bytes, str] | None:
    bucket, key, _ = s.fs.split_path(path)
    try:
        resp = call(s, "get_object", Bucket=bucket, Key=key)
    except FileNotFoundError as e:
        if s.classify(e) is not None:  # no such bucket: not "no lock"
            raise
        return None
    body = resp["Body"]
    try:
        data = s.run(body.read(), s.url(path))
    finally:
        body.close()
    return bytes(data), str(resp["ETag"])


def put_if(s: S3Storage, path: str, data: bytes, **condition: str) -> str | None:
    """PUT with ``IfNoneMatch="*"`` or ``IfMatch=etag``: the new ETag, or None when the
    condition failed (someone else created or changed the object first)."""
    bucket, key, _ = s.fs.split_path(path)
    try:
        resp = call(s, "put_object", Bucket=bucket, Key=key, Body=data, **condition)
    except FileNotFoundError as e:
        if "IfMatch" in condition and s.classify(e) is None:
            return None  # gone since we read it
        raise
    except OSError as e:
        if _precondition_failed(e):
            return None
        raise
    s.fs.invalidate_cache(path)
    return str(resp["ETag"])


def delete_if(s: S3Storage, path: str, etag: str) -> bool:
    bucket, key, _ = s.fs.split_path(path)
    try:
        call(s, "delete_object", Bucket=bucket, Key=key, IfMatch=etag)
    except FileNotFoundError as e:
        if s.classify(e) is not None:
            raise
        return False
    except OSError as e:
        if _precondition_failed(e):
            return False
        raise
    s.fs.invalidate_cache(path)
    return True


# -- the caller's random stream -------------------------------------------------------------
_JITTER = random.Random()


def own_retry_jitter() -> None:
    """botocore draws the jitter of its retry pauses from Python's global ``random``: each
    retry (a store that stalls or is down) would move the training's random stream, which a
    checkpoint holds and a resume restores, so a run that went on through an outage would no
    longer be bitwise one that never met it. Its two retry modes draw from a generator of
    their own instead (module attributes, set once; jitter is jitter whatever draws it)."""
    try:
        legacy: Any = importlib.import_module("botocore.retryhandler")
        standard: Any = importlib.import_module("botocore.retries.standard")
    except ImportError:  # pragma: no cover - s3fs depends on botocore
        return
    legacy.random = _JITTER  # what its delay_exponential calls random.random() on
    init = standard.ExponentialBackoff.__init__
    defaults = list(init.__defaults__ or ())
    names = init.__code__.co_varnames[1 : 1 + init.__code__.co_argcount]
    if "random" in names[-len(defaults) :]:  # ExponentialBackoff(random=random.random)
        defaults[names[-len(defaults) :].index("random")] = _JITTER.random
        init.__defaults__ = tuple(defaults)


# -- asyncio noise --------------------------------------------------------------------------
def quiet_dead_connections(fs: Any) -> None:
    """aiohttp starts tasks of its own per request; when the endpoint dies mid-upload their
    connection errors are never retrieved, and asyncio prints each with a traceback (~20 lines
    before our one-line error). Those go to the debug log; everything else is reported as
    before. Installed once on fsspec's event loop."""
    loop = fs.loop
    previous = loop.get_exception_handler()
    if getattr(previous, "ckptstore", False):
        return

    def handler(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if _is_dead_connection(context):
            log.debug("ckptstore: %s: %r", context.get("message"), context.get("exception"))
        elif previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    handler.ckptstore = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)


def _is_dead_connection(context: dict[str, Any]) -> bool:
    exc = context.get("exception")
    if "never retrieved" not in str(context.get("message", "")):
        return False
    try:
        from aiohttp import ClientError
    except ImportError:  # pragma: no cover - s3fs depends on aiohttp
        return isinstance(exc, ConnectionError)
    return isinstance(exc, (ConnectionError, ClientError, asyncio.TimeoutError))


# -- multipart upload -----------------------------------------------------------------------
def upload(
    s: S3Storage, path: str, payload: Payload, io: IOEngine, background: bool, piece: PieceBytes
) -> list[int]:
    """Parallel multipart upload of ``payload``; the CRC32 of each checksum chunk."""
    part = max(io.options.s3_part_bytes, align_up(-(-payload.size // 9000), CRC_CHUNK))
    crcs = [0] * n_chunks(payload.size)
    s.run(_upload(s.fs, path, payload, io, background, piece, part, crcs), s.url(path))
    return crcs


async def _upload(
    fs: Any,
    path: str,
    payload: Payload,
    io: IOEngine,
    background: bool,
    piece: PieceBytes,
    part: int,
    crcs: list[int],
) -> None:
    bucket, key, _ = fs.split_path(path)
    mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    where = {"Bucket": bucket, "Key": key, "UploadId": mpu["UploadId"]}
    sem = asyncio.Semaphore(io.options.s3_concurrency)
    pool = io.pool(background)
    loop = asyncio.get_running_loop()

    async def one(i: int, off: int, n: int) -> dict[str, Any]:
        async with sem:
            data, got = await loop.run_in_executor(pool, piece, payload, off, n, io)
            for c, crc in got:
                crcs[c] = crc
            out = await fs._call_s3("upload_part", **where, PartNumber=i + 1, Body=data)
            return {"PartNumber": i + 1, "ETag": out["ETag"]}

    tasks = [
        asyncio.ensure_future(one(i, o, n)) for i, (o, n) in enumerate(pieces(payload.size, part))
    ]
    try:
        parts = await asyncio.gather(*tasks)
        await fs._call_s3("complete_multipart_upload", **where, MultipartUpload={"Parts": parts})
    except BaseException:
        for t in tasks:  # stop the other parts, and collect their errors (never "unretrieved")
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await fs._call_s3("abort_multipart_upload", **where)
        raise


# -- streaming reads ------------------------------------------------------------------------
def stream(s: S3Storage, path: str, start: int, stop: int) -> Iterator[bytes]:
    """Bytes [start, stop) with one streaming GET; chunks come through a small bounded queue."""
    q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=8)
    cancelled = threading.Event()
    t = threading.Thread(
        target=_pump_thread, args=(s, path, start, stop, q, cancelled), daemon=True
    )
    t.name = "ckptstore-s3-get"
    t.start()
    try:
        while (item := q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        cancelled.set()
        while t.is_alive():  # drain so the producer never blocks on a full queue
            with contextlib.suppress(queue.Empty):
                q.get(timeout=0.05)


def _pump_thread(
    s: S3Storage, path: str, start: int, stop: int, q: queue.Queue[Any], cancelled: threading.Event
) -> None:
    try:
        s.run(_pump(s.fs, path, start, stop, q, cancelled), s.url(path))
        q.put(None)
    except BaseException as e:
        q.put(e)


async def _pump(
    fs: Any, path: str, start: int, stop: int, q: queue.Queue[Any], cancelled: threading.Event
) -> None:
    bucket, key, version = fs.split_path(path)
    kw: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{stop - 1}"}
    if version:
        kw["VersionId"] = version
    body = (await fs._call_s3("get_object", **kw))["Body"]
    put = asyncio.get_running_loop().run_in_executor
    try:
        buf = bytearray()
        while not cancelled.is_set() and (chunk := await body.read(4 * MiB)):
            buf += chunk
            if len(buf) >= 4 * MiB:
                await put(None, q.put, bytes(buf))
                buf.clear()
        if buf:
            await put(None, q.put, bytes(buf))
    finally:
        body.close()
