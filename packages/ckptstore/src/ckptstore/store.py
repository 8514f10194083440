"""CheckpointStore: save / verify / load / prune checkpoints on any fsspec URL.

Commit protocol (DESIGN.md): every rank's payload is made durable first, then rank 0 writes
``manifest.json`` (the commit), then moves the ``latest`` pointer. A directory without a valid
manifest is not a checkpoint. Payload file names carry a per-save token, so re-saving a step never
overwrites the files its current manifest points at: a crash at any instant leaves the previous
checkpoint loadable.
"""

from __future__ import annotations

import builtins
import dataclasses
import inspect
import logging
import platform
import re
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import torch

from . import __version__, _testing
from ._dist import all_gather, broadcast, dist_info
from .buffers import Arena, align_up
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    MirrorError,
    NoCheckpointError,
)
from .formats import CheckpointFormat, LoadContext, SaveContext, get_format
from .manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointInfo,
    FileEntry,
    FileReport,
    Manifest,
    SaveStats,
    VerifyReport,
    parse_step_dir,
    step_dir_name,
)
from .retention import RetentionPolicy
from .storage import Dest, IOEngine, IOOptions, Storage, open_storage
from .tree import EncodedState, encode_state, has_state_dict

log = logging.getLogger("ckptstore")
_EXPERIMENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# A temp file of the `latest` pointer, left by a kill between its write and its rename.
_STALE_POINTER_RE = re.compile(re.escape(LATEST_NAME) + r"\.tmp-[0-9a-f]+")
# Files the store itself creates inside a step directory; prune removes only these.
_OWN_FILE_RE = re.compile(
    r"(manifest\.json|state\.[A-Za-z0-9]+\.ckpt|shard-r\d+\.[A-Za-z0-9]+\.bin)(\.tmp-[0-9a-f]+)?"
)


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt, unreadable) or a mirror copy failed."""


def _warn(msg: str) -> None:
    log.warning(msg)
    warnings.warn(msg, CheckpointWarning, stacklevel=3)


def check_experiment(name: str | None) -> str | None:
    if name is None:
        return None
    parts = name.split("/") if isinstance(name, str) else [""]
    if not all(_EXPERIMENT_RE.fullmatch(p) for p in parts) or len(name) > 255:
        raise ValueError(
            f"experiment {name!r} is not a valid name: use letters, digits, '.', '_', '-' (and "
            "'/' between parts), starting with a letter or digit; it must stay inside the root"
        )
    return name


def check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**15:
        raise ValueError(f"step must be an integer in [0, 1e15), got {step!r}")
    return step


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of JSON values, got {type(metadata).__name__}")
    try:
        out: dict[str, Any] = orjson.loads(orjson.dumps(dict(metadata)))
    except TypeError as e:
        raise TypeError(
            f"metadata must be JSON (str keys; numbers, strings, lists, dicts): {e}"
        ) from None
    return out


# --------------------------------------------------------------------------------------------
class _Location:
    """A root (primary or mirror) and its layout: ROOT/step-%08d/{payload, manifest.json}."""

    def __init__(self, storage: Storage, root: str) -> None:
        self.storage, self.root = storage, root
        self.url = storage.url(root)

    def step_dir(self, step: int) -> str:
        return self.storage.join(self.root, step_dir_name(step))

    def step_dirs(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for name in self.storage.list_dir(self.root):
            step = parse_step_dir(name)
            if step is not None and (step not in out or name == step_dir_name(step)):
                out[step] = self.storage.join(self.root, name)
        return out

    def read_manifest(self, step_dir: str) -> Manifest:
        """FileNotFoundError when absent (not a checkpoint); CorruptCheckpointError if bad."""
        path = self.storage.join(step_dir, MANIFEST_NAME)
        data = self.storage.read_small(path)
        return Manifest.from_json(data, url=self.storage.url(step_dir))

    def manifests(self) -> tuple[dict[int, Manifest], dict[int, str]]:
        """Committed checkpoints by step, and the step dirs whose manifest is invalid (why)."""
        good: dict[int, Manifest] = {}
        bad: dict[int, str] = {}
        for step, d in sorted(self.step_dirs().items()):
            try:
                m = self.read_manifest(d)
            except FileNotFoundError:
                continue  # an interrupted save: not a checkpoint
            except (CheckpointError, OSError) as e:
                bad[step] = str(e)
                continue
            if m.step != step:
                bad[step] = f"{m.url}: manifest says step {m.step}, directory says {step}"
                continue
            good[step] = m
        return good, bad

    def pointer(self) -> int | None:
        try:
            text = self.storage.read_small(self.storage.join(self.root, LATEST_NAME))
        except (FileNotFoundError, OSError):
            return None
        return parse_step_dir(text.decode(errors="replace").strip())

    def head(self, committed: Sequence[int]) -> int | None:
        p = self.pointer()
        if p is not None and p in committed:
            return p
        return max(committed) if committed else None

    def write_pointer(self, step: int) -> None:
        self.storage.write_small(
            self.storage.join(self.root, LATEST_NAME),
            f"{step_dir_name(step)}\n".encode(),
            pause="latest-tmp",
        )

    def remove_checkpoint(self, step_dir: str, keep: Sequence[str] = ()) -> None:
        """Uncommit (manifest first), then delete our own files; foreign files stay."""
        self.storage.delete(self.storage.join(step_dir, MANIFEST_NAME))
        for name in self.storage.list_dir(step_dir):
            if name not in keep and _OWN_FILE_RE.fullmatch(name):
                self.storage.delete(self.storage.join(step_dir, name))
        self.storage.rmdir(step_dir)


@dataclass(frozen=True, slots=True)
class _Candidate:
    where: str  # "primary" | "mirror" | "external"
    step: int
    step_dir: str


@dataclass(frozen=True, slots=True)
class _Skip:
    reason: str
    silent: bool = False


class SaveHandle:
    """What ``save()`` returns; ``result()`` waits for durability and re-raises a failure."""

    def __init__(self, step: int, blocking_s: float) -> None:
        self.step, self.blocking_s = step, blocking_s
        self._done = threading.Event()
        self._stats: SaveStats | None = None
        self._error: BaseException | None = None
        self._on_delivered: Callable[[BaseException], None] | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> SaveStats:
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout} s")
        if self._error is not None:
            if self._on_delivered is not None:
                self._on_delivered(self._error)
            raise self._error
        assert self._stats is not None
        return self._stats

    def _finish(self, stats: SaveStats | None, error: BaseException | None) -> None:
        self._stats, self._error = stats, error
        self._done.set()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"SaveHandle(step={self.step}, {state}, blocking_s={self.blocking_s:.3f})"


# --------------------------------------------------------------------------------------------
class CheckpointStore:
    """Verified, atomic, optionally async checkpoints under ``url[/experiment]``.

    Every rank of a ``torch.distributed`` job constructs the store (it creates a private gloo
    group) and calls ``save``/``load``; rank 0 commits, lists, prunes and mirrors.
    """

    def __init__(
        self,
        url: str,
        *,
        format: str = "torch",
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str = "val_loss",
        best_mode: str = "min",
        mirror: str | None = None,
        storage_options: dict[str, Any] | None = None,
        mirror_storage_options: dict[str, Any] | None = None,
        experiment: str | None = None,
        io: IOOptions | None = None,
        distributed: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError("url must be a local path or an fsspec URL, e.g. /ckpt or s3://b/ckpt")
        self.retention = RetentionPolicy(
            keep_last=keep_last,
            keep_every=keep_every,
            keep_best=keep_best,
            best_metric=best_metric,
            best_mode=best_mode,
        )
        self.experiment = check_experiment(experiment)
        self.format_name = format
        self._format: CheckpointFormat = get_format(format)()
        self._storage_options = storage_options
        self.primary = self._location(url, storage_options)
        self.url = self.primary.url
        self.mirror = self._location(mirror, mirror_storage_options) if mirror else None
        self._clock, self._wall = clock, wall_clock
        self.rank, self.world_size, self._group = dist_info(distributed)
        self._session = broadcast(self._group, uuid.uuid4().hex[:8])
        self._seq = 0
        self._io = IOEngine(io)
        self._arena = Arena()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._inflight: SaveHandle | None = None
        self._pending: BaseException | None = None
        self._completed: list[SaveStats] = []
        self._verified: set[tuple[str, int, str]] = set()  # (root url, step, save_id) we wrote
        self._protected: set[int] = set()
        self._external: _Location | None = None
        self._mirror_worker = _MirrorWorker(self) if self.mirror and self.rank == 0 else None
        self._closed = False

    def _location(self, url: str, options: dict[str, Any] | None) -> _Location:
        storage = open_storage(url, options)
        root = storage.join(storage.root, self.experiment) if self.experiment else storage.root
        return _Location(storage, root)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r}, format={self.format_name!r})"

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------- saving --
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metadata: Mapping[str, Any] | None = None,
        blocking: bool = True,
    ) -> SaveHandle:
        """Save ``state`` as ``step``. Blocking: returns once committed. Non-blocking: returns
        after a CPU snapshot; the write runs in the background (one at a time: a second save
        first waits for the previous one) and ``latest`` moves only once it is durable."""
        self._check_open()
        self._seq += 1  # before validation, so every rank derives the same file token
        token = f"{self._session}{self._seq:05x}"
        step = check_step(step)
        meta = _check_metadata(metadata)
        self.wait()
        t0 = self._clock()
        writes = self._format.writes_on(self.rank, self.world_size)
        enc: EncodedState | None = None
        if writes:
            enc = encode_state(state, allow_dtensor=self.format_name != "torch")
        step_dir = self.primary.step_dir(step)
        record: dict[str, Any] = {}
        ctx = SaveContext(
            storage=self.primary.storage,
            step_dir=step_dir,
            step=step,
            token=token,
            rank=self.rank,
            world_size=self.world_size,
            group=self._group,
            io=self._io,
            arena=self._arena,
            background=not blocking,
            commit=lambda files, fd: self._commit(step, token, meta, files, fd, t0, record),
        )
        with self._lock:
            self._protected.add(step)
        staged = None
        try:
            staged = self._format.stage(enc, ctx)
            stage_error: Exception | None = None
        except OSError as e:
            stage_error = CheckpointError(f"cannot save step {step} under {self.url}: {e}")
        except Exception as e:
            stage_error = e
        # Every rank learns whether every rank staged: otherwise a rank that failed here would
        # leave the others waiting forever in the collectives of the write.
        self._agree_ok(step, "preparing", stage_error)
        handle = SaveHandle(step, self._clock() - t0)
        handle._on_delivered = self._delivered
        record["t0"] = t0
        if blocking:
            self._persist(staged, ctx, handle, record)
            self._agree_ok(step, "writing", handle._error)
            return handle
        self._inflight = handle
        self._thread = threading.Thread(
            target=self._persist,
            args=(staged, ctx, handle, record),
            name=f"ckptstore-save-{step}",
            daemon=False,  # a durable last checkpoint matters more than a prompt exit
        )
        self._thread.start()
        return handle

    def reserve(self, state: Mapping[str, Any]) -> None:
        """Prepare for async saves of ``state`` (call once, e.g. before training starts):
        allocate the snapshot buffer and touch its memory in the background, so the first
        ``save(..., blocking=False)`` blocks only for the copy, not for fresh memory."""
        self._check_open()
        if not self._format.writes_on(self.rank, self.world_size):
            return
        enc = encode_state(state, allow_dtensor=self.format_name != "torch")
        nbytes = sum(align_up(t.numel() * t.element_size()) for t in enc.tensors.values())
        nbytes += 2 * len(orjson.dumps(enc.tree)) + (1 << 20)  # header, padding
        cuda = any(t.is_cuda for t in enc.tensors.values())
        self._arena.reserve(nbytes, pin=cuda, nice=self._io.options.background_nice)

    def _persist(
        self, staged: Any, ctx: SaveContext, handle: SaveHandle, record: dict[str, Any]
    ) -> None:
        """Write and commit; never raises: the outcome goes to the handle (and, for a
        background save, to the store, which re-raises it at the next call)."""
        step = ctx.step
        try:
            self._format.persist(staged, ctx)
            if "stats" in record:  # this rank committed
                stats = dataclasses.replace(record["stats"], blocking_s=handle.blocking_s)
                with self._lock:
                    self._completed.append(stats)
                self._after_commit(step, record["manifest"])
            else:
                stats = SaveStats(
                    step=step,
                    bytes=0,
                    blocking_s=handle.blocking_s,
                    total_s=self._clock() - record["t0"],
                    durable_at=self._wall(),
                    url=self.primary.storage.url(ctx.step_dir),
                    format=self.format_name,
                )
            handle._finish(stats, None)
        except BaseException as e:
            err = e
            if not isinstance(e, CheckpointError):
                err = CheckpointError(f"save of step {step} to {self.url} failed: {e!r}")
                err.__cause__ = e
            if ctx.background:
                with self._lock:
                    self._pending = err
            handle._finish(None, err)
        finally:
            self._unprotect(step)

    def _agree_ok(self, step: int, what: str, error: BaseException | None) -> None:
        """Under torch.distributed every rank raises if any rank failed (blocking saves also
        return only once rank 0 has committed). Outside it, just raise our own error."""
        if self._group is None:
            if error is not None:
                self._unprotect(step)
                raise error
            return
        outcomes = all_gather(self._group, None if error is None else str(error))
        failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if failed:
            self._unprotect(step)
            if error is not None and failed[0][0] == self.rank:
                raise error
            r, msg = failed[0]
            raise CheckpointError(f"{what} step {step} failed on rank {r}: {msg}")

    def _commit(
        self,
        step: int,
        token: str,
        meta: dict[str, Any],
        files: Sequence[FileEntry],
        format_data: dict[str, Any],
        t0: float,
        record: dict[str, Any],
    ) -> None:
        """Coordinator only, once every rank's payload is durable: manifest, then pointer."""
        _testing.pause_point("payload-written")
        manifest = Manifest(
            step=step,
            format=self.format_name,
            time=self._wall(),
            world_size=self.world_size,
            files=tuple(files),
            metadata=meta,
            versions=_versions(),
            format_data=format_data,
            save_id=token,
            url=self.primary.storage.url(self.primary.step_dir(step)),
        )
        loc = self.primary
        manifest_path = loc.storage.join(loc.step_dir(step), MANIFEST_NAME)
        loc.storage.write_small(manifest_path, manifest.to_json(), pause="manifest-tmp")
        _testing.pause_point("manifest-written")
        loc.write_pointer(step)
        _testing.pause_point("committed")
        durable_at = self._wall()
        with self._lock:
            self._verified.add((loc.url, step, token))
        record["t0"] = t0
        record["manifest"] = manifest
        record["stats"] = SaveStats(
            step=step,
            bytes=manifest.bytes,
            blocking_s=0.0,
            total_s=self._clock() - t0,
            durable_at=durable_at,
            url=manifest.url,
            format=self.format_name,
        )

    def _after_commit(self, step: int, manifest: Manifest) -> None:
        """Housekeeping that must never fail a committed save: stale files, mirror, prune."""
        try:
            keep = [f.path for f in manifest.files] + [MANIFEST_NAME]
            d = self.primary.step_dir(step)
            for name in self.primary.storage.list_dir(d):
                # Everything of this save is renamed into place by now: what else is ours here
                # (temp files included) is left from an earlier, interrupted save of this step.
                if name not in keep and _OWN_FILE_RE.fullmatch(name):
                    self.primary.storage.delete(self.primary.storage.join(d, name))
        except (OSError, CheckpointError) as e:
            _warn(f"ckptstore: could not remove superseded files of step {step}: {e}")
        try:
            self._sweep_interrupted(self.primary, below=step)
        except (OSError, CheckpointError) as e:
            _warn(f"ckptstore: could not remove what interrupted saves left in {self.url}: {e}")
        if self._mirror_worker is not None:
            self._mirror_worker.submit(manifest, self._clock())
        if self.retention.active:
            try:
                self._prune_location(self.primary)
            except (OSError, CheckpointError) as e:
                _warn(f"ckptstore: pruning {self.url} failed (nothing lost): {e}")

    def _sweep_interrupted(self, loc: _Location, *, below: int) -> builtins.list[int]:
        """Remove step folders without a manifest older than a step just committed, and stale
        temp files of the ``latest`` pointer: what a kill during a save or a prune left. No one
        writes them any more (one writer per experiment; a save in flight is protected), and
        without a manifest they are not checkpoints. Only our own files go: a foreign file
        keeps its folder."""
        for name in loc.storage.list_dir(loc.root):
            if _STALE_POINTER_RE.fullmatch(name):  # our pointer was renamed into place already
                loc.storage.delete(loc.storage.join(loc.root, name))
        with self._lock:
            protected = set(self._protected)
        swept = []
        for s, d in loc.step_dirs().items():
            if s >= below or s in protected or MANIFEST_NAME in loc.storage.list_dir(d):
                continue
            loc.remove_checkpoint(d)
            swept.append(s)
        return swept

    def _unprotect(self, step: int) -> None:
        with self._lock:
            self._protected.discard(step)

    def _delivered(self, err: BaseException) -> None:
        with self._lock:
            if self._pending is err:
                self._pending = None

    def wait(self) -> None:
        """Block until the save in flight is durable; re-raise a background failure."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
            self._inflight = None
        with self._lock:
            err, self._pending = self._pending, None
        if err is not None:
            raise err

    def saves_completed(self) -> list[SaveStats]:
        """Stats of saves (and mirror copies) committed since the last call, oldest first."""
        with self._lock:
            out, self._completed = self._completed, []
        return out

    # ---------------------------------------------------------------------------- loading --
    def load(
        self, state: MutableMapping[str, Any], step: int | str = "latest", *, strict: bool = True
    ) -> Manifest:
        """Restore ``state`` in place from a verified checkpoint and return its manifest.

        Objects with ``load_state_dict`` and tensors are restored in place; every other entry
        (ints, dicts of RNG states, ...) is *replaced* in ``state``: read it back from there.
        ``step``: "latest" (falls back, with a warning, to the newest checkpoint that verifies),
        a step number, a step directory name, or a path/URL of a checkpoint directory (or of a
        plain ``torch.save`` file, read with ``weights_only=True``). The mirror is tried when the
        primary copy is missing or corrupt. With ``strict``, every key of ``state`` must be in the
        checkpoint (extra checkpoint keys are fine) and modules load with ``strict=True``.
        """
        self._check_open()
        self.wait()
        keys = list(state.keys())
        manifest, values = self._read(step, keys, like=state, strict=strict)
        self._apply(state, values, strict)
        return manifest

    def read(
        self, step: int | str = "latest", keys: Sequence[str] | None = None
    ) -> tuple[Manifest, dict[str, Any]]:
        """Verified values of a checkpoint without loading them into objects: ``{key: value}``
        with modules and optimizers as their state dicts (tensors on CPU)."""
        self._check_open()
        self.wait()
        return self._read(step, keys, like={}, strict=True)

    def _read(
        self, step: int | str, keys: Sequence[str] | None, *, like: Mapping[str, Any], strict: bool
    ) -> tuple[Manifest, dict[str, Any]]:
        if isinstance(step, str) and step != "latest":
            if step.isdigit():
                step = int(step)
            elif (n := parse_step_dir(step)) is not None:
                step = n
            else:
                return self._read_path(step, keys, like, strict)
        elif not isinstance(step, str):
            step = check_step(step)
        cands = broadcast(self._group, self._candidates(step) if self.rank == 0 else None)
        if not cands:
            raise NoCheckpointError(self._nothing_message(step))
        skipped: list[str] = []
        for i, c in enumerate(cands):
            try:
                with self._lock:
                    self._protected.add(c.step)
                result = self._try(c, keys, like, strict)
            finally:
                self._unprotect(c.step)
            if not isinstance(result, _Skip):
                return result
            skipped.append(result.reason)
            if result.silent:  # a save that never committed: it does not exist
                continue
            if i + 1 < len(cands):
                nxt = cands[i + 1]
                _warn(f"ckptstore: skipped {result.reason}; trying step {nxt.step} ({nxt.where})")
            elif step == "latest":
                _warn(f"ckptstore: skipped {result.reason}")
        if step != "latest":  # an explicit step never silently becomes another one
            raise CorruptCheckpointError(" | ".join(skipped))
        raise NoCheckpointError(f"no loadable checkpoint in {self.url}: " + " | ".join(skipped))

    def _try(
        self,
        c: _Candidate,
        keys: Sequence[str] | None,
        like: Mapping[str, Any],
        strict: bool,
    ) -> tuple[Manifest, dict[str, Any]] | _Skip:
        """A loaded candidate, or why it was skipped. Every rank reaches the same verdict."""
        loc = self._where(c.where)
        verdict: tuple[str, str] | None = None
        manifest: Manifest | None = None
        try:
            manifest = loc.read_manifest(c.step_dir)
            want = self._keys_to_read(manifest, loc, keys, strict)
        except FileNotFoundError:
            verdict = ("absent", f"{loc.storage.url(c.step_dir)}: no manifest.json (not committed)")
        except CorruptCheckpointError as e:
            verdict = ("skip", str(e))
        except CheckpointError as e:
            verdict = ("fatal", f"{type(e).__name__}: {e}")
        except Exception as e:  # unreachable storage (OSError, botocore, ...): try the next
            verdict = ("skip", f"{loc.storage.url(c.step_dir)}: cannot read ({e!r})")
        verdict = self._agree(verdict)
        if verdict is not None:
            if verdict[0] == "fatal":
                raise IncompatibleCheckpointError(verdict[1])
            return _Skip(verdict[1], silent=verdict[0] == "absent")
        assert manifest is not None
        values: dict[str, Any] = {}
        try:
            fmt = get_format(manifest.format)()
            values = fmt.load(manifest, self._load_ctx(loc, c.step_dir), want, like)
        except CorruptCheckpointError as e:
            verdict = ("skip", str(e))
        except CheckpointError as e:
            verdict = ("fatal", f"{type(e).__name__}: {e}")
        except (RuntimeError, ValueError) as e:  # e.g. torch refusing a size mismatch
            verdict = ("fatal", f"{type(e).__name__}: {e}")
        except Exception as e:  # unreachable storage (OSError, botocore, ...): try the next
            verdict = ("skip", f"{manifest.url}: cannot read ({e!r})")
        verdict = self._agree(verdict)
        if verdict is not None:
            if verdict[0] == "fatal":
                raise IncompatibleCheckpointError(verdict[1])
            return _Skip(verdict[1])
        return manifest, values

    def _agree(self, verdict: tuple[str, str] | None) -> tuple[str, str] | None:
        if self._group is None:
            return verdict
        got = all_gather(self._group, verdict)
        bad = [(r, v) for r, v in enumerate(got) if v is not None]
        if not bad:
            return None
        fatal = [(r, v) for r, v in bad if v[0] == "fatal"]
        r, v = (fatal or bad)[0]
        return v[0], f"(rank {r}) {v[1]}"

    def _keys_to_read(
        self, manifest: Manifest, loc: _Location, keys: Sequence[str] | None, strict: bool
    ) -> list[str]:
        fmt = get_format(manifest.format)()
        tree = fmt.describe(manifest, self._load_ctx(loc, ""))["tree"]
        if keys is None:
            return list(tree)
        missing = [k for k in keys if k not in tree]
        if missing and strict:
            raise IncompatibleCheckpointError(
                f"{manifest.url} has no {missing} (it has {sorted(tree)}); pass strict=False to "
                "load the rest"
            )
        if missing:
            _warn(f"ckptstore: {manifest.url} has no {missing}; left unchanged (strict=False)")
        return [k for k in keys if k in tree]

    def _load_ctx(self, loc: _Location, step_dir: str) -> LoadContext:
        return LoadContext(
            storage=loc.storage,
            step_dir=step_dir,
            rank=self.rank,
            world_size=self.world_size,
            group=self._group,
            io=self._io,
        )

    def _apply(
        self, state: MutableMapping[str, Any], values: Mapping[str, Any], strict: bool
    ) -> None:
        for key, value in values.items():
            target = state[key]
            where = f"state[{key!r}]"
            if isinstance(target, torch.Tensor):
                if not isinstance(value, torch.Tensor) or value.shape != target.shape:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                    raise IncompatibleCheckpointError(
                        f"{where} is a tensor of shape {tuple(target.shape)}; checkpoint has {got}"
                    )
                with torch.no_grad():
                    target.copy_(value)
            elif has_state_dict(target):
                _load_state_dict(target, value, strict, where)
            else:
                state[key] = _own_storage(value)

    def _read_path(
        self, path: str, keys: Sequence[str] | None, like: Mapping[str, Any], strict: bool
    ) -> tuple[Manifest, dict[str, Any]]:
        storage = open_storage(path, self._storage_options)
        step_dir = storage.root
        loc = _Location(storage, step_dir)
        self._external = loc
        if storage.exists(storage.join(step_dir, MANIFEST_NAME)):
            c = _Candidate("external", -1, step_dir)
            result = self._try(c, keys, like, strict)
            if isinstance(result, _Skip):
                raise CorruptCheckpointError(result.reason)
            return result
        if not storage.exists(step_dir):
            raise NoCheckpointError(f"{path}: no such checkpoint directory or file")
        return _read_torch_save(storage, step_dir, keys, strict)

    def _where(self, where: str) -> _Location:
        if where == "mirror" and self.mirror is not None:
            return self.mirror
        if where == "external" and self._external is not None:
            return self._external
        return self.primary

    def _candidates(self, step: int | str) -> list[_Candidate]:
        """Rank 0: which checkpoints to try, in order."""
        locs = [("primary", self.primary)] + ([("mirror", self.mirror)] if self.mirror else [])
        dirs = {name: loc.step_dirs() for name, loc in locs}
        if step != "latest":
            s = int(step)
            return [_Candidate(n, s, dirs[n][s]) for n, _ in locs if s in dirs[n]]
        steps = sorted(set().union(*(d.keys() for d in dirs.values())))
        if not steps:
            return []
        head = None
        for name, loc in locs:
            if dirs[name]:
                p = loc.pointer()
                head = p if p is not None and p in dirs[name] else None
                break
        head = head if head is not None else steps[-1]
        order = [s for s in reversed(steps) if s <= head] + [s for s in reversed(steps) if s > head]
        return [_Candidate(n, s, dirs[n][s]) for s in order for n, _ in locs if s in dirs[n]]

    def _nothing_message(self, step: int | str) -> str:
        where = self.url + (f" (or mirror {self.mirror.url})" if self.mirror else "")
        if step == "latest":
            return f"no checkpoint in {where}"
        return f"no checkpoint for step {step} in {where} (have: {self.steps()})"

    # ---------------------------------------------------------------------- inspecting --
    def steps(self) -> list[int]:
        return sorted(self.primary.manifests()[0])

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints (valid manifest; payload not re-read), by step number."""
        self._raise_pending()
        good, _ = self.primary.manifests()
        return [
            CheckpointInfo(
                step=m.step,
                url=m.url,
                format=m.format,
                time=m.time,
                bytes=m.bytes,
                world_size=m.world_size,
                metadata=m.metadata,
            )
            for _, m in sorted(good.items())
        ]

    def latest_step(self) -> int | None:
        """The step ``latest`` names (if committed), else the newest committed step."""
        good, _ = self.primary.manifests()
        return self.primary.head(sorted(good))

    def manifest(self, step: int | str = "latest") -> Manifest:
        loc, step_dir = self._resolve(step)
        return loc.read_manifest(step_dir)

    def _resolve(self, step: int | str) -> tuple[_Location, str]:
        if isinstance(step, str) and step != "latest" and not step.isdigit():
            n = parse_step_dir(step)
            if n is None:
                storage = open_storage(step, self._storage_options)
                return _Location(storage, storage.root), storage.root
            step = n
        good, _ = self.primary.manifests()
        if step == "latest":
            head = self.primary.head(sorted(good))
            if head is None:
                raise NoCheckpointError(f"no checkpoint in {self.url}")
            step = head
        s = int(step)
        dirs = self.primary.step_dirs()
        if s not in dirs:
            raise NoCheckpointError(
                f"no checkpoint for step {s} in {self.url} (have {sorted(good)})"
            )
        return self.primary, dirs[s]

    def verify(self, step: int | str = "latest") -> VerifyReport:
        """Re-read every file of one checkpoint (streaming, constant memory) against its
        manifest. Raises NoCheckpointError only when there is no such checkpoint at all."""
        self._raise_pending()
        loc, step_dir = self._resolve(step)
        url = loc.storage.url(step_dir)
        try:
            manifest = loc.read_manifest(step_dir)
        except FileNotFoundError:
            return VerifyReport(None, url, False, problems=(f"{url}: no manifest.json",))
        except CheckpointError as e:
            return VerifyReport(None, url, False, problems=(str(e),))
        reports = []
        for f in manifest.files:
            problem = loc.storage.verify(loc.storage.join(step_dir, f.path), f, self._io)
            reports.append(FileReport(f.path, problem is None, f.size, problem or ""))
        problems = tuple(r.problem for r in reports if not r.ok)
        if not problems:
            with self._lock:
                self._verified.add((loc.url, manifest.step, manifest.save_id))
        return VerifyReport(
            step=manifest.step,
            url=url,
            ok=not problems,
            files=tuple(reports),
            problems=problems,
            bytes_checked=sum(r.size for r in reports),
        )

    def inspect(self, step: int | str = "latest") -> dict[str, Any]:
        """Manifest summary, files and every tensor's dtype and shape (no payload read)."""
        loc, step_dir = self._resolve(step)
        manifest = loc.read_manifest(step_dir)
        fmt = get_format(manifest.format)()
        desc = fmt.describe(manifest, self._load_ctx(loc, step_dir))
        body = manifest.body()
        body.pop("format_data")
        body["url"] = manifest.url
        body["bytes"] = manifest.bytes
        body["types"] = desc.get("types", {})
        body["tensors"] = desc["tensors"]
        return body

    # ---------------------------------------------------------------------------- pruning --
    def prune(self, *, dry_run: bool = False) -> builtins.list[int]:
        """Apply the retention policy now; return the deleted steps (rank 0 only; other ranks
        return []). Never deletes the newest verified checkpoint (verifying from the newest down
        until one passes), one being written or loaded, or anything that is not a checkpoint
        (foreign files and directories stay)."""
        self._raise_pending()
        if self.rank != 0:
            return []
        return self._prune_location(self.primary, dry_run=dry_run)

    def _prune_location(self, loc: _Location, *, dry_run: bool = False) -> builtins.list[int]:
        if not self.retention.active:
            return []
        good, _ = loc.manifests()
        if not good:
            return []
        head = loc.head(sorted(good))
        with self._lock:
            protected = set(self._protected)
        if self._mirror_worker is not None:
            protected |= self._mirror_worker.busy_steps()
        protected.add(self._newest_verified(loc, good, head))
        doomed = self.retention.select(
            {s: m.metadata for s, m in good.items()}, head=head, protected=protected
        )
        if not dry_run:
            for s in doomed:
                loc.remove_checkpoint(loc.step_dir(s))
        return doomed

    def _newest_verified(
        self, loc: _Location, good: Mapping[int, Manifest], head: int | None
    ) -> int:
        order = [s for s in sorted(good, reverse=True) if head is None or s <= head]
        for s in order:
            m = good[s]
            with self._lock:
                known = (loc.url, s, m.save_id) in self._verified
            if known:
                return s
            ok = all(
                loc.storage.verify(loc.storage.join(loc.step_dir(s), f.path), f, self._io) is None
                for f in m.files
            )
            if ok:
                with self._lock:
                    self._verified.add((loc.url, s, m.save_id))
                return s
        return order[0] if order else max(good)

    # -------------------------------------------------------------------------- lifecycle --
    def wait_mirror(self, timeout: float | None = None) -> None:
        """Block until the newest committed checkpoint is on the mirror; raise MirrorError if
        copying it failed."""
        self.wait()
        if self._mirror_worker is not None:
            self._mirror_worker.wait(timeout)

    def close(self) -> None:
        """Finish the save in flight and the mirror copy, then release buffers and threads."""
        if self._closed:
            return
        try:
            self.wait()
            if self._mirror_worker is not None:
                self._mirror_worker.close()
        finally:
            self._closed = True
            self._io.close()
            self._arena.release()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointStore is closed; create a new one")

    def _raise_pending(self) -> None:
        with self._lock:
            err, self._pending = self._pending, None
        if err is not None:
            raise err


