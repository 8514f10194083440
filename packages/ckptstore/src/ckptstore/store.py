"""CheckpointStore: save / verify / load / prune checkpoints on any fsspec URL.

Commit protocol (DESIGN.md): every rank's payload is made durable first, then rank 0 writes
``manifest.json`` (the commit), then moves the ``latest`` pointer. A directory without a valid
manifest is not a checkpoint. Payload file names carry a per-save token, so re-saving a step never
overwrites the files its current manifest points at: a crash at any instant leaves the previous
checkpoint loadable.

The store composes parts with seams of their own: ``layout`` (where an experiment lives, step
specs, scans), ``storage`` (bytes and the I/O engine), ``lock`` (one writer), ``mirror`` (the
second copy) and ``reading`` (candidates tried on every rank).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

from ._dist import broadcast, dist_info
from .buffers import Arena
from .errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    LockedError,
    MirrorError,
    NoCheckpointError,
    StoreConfigError,
    StoreUnreachableError,
    unreachable,
    unreachable_error,
    warn,
)
from .foreign import foreign_kind
from .formats import FORMATS, CheckpointFormat, get_format
from .layout import ExperimentLocation, Location, Scan, StepSpec
from .limits import CallLimits
from .lock import DEFAULT_LEASE_S, LockInfo, WriterLock
from .manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointInfo,
    FileReport,
    Manifest,
    SaveStats,
    SaveTimings,
    VerifyReport,
)
from .mirror import Mirror, MirrorCopy, check_locations
from .reading import (
    Candidate,
    Loaded,
    Reader,
    Request,
    Skip,
    apply_values,
    candidates,
    no_checkpoint,
    read_torch_save,
)
from .retention import DEFAULT_BEST_METRIC, InUse, Pruning, RetentionPolicy
from .saving import SaveHandle, SaveHooks, Saver
from .storage import IOEngine, IOOptions, Storage, open_storage
from .storage.registry import STORAGES

__all__ = ["CheckpointStore", "CheckpointWarning", "SaveHandle"]


def _newest(heads: Sequence[tuple[float, int, Location]]) -> tuple[Location, int]:
    """The location and step of the newest commit (by commit time, then step)."""
    _, step, loc = max(heads, key=lambda h: (h[0], h[1]))
    return loc, step


def _checkpoint_error(e: BaseException, url: str) -> CheckpointError:
    if unreachable(e):
        return unreachable_error(e, url)
    return e if isinstance(e, CheckpointError) else CheckpointError(str(e))


def check_plugins() -> None:
    """Every installed format and storage plugin (the ``ckptstore.formats`` and
    ``ckptstore.storage`` entry points) is usable; else PluginError naming the one that is
    not. Both CLIs call it at their start."""
    FORMATS.check()
    STORAGES.check()


def _unresolved(err: CheckpointError, url: str) -> CheckpointError:
    """At the start, an endpoint whose name does not resolve is a typo far more often than an
    outage: a setting error (exit 2), not a retry for the whole allocation."""
    e: BaseException | None = err
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, socket.gaierror):
            bad = StoreConfigError(
                f"the store's host name does not resolve ({e}) at {url}: fix the endpoint "
                "(endpoint_url in --storage-options, AWS_ENDPOINT_URL) or the URL; nothing "
                "was written"
            )
            bad.__cause__ = err
            return bad
        e = e.__cause__ or e.__context__
    return err


def _release(locks: Sequence[WriterLock]) -> None:
    for lk in locks:
        lk.release()


class CheckpointStore:
    """Verified, atomic, optionally async checkpoints under ``url[/experiment]``.

    Every rank of a ``torch.distributed`` job constructs the store (it creates a private gloo
    group) and calls ``save``/``load``; rank 0 commits, lists, prunes and mirrors, and holds
    the experiment's one-writer lock from its first save (or ``acquire()``) until ``close()``.
    ``url`` may also be a ``Storage`` object (e.g. a wrapper around ``open_storage(url)``).

    Args:
        url: Where the checkpoints go: a local folder or an fsspec URL (``s3://bucket/run``),
            or a ``Storage`` object.
        format: The checkpoint format, by its registered name: ``"torch"`` (default: one
            safetensors file), ``"dcp"`` (sharded) or a plugin's (``available_formats()``).
        keep_last: Keep the newest K checkpoints (None: keep all); the newest verified one is
            never deleted.
        keep_every: Also keep every checkpoint whose step is a multiple of N (milestones).
        keep_best: Also keep the K best by ``metadata[best_metric]``.
        best_metric: The metadata key ``keep_best`` ranks by.
        best_mode: ``"min"`` or ``"max"``: which end of ``best_metric`` is best.
        mirror: A second location (folder, URL or ``Storage``) each committed checkpoint is
            copied to in the background, read back and CRC-checked on the way.
        storage_options: fsspec options of ``url`` (e.g. ``{"endpoint_url": ...}``).
        mirror_storage_options: fsspec options of ``mirror``.
        experiment: A sub-folder of ``url`` (and of ``mirror``) that holds this run.
        io: How hard to push the disk: threads, piece size, O_DIRECT (``IOOptions``).
        distributed: None: use ``torch.distributed`` when it is initialized; False: this
            process alone; True: require it.
        lock: Take the experiment's one-writer lock at the first save (False: no lock, for
            a reader that never saves).
        lease_s: Seconds the writer lock lasts without a renewal (renewed every quarter).
        clock: Monotonic seconds, for durations (tests inject a fake).
        wall_clock: Epoch seconds, for commit times and the lock.
    """

    def __init__(
        self,
        url: str | Storage,
        *,
        format: str = "torch",
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str = DEFAULT_BEST_METRIC,
        best_mode: str = "min",
        mirror: str | Storage | None = None,
        storage_options: dict[str, Any] | None = None,
        mirror_storage_options: dict[str, Any] | None = None,
        experiment: str | None = None,
        io: IOOptions | None = None,
        distributed: bool | None = None,
        lock: bool = True,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.retention = RetentionPolicy(
            keep_last=keep_last,
            keep_every=keep_every,
            keep_best=keep_best,
            best_metric=best_metric,
            best_mode=best_mode,
        )
        self.primary = Location.open(url, experiment, storage_options)
        self.mirror = Location.open(mirror, experiment, mirror_storage_options) if mirror else None
        if self.mirror is not None:
            check_locations(self.primary, self.mirror)
        self.experiment, self.url = experiment, self.primary.url
        self.format_name = format
        self._format: CheckpointFormat = get_format(format)()
        self._storage_options = storage_options
        self._clock, self._wall = clock, wall_clock
        self.rank, self.world_size, self._group = dist_info(distributed)
        self._init_state(io)
        self._made = self._folders_to_make() if self.rank == 0 else []
        self._writers = self._make_locks(lock, lease_s)
        self._release_locks = weakref.finalize(self, _release, list(self._writers))
        self._mirror = self._make_mirror()

    def _init_state(self, io: IOOptions | None) -> None:
        self._io = IOEngine(io)
        self._arena = Arena()
        self._mutex = threading.Lock()
        self._completed: list[SaveStats] = []
        self._timings = SaveTimings()
        self._newest_commit = 0.0  # the latest commit time seen in this experiment
        self._verified: set[tuple[str, int, str]] = set()  # (root url, step, save_id) we know
        self._in_use = InUse()  # steps being written or loaded: never pruned
        self._warned: set[tuple[str, int, str]] = set()
        self._reader = Reader(
            rank=self.rank, world_size=self.world_size, group=self._group, io=self._io
        )
        hooks = SaveHooks(
            writer_error=self._writer_error,
            may_commit=self._may_commit,
            committed=self._committed,
            in_use=self._in_use,
        )
        dist = (self.rank, self.world_size, self._group)
        self._saver = Saver(
            self.primary,
            self._format,
            self.format_name,
            dist=dist,
            io=self._io,
            arena=self._arena,
            session=broadcast(self._group, uuid.uuid4().hex[:8]),
            hooks=hooks,
            clock=self._clock,
            wall=self._commit_clock,
        )
        self._closed = False

    def _commit_clock(self) -> float:
        """Now, but never before a commit this store has seen: commit times order the
        experiment's checkpoints (``latest`` is the newest commit), also after a requeue onto
        a host whose clock is behind the previous one's."""
        return max(self._wall(), self._newest_commit + 1e-3)

    def _seen(self, commit_time: float) -> None:
        with self._mutex:
            self._newest_commit = max(self._newest_commit, commit_time)

    def _make_locks(self, lock: bool, lease_s: float) -> list[WriterLock]:
        if not lock or self.rank != 0:
            return []
        locs = [self.primary] + ([self.mirror] if self.mirror else [])
        return [WriterLock(loc.storage, loc.root, lease_s=lease_s, wall=self._wall) for loc in locs]

    def _folders_to_make(self) -> builtins.list[str]:
        """The local folders of the experiment (and its mirror) that do not exist yet, deepest
        first: the writer lock creates them, and a store that committed nothing removes them
        again at ``close()`` (a refused save leaves no empty folder to resume from)."""
        out: builtins.list[str] = []
        for loc in self._locations().values():
            folder = loc.where.local_path
            while folder and not os.path.exists(folder) and folder != os.path.dirname(folder):
                out.append(folder)
                folder = os.path.dirname(folder)
        return out

    def _remove_made_folders(self) -> None:
        for folder in self._made:  # only while empty: a checkpoint, or anyone's file, stays
            with contextlib.suppress(OSError):
                os.rmdir(folder)

    def _make_mirror(self) -> Mirror | None:
        if self.mirror is None or self.rank != 0:
            return None
        return Mirror(
            self.primary, self.mirror, self._io.options, on_copied=self._mirrored, clock=self._clock
        )

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r}, format={self.format_name!r})"

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------ where, who --
    @property
    def location(self) -> ExperimentLocation:
        """Where this experiment lives: ``url`` (``~`` expanded) and, on a local disk, its
        folder (``local_path``), e.g. for logs kept beside the checkpoints."""
        return self.primary.where

    @property
    def local_path(self) -> str | None:
        """The experiment's local folder, or None when the store is not on a local disk."""
        return self.primary.where.local_path

    @property
    def writer(self) -> LockInfo | None:
        """The one-writer lock this process holds on the experiment (rank 0), or None."""
        return self._writers[0].info if self._writers else None

    def acquire(self) -> LockInfo | None:
        """Become the experiment's one writer now (every rank calls; rank 0 takes the lock).
        ``save()`` and ``prune()`` do this themselves; call it at start-up to refuse before
        any work is done. LockedError (on every rank) names the run that holds it."""
        self._check_open()
        err = self._writer_error(starting=True) if self.rank == 0 else None
        got = broadcast(self._group, None if err is None else (type(err).__name__, str(err)))
        if err is not None:
            raise err
        if got is not None:
            kinds = {
                t.__name__: t
                for t in (LockedError, StoreUnreachableError, StoreConfigError, MirrorError)
            }
            raise kinds.get(got[0], CheckpointError)(got[1])
        return self.writer

    def _writer_error(self, *, starting: bool = False) -> CheckpointError | None:
        """Rank 0: None while this process holds the lock (taking it when needed). A mirror
        that cannot be locked is written anyway; ``starting``: unless it refused (a missing
        bucket, no permission), which a run is told before it starts."""
        for i, lk in enumerate(list(self._writers)):
            if lk.lost is not None:
                return lk.lost
            try:
                lk.acquire()
            except LockedError as e:
                return e
            except (OSError, CheckpointError) as e:
                if i == 0:
                    err = _checkpoint_error(e, lk.url)
                    return _unresolved(err, lk.url) if starting else err
                if starting and not unreachable(e):
                    return MirrorError(
                        f"the mirror {lk.url} cannot be written ({e}): fix it, or drop the mirror"
                    )
                warn(f"ckptstore: mirror {lk.url} cannot be locked, writing it anyway: {e}")
                self._writers.remove(lk)
        return None

    # ---------------------------------------------------------------------------- saving --
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metadata: Mapping[str, Any] | None = None,
        blocking: bool = True,
        overlap: bool = False,
    ) -> SaveHandle:
        """Save ``state`` as ``step``. Blocking: returns once committed. Non-blocking: returns
        after a CPU snapshot; the write runs in the background (one at a time: a second save
        first waits for the previous one) and ``latest`` moves only once it is durable.

        ``overlap`` (non-blocking only): return before the snapshot too. It is taken while the
        caller goes on with work that reads the state but does not change it (the next
        forward and backward; on CUDA the copies run on a side stream beside them); call
        :meth:`staged` before changing it (the optimizer step). A change made while the
        snapshot is taken fails the save (nothing is written; the error surfaces as any)."""
        self._check_open()
        return self._saver.save(step, state, metadata, blocking, overlap)

    def staged(self) -> None:
        """Return once the state of the save in flight may change: its snapshot is taken (for
        an ``overlap`` save on CUDA the current stream waits for the copies, the host does
        not). At once when no overlapped save is in flight."""
        self._saver.staged()

    def reserve(self, state: Mapping[str, Any]) -> None:
        """Prepare for async saves of ``state`` (call once, e.g. before training starts):
        allocate the snapshot buffer and touch its memory in the background, so the first
        ``save(..., blocking=False)`` blocks only for the copy, not for fresh memory."""
        self._check_open()
        self._saver.reserve(state)

    def _may_commit(self) -> None:
        if self._writers and self._writers[0].lost is not None:
            raise self._writers[0].lost  # another run holds the experiment now: commit nothing

    def _committed(self, manifest: Manifest, stats: SaveStats) -> None:
        """The saver's callback on the coordinator, once the pointer moved."""
        with self._mutex:
            self._verified.add((self.primary.url, manifest.step, manifest.save_id))
            self._completed.append(stats)
            self._timings = self._timings.add(stats)
        self._seen(manifest.time)
        self._after_commit(manifest.step, manifest)

    def _after_commit(self, step: int, manifest: Manifest) -> None:
        """Housekeeping that must never fail a committed save: stale files, mirror, prune."""
        loc, keep = self.primary, [f.path for f in manifest.files] + [MANIFEST_NAME]
        # Everything of this save is renamed into place by now: what else is ours in its folder
        # (temp files included) is left from an earlier, interrupted save of this step.
        superseded = functools.partial(loc.remove_own_files, loc.step_dir(step), keep)
        self._housekeep(f"remove superseded files of step {step} in", superseded)
        sweep = functools.partial(
            loc.sweep_interrupted, below=step, protected=self._protected_now()
        )
        self._housekeep("remove what interrupted saves left in", sweep)
        if self._mirror is not None:
            self._mirror.submit(manifest)
        if self.retention.active:
            self._housekeep("prune", lambda: self._prune_location(self.primary))

    def _housekeep(self, what: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as e:  # the checkpoint is committed: nothing is lost
            warn(f"ckptstore: could not {what} {self.url} (the checkpoint is committed): {e}")

    def _protected_now(self) -> set[int]:
        busy = self._mirror.busy_steps() if self._mirror is not None else set()
        return self._in_use.snapshot() | busy

    def _mirrored(self, copy: MirrorCopy) -> None:
        """The mirror's callback: record the copy, then apply retention there."""
        m = copy.manifest
        stats = SaveStats(
            step=m.step,
            bytes=m.bytes,
            blocking_s=0.0,
            total_s=copy.seconds,
            durable_at=self._wall(),
            url=copy.url,
            format=m.format,
            target="mirror",
            background=True,
        )
        assert self.mirror is not None
        with self._mutex:
            self._verified.add((self.mirror.url, m.step, m.save_id))
            self._completed.append(stats)
        if self.retention.active:
            self._prune_location(self.mirror)

    def wait(self) -> None:
        """Block until the save in flight is durable; re-raise a background failure. Bounded
        by the limits (:meth:`set_limits`): past them, StoreUnreachableError."""
        self._saver.wait()

    def set_limits(self, limits: CallLimits) -> None:
        """How long each wait on the store may last from now on (each request of an object
        store, the save in flight): a trainer derives them from its time budget and its stop
        flag, so a store that stalls can neither hold it past its deadline nor keep it deaf
        to a stop. Default: ``CallLimits()`` (each call at most 300 s)."""
        self._saver.limits = limits
        for loc in (self.primary, self.mirror):
            if loc is not None and hasattr(loc.storage, "limits"):
                loc.storage.limits = limits

    def saves_completed(self) -> list[SaveStats]:
        """Stats of saves (and mirror copies) committed since the last call, oldest first."""
        with self._mutex:
            out, self._completed = self._completed, []
        return out

    @property
    def save_in_flight(self) -> bool:
        """Whether a background save is still being written (a new save would wait for it)."""
        return self._saver.in_flight

    @property
    def save_timings(self) -> SaveTimings:
        """Measured durations of this store's committed saves (not drained by reading)."""
        with self._mutex:
            return self._timings

    # ---------------------------------------------------------------------------- loading --
    def load(
        self, state: MutableMapping[str, Any], step: int | str = "latest", *, strict: bool = True
    ) -> Manifest:
        """Restore ``state`` in place from a verified checkpoint and return its manifest.

        Objects with ``load_state_dict`` and tensors are restored in place; every other entry
        (ints, dicts of RNG states, ...) is *replaced* in ``state``: read it back from there.
        ``step``: "latest" (the newest commit on the primary or the mirror; falls back, with a
        warning, to the newest checkpoint that verifies), a step number, a step directory name,
        or a path/URL of a checkpoint directory (or of a plain ``torch.save`` file, read with
        ``weights_only=True``). The mirror is tried when the primary copy is missing or
        corrupt. With ``strict``, every key of ``state`` must be in the checkpoint (extra
        checkpoint keys are fine) and modules load with ``strict=True``.
        """
        self._check_open()
        self.wait()
        manifest, values = self._read(step, list(state.keys()), like=state, strict=strict)
        apply_values(state, values, strict)
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
    ) -> Loaded:
        spec = StepSpec.parse(step)
        request = Request(keys=keys, like=like, strict=strict, latest=spec.latest)
        if spec.path is not None:
            return self._read_path(spec.path, request)
        locs = self._locations()
        cands = broadcast(self._group, self._planned(locs, spec) if self.rank == 0 else None)
        if isinstance(cands, str):  # every rank refuses alike
            raise IncompatibleCheckpointError(cands)
        if not cands:
            raise no_checkpoint(self._where(), spec.step, self.steps())
        result, skipped = self._reader.first_loadable(cands, locs, request, self._in_use.holding)
        if result is not None:
            return result
        if not spec.latest:  # an explicit step never silently becomes another one
            raise CorruptCheckpointError(" | ".join(skipped))
        raise NoCheckpointError(f"no loadable checkpoint in {self.url}: " + " | ".join(skipped))

    def _planned(self, locs: dict[str, Location], spec: StepSpec) -> builtins.list[Candidate] | str:
        """Rank 0: the candidates, or why "latest" is refused (for every rank to raise)."""
        try:
            return self._candidates(locs, spec)
        except IncompatibleCheckpointError as e:
            return str(e)

    def _candidates(self, locs: dict[str, Location], spec: StepSpec) -> builtins.list[Candidate]:
        """Rank 0: for "latest", the newest commit first; a `latest` pointer naming a step whose
        manifest was damaged since its commit goes before it, so that its skip is warned."""
        if not spec.latest:
            return candidates(locs, spec.step)
        scans = self._scans(quiet=True)
        heads = self._heads(scans)
        damaged = [s.pointer for _, s in scans if s.pointer is not None and s.pointer in s.broken]
        first = ([_newest(heads)[1]] if heads else []) + damaged
        return candidates(locs, None, max(first) if first else None)

    def _read_path(self, path: str, request: Request) -> Loaded:
        storage = open_storage(path, self._storage_options)
        loc = Location(storage, storage.root)
        if storage.exists(loc.path(MANIFEST_NAME)):
            result = self._reader.try_one(loc, Candidate("external", -1, loc.root), request)
            if isinstance(result, Skip):
                raise CorruptCheckpointError(result.reason)
            return result
        if not storage.exists(loc.root):
            raise NoCheckpointError(f"{path}: no such checkpoint directory or file")
        kind, line = foreign_kind(path, self._storage_options)
        if kind != "torch.save":  # a plain torch.save file still loads, with weights_only
            raise IncompatibleCheckpointError(line or f"{path}: not a checkpoint")
        return read_torch_save(storage, loc.root, request)

    def _locations(self) -> dict[str, Location]:
        return {"primary": self.primary, **({"mirror": self.mirror} if self.mirror else {})}

    def _where(self) -> str:
        return self.url + (f" (or mirror {self.mirror.url})" if self.mirror else "")

    # ---------------------------------------------------------------------- inspecting --
    def scan(self) -> Scan:
        """Every step folder of the experiment (primary), judged by its manifest: committed
        checkpoints, broken ones (with why), incomplete saves, and what ``latest`` names."""
        return self.primary.scan()

    def _scan(self, loc: Location) -> Scan:
        """A scan that warns (once per problem) about step folders it cannot trust."""
        scan = loc.scan()
        for step, why in scan.broken.items():
            if (loc.url, step, why) not in self._warned:
                self._warned.add((loc.url, step, why))
                warn(f"ckptstore: step {step} in {loc.url} cannot be trusted, skipped: {why}")
        return scan

    def experiments(self) -> builtins.list[str]:
        """Experiment folders below this store's folder (when it was pointed at a root)."""
        return self.primary.experiments()

    def steps(self) -> builtins.list[int]:
        return sorted(self._scan(self.primary).checkpoints)

    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints (valid manifest; payload not re-read), by step number; step
        folders whose manifest cannot be trusted are left out with a warning (see ``scan``)."""
        self._raise_pending()
        good = self._scan(self.primary).checkpoints
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
        """The step ``latest`` names: the newest commit (by commit time) on the primary or the
        mirror, the one its pointer names if committed, else its newest committed step."""
        heads = self._heads()
        return _newest(heads)[1] if heads else None

    def _heads(
        self, scans: builtins.list[tuple[Location, Scan]] | None = None
    ) -> builtins.list[tuple[float, int, Location]]:
        """(commit time, step, location) of each location's newest commit. The newest written
        by a newer ckptstore is refused (IncompatibleCheckpointError), never passed over."""
        out = []
        for loc, scan in self._scans() if scans is None else scans:
            if scan.newer_latest:
                raise IncompatibleCheckpointError(scan.newer_latest)
            if scan.head is not None:
                out.append((scan.checkpoints[scan.head].time, scan.head, loc))
                self._seen(out[-1][0])
        return out

    def _scans(self, *, quiet: bool = False) -> builtins.list[tuple[Location, Scan]]:
        """The primary's scan and the mirror's (an unreachable mirror is left out, warned);
        ``quiet``: broken step folders are not warned about here (a load warns as it skips)."""
        scans = [(loc, self._scan_reachable(n, loc, quiet)) for n, loc in self._locations().items()]
        return [(loc, scan) for loc, scan in scans if scan is not None]

    def _scan_reachable(self, name: str, loc: Location, quiet: bool) -> Scan | None:
        try:
            return loc.scan() if quiet else self._scan(loc)
        except (OSError, CheckpointError) as e:
            if name == "primary":
                raise
            warn(f"ckptstore: mirror {loc.url} unreachable, using the primary alone: {e}")
            return None

    def _latest(self) -> tuple[Location, int]:
        heads = self._heads()
        if not heads:
            raise NoCheckpointError(f"no checkpoint in {self._where()}")
        return _newest(heads)

    def manifest(self, step: int | str = "latest") -> Manifest:
        loc, step_dir = self._resolve(step)
        return loc.read_manifest(step_dir)

    def _resolve(self, step: int | str) -> tuple[Location, str]:
        spec = StepSpec.parse(step)
        if spec.path is not None:
            storage = open_storage(spec.path, self._storage_options)
            return Location(storage, storage.root), storage.root
        if spec.step is None:
            loc, s = self._latest()
            return loc, loc.step_dir(s)
        for loc in self._locations().values():
            d = loc.step_dirs().get(spec.step)
            if d is not None:
                return loc, d
        raise NoCheckpointError(
            f"no checkpoint for step {spec.step} in {self._where()} (have {self.steps()})"
        )

    def verify(self, step: int | str = "latest") -> VerifyReport:
        """Re-read every file of one checkpoint (streaming, constant memory) against its
        manifest. ``latest`` naming a step folder that cannot be trusted fails here too.
        Raises NoCheckpointError only when there is no such checkpoint at all."""
        self._raise_pending()
        if StepSpec.parse(step).latest and (report := self._verify_pointer()) is not None:
            return report
        loc, step_dir = self._resolve(step)
        return self._verify_dir(loc, step_dir)

    def _verify_pointer(self) -> VerifyReport | None:
        scan = self.primary.scan()
        if scan.newer_latest:
            url, why = self.primary.url, scan.newer_latest
            newer = "NEEDS A NEWER CKPTSTORE"
            return VerifyReport(scan.newer_latest_step, url, False, problems=(why,), verdict=newer)
        if not scan.pointer_problem:
            return None
        p = scan.pointer
        url = self.primary.storage.url(
            self.primary.step_dir(p) if p is not None else self.primary.path(LATEST_NAME)
        )
        why = scan.pointer_problem + (f": {scan.broken[p]}" if p in scan.broken else "")
        if scan.head is not None:
            why += f" (load('latest') falls back to step {scan.head})"
        return VerifyReport(p, url, False, problems=(why,))

    def _verify_dir(self, loc: Location, step_dir: str) -> VerifyReport:
        url = loc.storage.url(step_dir)
        try:
            manifest = loc.read_manifest(step_dir)
        except FileNotFoundError:
            return VerifyReport(None, url, False, problems=(f"{url}: no manifest.json",))
        except IncompatibleCheckpointError as e:
            return VerifyReport(
                None, url, False, problems=(str(e),), verdict="NEEDS A NEWER CKPTSTORE"
            )
        except (CheckpointError, OSError) as e:
            return VerifyReport(None, url, False, problems=(str(e),))
        reports = []
        for f in manifest.files:
            problem = loc.storage.verify(loc.storage.join(step_dir, f.path), f, self._io)
            reports.append(FileReport(f.path, problem is None, f.size, problem or ""))
        problems = tuple(r.problem for r in reports if not r.ok)
        if not problems:
            with self._mutex:
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
        desc = fmt.describe(manifest, self._reader.load_ctx(loc, step_dir))
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
        (foreign files and directories stay). Takes the writer lock unless ``dry_run``."""
        return self.pruning(dry_run=dry_run).deleted

    def pruning(self, *, dry_run: bool = False) -> Pruning:
        """As :meth:`prune`, and each checkpoint kept with why (``dry_run``: what it would
        delete and keep)."""
        self._raise_pending()
        if self.rank != 0:
            return Pruning()
        if not dry_run and (err := self._writer_error()) is not None:
            raise err
        return self._prune_location(self.primary, dry_run=dry_run)

    def _prune_location(self, loc: Location, *, dry_run: bool = False) -> Pruning:
        scan = self._scan(loc)
        good, head = scan.checkpoints, scan.head
        if not good or not self.retention.active:
            return Pruning(kept=self.retention.kept(dict.fromkeys(good, {}), head=head))
        protected = dict.fromkeys(self._protected_now(), "being written, read or mirrored")
        newest = self._newest_verified(loc, good, head)
        protected[newest] = "the newest that verifies"
        kept = self.retention.kept(
            {s: m.metadata for s, m in good.items()}, head=head, protected=protected
        )
        doomed = [s for s in sorted(good) if s not in kept]
        if not dry_run:
            for s in doomed:
                loc.remove_checkpoint(loc.step_dir(s))
        return Pruning(doomed, kept)

    def _newest_verified(
        self, loc: Location, good: Mapping[int, Manifest], head: int | None
    ) -> int:
        order = [s for s in sorted(good, reverse=True) if head is None or s <= head]
        for s in order:
            if self._verifies(loc, s, good[s]):
                return s
        return order[0] if order else max(good)

    def _verifies(self, loc: Location, step: int, m: Manifest) -> bool:
        with self._mutex:
            if (loc.url, step, m.save_id) in self._verified:
                return True
        d = loc.step_dir(step)
        if any(loc.storage.verify(loc.storage.join(d, f.path), f, self._io) for f in m.files):
            return False
        with self._mutex:
            self._verified.add((loc.url, step, m.save_id))
        return True

    # -------------------------------------------------------------------------- lifecycle --
    def wait_mirror(self, timeout: float | None = None) -> None:
        """Block until the newest committed checkpoint is on the mirror; raise MirrorError if
        copying it failed."""
        self.wait()
        if self._mirror is not None:
            self._mirror.wait(timeout)

    def close(self) -> None:
        """Finish the save in flight and the mirror copy, then release the writer lock,
        buffers and threads."""
        if self._closed:
            return
        try:
            self.wait()
            if self._mirror is not None:
                self._mirror.close()
        finally:
            self._closed = True
            self._release_locks()
            self._remove_made_folders()
            self._io.close()
            self._arena.release()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointStore is closed; create a new one")

    def _raise_pending(self) -> None:
        self._saver.raise_pending()
