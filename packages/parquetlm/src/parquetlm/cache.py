"""TokenCache: a dataset tokenized once, on disk, memory-mapped.

Layout of ``CACHE_DIR/tokens-KEY/`` (KEY = hash of the dataset content + tokenizer + format)::

    tokens.bin   every document's tokens followed by EOT, concatenated (uint16, or uint32 when
                 the vocabulary has more than 65536 ids)
    docs.bin     int64 offsets, num_docs + 1 of them: document i is tokens[docs[i]:docs[i+1]]
                 (its trailing EOT included)
    tokens.crc32 crc32 of every 1 MiB piece of tokens.bin (see :mod:`parquetlm.integrity`)
    meta.json    counts, dtype, fingerprints, checksums, where it came from

Reading checks each piece of tokens.bin the first time it is used, and docs.bin when the document
index is first used: a cache damaged on disk raises :class:`CacheError` naming the file and the
fix, instead of being trained on.

Build protocol (safe against kills and concurrent builders such as two ranks on one node):
an exclusive ``flock`` on ``tokens-KEY.lock``; row groups are tokenized in parallel into
``tokens-KEY.partial/units/`` (each unit is made durable by renaming its small JSON last, so a
killed build resumes from the units it finished); then the units are concatenated in order, the
meta written, and the directory renamed to ``tokens-KEY``. A cache exists only once that rename
happened, so an interrupted build never looks complete.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import pickle
import re
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from .cachedir import CACHE_DIRNAME, CACHE_ENV, default_cache_dir
from .errors import (
    CacheError,
    CacheRebuiltWarning,
    EmptyDatasetError,
    NullRowsWarning,
    TokenizerError,
)
from .integrity import CHUNK_BYTES, SUMS_FILE, ChunkCrc, LazyCheck, pieces, read_sums
from .source import ParquetSource, Unit
from .tokenizer import Tokenizer, encode_to_array

__all__ = [
    "CACHE_DIRNAME",
    "CACHE_ENV",
    "CHUNK_BYTES",
    "FORMAT_VERSION",
    "TokenCache",
    "cache_key",
    "default_cache_dir",
    "dtype_for",
]

FORMAT_VERSION = 2  # 2: per-chunk checksums of tokens.bin, a checksum of docs.bin
ProgressFn = Callable[[int, int], None]


def dtype_for(vocab_size: int) -> np.dtype[Any]:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if vocab_size <= 0 or vocab_size > 2**32:
        raise TokenizerError(f"vocab_size={vocab_size} cannot be stored: it must be in 1..2**32")
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def cache_key(source: ParquetSource, tokenizer: Tokenizer) -> str:
    spec = f"parquetlm-cache-v{FORMAT_VERSION}\0{source.fingerprint()}\0{tokenizer.fingerprint()}"
    return hashlib.sha256(spec.encode()).hexdigest()[:24]


class TokenCache:
    """A tokenized dataset on disk. Make one with :meth:`build` (reuses an existing one)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        if not self._path.is_dir():
            what = "is a file" if self._path.exists() else "does not exist"
            raise CacheError(f"{self._path} {what}: give a token cache folder (tokens-KEY/)")
        meta_path = self._path / "meta.json"
        try:
            meta = json.loads(meta_path.read_text())
            self._meta: dict[str, Any] = meta
            self._dtype = np.dtype(meta["dtype"])
            num_tokens, num_docs = int(meta["num_tokens"]), int(meta["num_docs"])
            version = int(meta["format"])
        except FileNotFoundError:
            raise CacheError(f"{self._path} is not a complete token cache (no meta.json)") from None
        except (ValueError, KeyError, TypeError) as e:
            raise CacheError(f"{meta_path} is corrupt ({e}): delete {self._path}") from e
        if version != FORMAT_VERSION:
            raise CacheError(
                f"{self._path} has cache format {version}, expected {FORMAT_VERSION}: delete it "
                "(this version builds its own)"
            )
        tok_path, doc_path = self._path / "tokens.bin", self._path / "docs.bin"
        for p, want in (
            (tok_path, num_tokens * self._dtype.itemsize),
            (doc_path, (num_docs + 1) * 8),
        ):
            got = p.stat().st_size if p.exists() else -1
            if got != want:
                raise CacheError(
                    f"{p} has {got} bytes, meta.json says {want}: the cache is damaged; delete "
                    f"{self._path} and build again"
                )
        self.tokens: np.ndarray = np.memmap(
            tok_path, dtype=self._dtype, mode="r", shape=(num_tokens,)
        )
        """The raw tokens. Read them through :meth:`read` or a loader, which check them."""
        self._docs: np.ndarray = np.memmap(
            doc_path, dtype=np.int64, mode="r", shape=(num_docs + 1,)
        )
        self._docs_checked = False
        self._check = self._open_checks(meta, tok_path)

    def _open_checks(self, meta: dict[str, Any], tok_path: Path) -> LazyCheck:
        fix = f"delete {self._path} and run again to rebuild it"
        try:
            sums = meta["checksums"]
            chunk, sums_crc = int(sums["chunk_bytes"]), int(sums["tokens_crc32"])
        except (KeyError, TypeError, ValueError) as e:
            raise CacheError(f"{self._path / 'meta.json'} is corrupt ({e}): {fix}") from e
        count = pieces(self.tokens.nbytes, chunk)
        table = read_sums(self._path / SUMS_FILE, count=count, crc=sums_crc, fix=fix)
        return LazyCheck(self.tokens, table, chunk, tok_path, fix)

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        source: ParquetSource,
        tokenizer: Tokenizer,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        workers: int | None = None,
        progress: ProgressFn | None = None,
        verify: bool = False,
    ) -> TokenCache:
        """Tokenize ``source`` into ``cache_dir`` (default :func:`default_cache_dir`), or reuse the
        cache a previous run built for the same content and tokenizer.

        ``workers``: processes tokenizing row groups in parallel (default: the CPUs this process
        may use; 1 tokenizes in this process). A tokenizer whose ``encode_batch`` uses every core
        itself (``parallel_batch``: HF tokenizers) tokenizes in this process when ``workers`` is
        1 or covers all of at most ``MAX_INPROCESS_CPUS`` CPUs. ``progress(done, total)`` is
        called after each row group is durable. Null rows are skipped, counted (``null_rows``)
        and warned about. ``verify``: check every byte of a cache found on disk now (instead of
        each piece on first use) and rebuild it, with a warning, when it is damaged.
        """
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir(source)
        key = cache_key(source, tokenizer)
        final = root / f"tokens-{key}"
        existing = _try_open(final, verify=verify)
        if existing is not None:
            return existing
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(_unusable_root(root, cache_dir, e)) from e
        with _exclusive(root / f"tokens-{key}.lock") as locked:
            existing = _try_open(final, repair=locked, verify=verify)
            if existing is not None:
                return existing  # another builder finished while we waited for the lock
            # Without a working lock each builder uses its own directory: wasteful, never corrupt.
            suffix = "partial" if locked else f"partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            partial = root / f"tokens-{key}.{suffix}"
            with _build_errors(partial):
                _build_into(partial, source, tokenizer, key, workers=workers, progress=progress)
            try:
                os.rename(partial, final)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                shutil.rmtree(partial, ignore_errors=True)  # a concurrent builder won the race
            _fsync_dir(root)
        cache = cls(final)
        if cache.null_rows:
            warnings.warn(
                f"skipped {cache.null_rows} null rows of {source.describe()}",
                NullRowsWarning,
                stacklevel=2,
            )
        return cache

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> TokenCache:
        return cls(path)

    # -- reading -------------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._path

    @property
    def key(self) -> str:
        """Identifies the content + tokenizer; loader states are tied to it."""
        return str(self._meta["key"])

    @property
    def num_tokens(self) -> int:
        return int(self._meta["num_tokens"])

    @property
    def num_docs(self) -> int:
        return int(self._meta["num_docs"])

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    @property
    def vocab_size(self) -> int:
        return int(self._meta["vocab_size"])

    @property
    def eot_id(self) -> int:
        return int(self._meta["eot_id"])

    @property
    def null_rows(self) -> int:
        return int(self._meta["null_rows"])

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self._meta)

    @property
    def doc_offsets(self) -> np.ndarray:
        """Where each document starts (num_docs + 1 offsets), checked on first use."""
        if not self._docs_checked:
            if zlib.crc32(self._docs.data) != int(self._meta["checksums"]["docs_crc32"]):
                raise CacheError(
                    f"{self._path / 'docs.bin'} is damaged: it does not match the checksum "
                    f"written when the cache was built; delete {self._path} and run again to "
                    "rebuild it"
                )
            self._docs_checked = True
        return self._docs

    def read(self, start: int, stop: int) -> np.ndarray:
        """``tokens[start:stop]``, checked against the build's checksums (first use only)."""
        start, stop, _ = slice(start, stop).indices(self.num_tokens)
        self.check_windows(np.array([start]), max(0, stop - start))
        return np.asarray(self.tokens[start:stop])

    def check_windows(self, starts: np.ndarray, width: int) -> bool:
        """Check the tokens ``[s, s + width)`` for every ``s`` in ``starts`` (the loader calls
        this for each batch); each piece is checked once. Returns True once every piece has
        been: the caller may stop asking."""
        if not self._check.complete:
            self._check.items(np.asarray(starts, dtype=np.int64), width)
        return self._check.complete

    def verify(self) -> None:
        """Check every token and the document index now (``parquetlm verify``); a damaged cache
        raises :class:`CacheError` naming the file and the fix."""
        self._check.all()
        self.doc_offsets  # noqa: B018 - the property checks docs.bin

    def document(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` (without its trailing EOT)."""
        if not -self.num_docs <= i < self.num_docs:
            raise IndexError(f"document {i} out of range: the cache has {self.num_docs}")
        i %= self.num_docs
        offsets = self.doc_offsets
        return self.read(int(offsets[i]), int(offsets[i + 1]) - 1)

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"TokenCache({str(self._path)!r}, tokens={self.num_tokens}, docs={self.num_docs}, "
            f"dtype={self._dtype.name})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Worker processes reopen the memory map by path instead of copying the tokens.
        return (TokenCache, (str(self._path),))


def _unusable_root(root: Path, cache_dir: object, e: OSError) -> str:
    """One line: why ``root`` cannot hold token caches, and which setting chose it."""
    if cache_dir is not None:
        origin = "cache_dir= (--cache-dir)"
    elif os.environ.get(CACHE_ENV):
        origin = f"${CACHE_ENV}"
    else:
        origin = "the default"
    why = "a file is in the way" if root.exists() or isinstance(e, FileExistsError) else str(e)
    return (
        f"cannot use {root} for token caches ({why}); it comes from {origin}: point it at a folder"
    )


def _try_open(final: Path, *, repair: bool = False, verify: bool = False) -> TokenCache | None:
    if not final.exists():
        return None
    try:
        cache = TokenCache(final)
        if verify:
            cache.verify()
        return cache
    except CacheError as e:
        if not repair:
            return None  # looked at again, and repaired, under the lock
        # What was damaged, without the message's "delete it and run again": done here.
        damage = re.sub(r"[;:] delete \S+( and (run|build) again.*)?$", "", str(e))
        warnings.warn(
            f"rebuilding a damaged token cache: {damage}", CacheRebuiltWarning, stacklevel=3
        )
        shutil.rmtree(final)
        return None


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[bool]:
    """Hold an exclusive flock (released by the kernel if we die); yields False where the file
    system cannot lock (then builders do not share partial work)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield False
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            locked = False
        yield locked
    finally:
        os.close(fd)


# -- the build itself ----------------------------------------------------------------------------

_worker: dict[str, Any] = {}


def _init_worker(source: ParquetSource, tokenizer: Tokenizer, dtype: str, units_dir: str) -> None:
    _worker.update(source=source, tokenizer=tokenizer, dtype=np.dtype(dtype), units_dir=units_dir)


def _encode_unit(unit: Unit) -> int:
    """Tokenize one unit into its files in the units directory (in a worker process, or here)."""
    source: ParquetSource = _worker["source"]
    tokenizer: Tokenizer = _worker["tokenizer"]
    with _UnitFiles(unit) as out:
        for texts, n_null in source.read_unit(unit):
            out.nulls += n_null
            if len(texts):
                out.add(texts, *encode_to_array(tokenizer, texts))
    return unit.index


class _UnitFiles:
    """One unit's files, written under temporary names, then made durable and renamed in order:
    tokens, lengths, and last the small JSON that marks the unit complete."""

    def __init__(self, unit: Unit) -> None:
        self.base = os.path.join(_worker["units_dir"], f"{unit.index:07d}")
        self.tmp = f"{self.base}.{os.getpid()}.tmp"
        self.dtype: np.dtype[Any] = _worker["dtype"]
        self.vocab_size = int(_worker["tokenizer"].vocab_size)
        self.limit = min(self.vocab_size, int(np.iinfo(self.dtype).max) + 1)
        self.num_tokens = self.num_docs = self.nulls = self.text_bytes = 0

    def __enter__(self) -> _UnitFiles:
        self.ftok = open(self.tmp + "tok", "wb")  # noqa: SIM115 - closed in __exit__
        self.flen = open(self.tmp + "len", "wb")  # noqa: SIM115
        return self

    def add(self, texts: Any, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= self.limit):
            raise TokenizerError(
                f"tokenizer produced id {int(tokens.max())} outside its vocabulary of "
                f"{self.vocab_size}: its vocab_size is wrong"
            )
        self.text_bytes += _text_bytes(texts)
        self.ftok.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.flen.write(lengths.astype(np.int64, copy=False).tobytes())
        self.num_tokens += len(tokens)
        self.num_docs += len(lengths)

    def __exit__(self, exc_type: object, *rest: object) -> None:
        with self.ftok, self.flen:
            if exc_type is not None:
                return
            for out in (self.ftok, self.flen):
                out.flush()
                os.fsync(out.fileno())
        os.replace(self.tmp + "tok", self.base + ".tok")
        os.replace(self.tmp + "len", self.base + ".len")
        info = {
            "tokens": self.num_tokens,
            "docs": self.num_docs,
            "nulls": self.nulls,
            "text_bytes": self.text_bytes,
        }
        with open(self.tmp + "json", "w") as fj:
            json.dump(info, fj)
            fj.flush()
            os.fsync(fj.fileno())
        os.replace(self.tmp + "json", self.base + ".json")  # last: marks the unit complete


def _text_bytes(texts: Any) -> int:
    import pyarrow.compute as pc

    return int(pc.sum(pc.binary_length(texts)).as_py() or 0)


# Up to this many CPUs, a tokenizer whose encode_batch uses every core itself (HF tokenizers)
# tokenizes in this process rather than in worker processes, each of which costs ~0.3 s of CPU to
# start. Beyond, processes: here the GIL-held part (Arrow to str, ids to arrays: ~5% of the
# encoding work) would cap the build at ~20 cores.
MAX_INPROCESS_CPUS = 8
# Text per encode_batch call in this process: enough to keep the tokenizer's thread pool busy,
# little enough that the ids (Python lists until converted) stay a small fraction of memory.
BATCH_TEXT_BYTES = 2 << 20
READ_AHEAD = 4  # units read ahead of the encoding
ENCODE_THREADS = 2  # batches in flight: one in the tokenizer while the other is converted


def _run_units(
    todo: list[Unit],
    initargs: tuple[Any, ...],
    workers: int,
    on_done: Callable[[], None],
) -> None:
    # A tokenizer with a vectorized encode_arrow (bytes) is bound by reading: processes would
    # only add their start-up time.
    tokenizer = initargs[1]
    cheap = hasattr(tokenizer, "encode_arrow")
    if not cheap and getattr(tokenizer, "parallel_batch", False):
        cpus = _default_workers()
        if workers == 1 or cpus <= workers <= MAX_INPROCESS_CPUS:
            _run_batched(todo, initargs, on_done)
            return
    if workers > 1 and len(todo) > 1 and not cheap:
        payload = _picklable(initargs)
        if payload is not None:
            _run_in_processes(todo, payload, min(workers, len(todo)), on_done, initargs[3])
            return
    _init_worker(*initargs)
    try:
        for unit in todo:
            _encode_unit(unit)
            on_done()
    finally:
        _worker.clear()


class _Read(NamedTuple):
    unit: Unit
    texts: pa.Array  # the unit's non-null texts
    nulls: int


def _read_texts(source: ParquetSource, unit: Unit) -> _Read:
    arrays, nulls = [], 0
    for texts, n_null in source.read_unit(unit):
        nulls += n_null
        arrays.append(texts.cast(pa.large_string()))
    texts = pa.concat_arrays(arrays) if arrays else pa.array([], type=pa.large_string())
    return _Read(unit, texts, nulls)


def _run_batched(todo: list[Unit], initargs: tuple[Any, ...], on_done: Callable[[], None]) -> None:
    """Tokenize in this process with a tokenizer whose ``encode_batch`` already spreads over
    every core. Consecutive units share one ``encode_batch`` call (fewer, fuller rounds of the
    tokenizer's thread pool); a thread reads the next units meanwhile, and a second batch encodes
    while the first one's ids become arrays (Python work, under the GIL). Each unit is still
    written and made durable on its own, in order, so a killed build resumes as with workers."""
    _init_worker(*initargs)
    source, tokenizer = initargs[0], initargs[1]
    readers = ThreadPoolExecutor(1, thread_name_prefix="parquetlm-read")
    encoders = ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="parquetlm-encode")
    try:
        pending = iter(todo)
        reads = deque(readers.submit(_read_texts, source, u) for u in islice(pending, READ_AHEAD))
        encodes: deque[tuple[list[_Read], Future[tuple[np.ndarray, np.ndarray]]]] = deque()
        batch: list[_Read] = []
        size = 0
        while reads or batch or encodes:
            if reads:
                got = reads.popleft().result()
                nxt = next(pending, None)
                if nxt is not None:
                    reads.append(readers.submit(_read_texts, source, nxt))
                batch.append(got)
                size += got.texts.nbytes
            if batch and (size >= BATCH_TEXT_BYTES or not reads):
                encodes.append((batch, encoders.submit(_encode_texts, tokenizer, batch)))
                batch, size = [], 0
            if encodes and (len(encodes) >= ENCODE_THREADS or not reads):
                done, fut = encodes.popleft()
                _write_batch(done, *fut.result())
                for _ in done:
                    on_done()
    finally:
        readers.shutdown(wait=True, cancel_futures=True)
        encoders.shutdown(wait=True, cancel_futures=True)
        _worker.clear()


def _encode_texts(tokenizer: Tokenizer, batch: list[_Read]) -> tuple[np.ndarray, np.ndarray]:
    """``encode_to_array`` of the texts of several units at once."""
    texts = [r.texts for r in batch if len(r.texts)]
    if not texts:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    return encode_to_array(tokenizer, pa.concat_arrays(texts))


def _write_batch(batch: list[_Read], tokens: np.ndarray, lengths: np.ndarray) -> None:
    """Each unit's share of a batch's tokens into its own files."""
    ends = np.concatenate([[0], np.cumsum(lengths)])
    doc = 0
    for r in batch:
        with _UnitFiles(r.unit) as out:
            out.nulls = r.nulls
            if len(r.texts):
                lo, hi = doc, doc + len(r.texts)
                out.add(r.texts, tokens[ends[lo] : ends[hi]], lengths[lo:hi])
                doc = hi


def _picklable(initargs: tuple[Any, ...]) -> bytes | None:
    """The workers' arguments, or None when they cannot travel to a fresh interpreter (a
    tokenizer class defined in ``__main__``): then this process tokenizes alone."""
    for a in initargs:
        module = type(a).__module__
        try:
            if module == "__main__" or importlib.util.find_spec(module) is None:
                return None
        except (ImportError, ValueError):
            return None
    try:
        return pickle.dumps(initargs)
    except Exception:
        return None


def _run_in_processes(
    todo: list[Unit], payload: bytes, workers: int, on_done: Callable[[], None], units_dir: str
) -> None:
    # Fresh interpreters running our own module, not multiprocessing: no fork of a process that
    # runs pyarrow/tokenizers threads, and no re-import of the caller's __main__ (spawn's trap).
    job = os.path.join(units_dir, f"job-{os.getpid()}-{uuid.uuid4().hex[:8]}.pkl")
    with open(job, "wb") as f:
        pickle.dump((payload, todo), f)
    # The processes are the parallelism: no tokenizers thread pool inside each.
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    # The parent's import path, so the tokenizer's class imports in the child as it does here.
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
    # stderr goes to files: a chatty worker must not block on a full pipe nobody reads.
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(workers)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "parquetlm._worker", job],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
            )
            for log in logs
        ]
        try:
            _schedule(procs, logs, len(todo), on_done)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
                for pipe in (p.stdin, p.stdout):
                    if pipe is not None:
                        pipe.close()
            os.unlink(job)


def _schedule(
    procs: list[subprocess.Popen[bytes]], logs: list[Any], n: int, on_done: Callable[[], None]
) -> None:
    """Hand out units one at a time to whichever worker is free (big and small row groups
    balance); a worker prints a line when it is ready for the next one."""
    queue = iter(range(n))
    with selectors.DefaultSelector() as sel:
        for p in procs:
            assert p.stdout is not None
            sel.register(p.stdout, selectors.EVENT_READ, (p, logs[procs.index(p)]))
        running = len(procs)
        while running:
            for key, _ in sel.select():
                proc, log = key.data
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if line.startswith(b"done"):
                    on_done()
                if line:
                    assert proc.stdin is not None
                    nxt = next(queue, None)
                    proc.stdin.write(b"stop\n" if nxt is None else b"%d\n" % nxt)
                    proc.stdin.flush()
                    continue
                sel.unregister(key.fileobj)
                running -= 1
                _check(proc, log)


def _check(proc: subprocess.Popen[bytes], log: Any) -> None:
    if proc.wait() != 0:
        log.seek(0)
        lines = log.read().decode(errors="replace").strip().splitlines()
        marked = [ln.split(" ", 1)[1] for ln in lines if ln.startswith("PARQUETLM-WORKER-ERROR ")]
        last = marked[-1] if marked else (lines[-1] if lines else f"exit {proc.returncode}")
        if last.startswith("parquetlm.errors."):
            raise CacheError(last.split(": ", 1)[-1])
        raise CacheError(f"a tokenizer worker failed: {last}")


def _default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def split_units(units: list[Unit], *, max_parts: int = 16, min_rows: int = 256) -> list[Unit]:
    """Cut big row groups into up to ``max_parts`` parts of >= ``min_rows`` rows, so workers
    balance even on a file with one row group. Depends on the metadata only (a resumed build
    finds the same parts). Each part re-reads its row group up to its end: cheap next to BPE."""
    out: list[Unit] = []
    for u in units:
        parts = max(1, min(max_parts, u.num_rows // min_rows))
        edges = [u.num_rows * k // parts for k in range(parts + 1)]
        for lo, hi in zip(edges, edges[1:], strict=False):
            out.append(Unit(len(out), u.file_index, u.row_group, u.num_rows, lo, hi))
    return out


@contextlib.contextmanager
def _build_errors(partial: Path) -> Iterator[None]:
    """An empty dataset leaves no partial build; a full disk is one line (the work done stays)."""
    try:
        yield
    except EmptyDatasetError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise CacheError(
            f"no space left for the token cache in {partial.parent} (a build needs about twice "
            "the cache's size): free space or point --cache-dir / $PARQUETLM_CACHE "
            "elsewhere; the row groups done are kept and the next run goes on from them"
        ) from e


def _build_into(
    partial: Path,
    source: ParquetSource,
    tokenizer: Tokenizer,
    key: str,
    *,
    workers: int | None,
    progress: ProgressFn | None,
) -> None:
    t0 = time.time()
    dtype = dtype_for(tokenizer.vocab_size)
    units_dir = partial / "units"
    units_dir.mkdir(parents=True, exist_ok=True)
    if (partial / "meta.json").exists():  # built; stopped while it cleared its units away
        shutil.rmtree(units_dir)
        return
    units = source.units if hasattr(tokenizer, "encode_arrow") else split_units(source.units)
    todo = [u for u in units if not _unit_done(units_dir, u)]
    done = len(units) - len(todo)
    counter = [done]

    def on_done() -> None:
        counter[0] += 1
        if progress is not None:
            progress(counter[0], len(units))

    n_workers = _default_workers() if workers is None else int(workers)
    if n_workers < 1:
        raise CacheError(f"workers={workers} must be >= 1 (or None for all CPUs)")
    _run_units(todo, (source, tokenizer, dtype.name, str(units_dir)), n_workers, on_done)
    if progress is not None and not todo:
        progress(len(units), len(units))
    totals = _assemble(partial, units, units_dir)
    if totals["num_docs"] == 0:
        raise EmptyDatasetError(
            f"empty dataset: all {totals['null_rows']} rows of column {source.column!r} in "
            f"{source.describe()} are null"
        )
    meta = _meta(source, tokenizer, key, dtype.name, totals)
    meta["build_seconds"] = round(time.time() - t0, 3)
    _write_json(partial / "meta.json", meta)
    shutil.rmtree(units_dir)
    _fsync_dir(partial)


def _meta(
    source: ParquetSource, tokenizer: Tokenizer, key: str, dtype: str, totals: dict[str, Any]
) -> dict[str, Any]:
    """meta.json of a built cache: what it was built from, and its totals."""
    return {
        "format": FORMAT_VERSION,
        "key": key,
        "dtype": dtype,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "tokenizer": repr(tokenizer),
        "tokenizer_fingerprint": tokenizer.fingerprint(),
        "source_fingerprint": source.fingerprint(),
        "column": source.column,
        "files": source.files[:100],
        "num_files": len(source.files),
        "num_rows": source.num_rows,
        **totals,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _unit_done(units_dir: Path, unit: Unit) -> bool:
    """All three files of a unit are there (its JSON comes last; the others are checked too:
    a build stopped while removing the units dir has removed some of them)."""
    base = units_dir / f"{unit.index:07d}"
    return all(base.with_suffix(s).exists() for s in (".json", ".tok", ".len"))


def _assemble(partial: Path, units: list[Unit], units_dir: Path) -> dict[str, Any]:
    """Concatenate the units in dataset order into tokens.bin and docs.bin (bounded memory),
    with their checksums."""
    num_tokens = num_docs = nulls = text_bytes = 0
    tok_crc, docs_crc = ChunkCrc(CHUNK_BYTES), 0
    with open(partial / "tokens.bin", "wb") as ftok, open(partial / "docs.bin", "wb") as fdoc:
        first = np.zeros(1, dtype=np.int64).tobytes()
        fdoc.write(first)
        docs_crc = zlib.crc32(first)
        for unit in units:
            base = units_dir / f"{unit.index:07d}"
            info = json.loads(base.with_suffix(".json").read_text())
            with open(base.with_suffix(".tok"), "rb") as fin:
                while block := fin.read(1 << 24):
                    ftok.write(block)
                    tok_crc.update(block)
            lengths = np.fromfile(base.with_suffix(".len"), dtype=np.int64)
            offsets = (np.cumsum(lengths) + num_tokens).tobytes()
            fdoc.write(offsets)
            docs_crc = zlib.crc32(offsets, docs_crc)
            num_tokens += int(info["tokens"])
            num_docs += int(info["docs"])
            nulls += int(info["nulls"])
            text_bytes += int(info["text_bytes"])
        for out in (ftok, fdoc):
            out.flush()
            os.fsync(out.fileno())
    sums = tok_crc.sums().tobytes()
    with open(partial / SUMS_FILE, "wb") as fsum:
        fsum.write(sums)
        fsum.flush()
        os.fsync(fsum.fileno())
    return {
        "num_tokens": num_tokens,
        "num_docs": num_docs,
        "null_rows": nulls,
        "text_bytes": text_bytes,
        "checksums": {
            "algorithm": "crc32",
            "chunk_bytes": CHUNK_BYTES,
            "tokens_crc32": zlib.crc32(sums),
            "docs_crc32": docs_crc,
        },
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a directory
    finally:
        os.close(fd)