def _versions() -> dict[str, str]:
    import fsspec

    return {
        "ckptstore": __version__,
        "torch": torch.__version__,
        "fsspec": fsspec.__version__,
        "orjson": orjson.__version__,
        "python": platform.python_version(),
    }


def _own_storage(v: Any) -> Any:
    """Tensors handed back to the caller get storage of their own: loaded tensors are views
    into one read buffer, and some torch APIs (``torch.set_rng_state``!) ignore a view's
    storage offset."""
    if isinstance(v, torch.Tensor):
        whole = v.storage_offset() == 0 and v.untyped_storage().nbytes() == v.nbytes
        return v if whole else v.clone()
    if isinstance(v, dict):
        out = type(v)((k, _own_storage(x)) for k, x in v.items())
        if hasattr(v, "_metadata"):
            out._metadata = v._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(v, list):
        return [_own_storage(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_own_storage(x) for x in v)
    return v


def _load_state_dict(target: Any, value: Any, strict: bool, where: str) -> None:
    fn = target.load_state_dict
    try:
        accepts_strict = "strict" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        accepts_strict = False
    try:
        out = fn(value, strict=strict) if accepts_strict else fn(value)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
        raise IncompatibleCheckpointError(
            f"{where}.load_state_dict() refused the checkpoint: {e}"
        ) from e
    missing = getattr(out, "missing_keys", None)
    unexpected = getattr(out, "unexpected_keys", None)
    if not strict and (missing or unexpected):
        _warn(f"ckptstore: {where}: missing keys {missing}, unexpected keys {unexpected}")


def _read_torch_save(
    storage: Storage, path: str, keys: Sequence[str] | None, strict: bool
) -> tuple[Manifest, dict[str, Any]]:
    """A plain torch.save file (e.g. from before ckptstore), read with weights_only=True."""
    import io
    import pickle

    url = storage.url(path)
    try:
        data = storage.read_small(path)
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CorruptCheckpointError(
            f"{url}: refused: not loadable with weights_only=True ({first}); ckptstore never "
            "unpickles arbitrary objects, which could run code. Load it yourself only if you "
            "trust its origin, and re-save with ckptstore"
        ) from None
    if not isinstance(obj, dict):
        obj = {"model": obj}
    want = list(obj) if keys is None else list(keys)
    missing = [k for k in want if k not in obj]
    if missing and strict:
        raise IncompatibleCheckpointError(f"{url} has no {missing} (it has {sorted(obj)})")
    values = {k: obj[k] for k in want if k in obj}
    step = obj.get("step", -1)
    manifest = Manifest(
        step=step if isinstance(step, int) else -1,
        format="torch.save",
        time=0.0,
        world_size=1,
        files=(),
        url=url,
    )
    return manifest, values


class _MirrorWorker:
    """Copies each committed checkpoint to the mirror in the background (newest wins when the
    mirror falls behind), verifying every chunk on the way; then the mirror's own manifest and
    pointer; then retention on the mirror."""

    def __init__(self, store: CheckpointStore) -> None:
        assert store.mirror is not None
        self.store, self.dst = store, store.mirror
        self.io = IOEngine(store._io.options)
        self._cv = threading.Condition()
        self._pending: tuple[Manifest, float] | None = None
        self._busy: int | None = None
        self._error: MirrorError | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, manifest: Manifest, t0: float) -> None:
        with self._cv:
            self._pending = (manifest, t0)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ckptstore-mirror", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()

    def busy_steps(self) -> set[int]:
        with self._cv:
            out = {self._busy} if self._busy is not None else set()
            if self._pending is not None:
                out.add(self._pending[0].step)
            return out

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._pending is None:
                    return
                (manifest, t0), self._pending = self._pending, None
                self._busy = manifest.step
            try:
                self._copy(manifest, t0)
                err = None
            except Exception as e:
                err = MirrorError(
                    f"mirroring step {manifest.step} to {self.dst.url} failed (the primary copy "
                    f"is fine; the next checkpoint will be mirrored again): {e}"
                )
                _warn(f"ckptstore: {err}")
            with self._cv:
                self._busy = None
                self._error = err
                self._cv.notify_all()

    def _copy(self, manifest: Manifest, t0: float) -> None:
        src = self.store.primary
        step = manifest.step
        src_dir, dst_dir = src.step_dir(step), self.dst.step_dir(step)
        self.dst.storage.makedirs(dst_dir)
        for f in manifest.files:
            payload = _FilePayload(src.storage, src.storage.join(src_dir, f.path), f)
            got = self.dst.storage.write_payload(
                self.dst.storage.join(dst_dir, f.path), payload, self.io, background=True
            )
            if got.checksum != f.checksum or got.size != f.size:
                raise CorruptCheckpointError(f"{f.path}: copy does not match the manifest")
        self.dst.storage.write_small(
            self.dst.storage.join(dst_dir, MANIFEST_NAME), manifest.to_json()
        )
        self.dst.write_pointer(step)
        store = self.store
        with store._lock:
            store._verified.add((self.dst.url, step, manifest.save_id))
            store._completed.append(
                SaveStats(
                    step=step,
                    bytes=manifest.bytes,
                    blocking_s=0.0,
                    total_s=store._clock() - t0,
                    durable_at=store._wall(),
                    url=self.dst.storage.url(dst_dir),
                    format=manifest.format,
                    target="mirror",
                )
            )
        if store.retention.active:
            store._prune_location(self.dst)

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending is not None or self._busy is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"mirror copy to {self.dst.url} still running")
                self._cv.wait(left)
            err = self._error
        if err is not None:
            raise err

    def close(self) -> None:
        try:
            self.wait()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self.io.close()


class _FilePayload:
    """A committed file read back chunk by chunk (verified) to be written elsewhere."""

    def __init__(self, storage: Storage, path: str, entry: FileEntry) -> None:
        self.storage, self.path, self.entry, self.size = storage, path, entry, entry.size
        self._io = IOEngine(IOOptions(threads=1))

    def fill(self, offset: int, out: torch.Tensor) -> None:
        # Inline (threads=1 engine of its own): this runs inside the writer's pool already.
        self.storage.read_into(self.path, self.entry, [Dest(offset, out)], _InlineIO(self._io))

    def view(self, offset: int, length: int) -> torch.Tensor | None:
        return None


class _InlineIO(IOEngine):
    """An IOEngine whose map() runs in the calling thread (no nested pools)."""

    def __init__(self, base: IOEngine) -> None:
        super().__init__(base.options)
        self._base = base

    def map(self, fn: Callable[[Any], Any], items: Any, background: bool) -> list[Any]:
        return [fn(x) for x in items]

    @property
    def staging(self) -> Any:
        return self._base.staging
