"""Saving: stage on every rank, persist (maybe in the background), commit on the coordinator.

A ``Saver`` owns the save pipeline of one store: the per-save file token, the one save in
flight and its failure (delivered once). Whether this process may write at all, and what a
commit means to the rest of the store (record it, tidy up, mirror, prune), reach it as
``SaveHooks``.

An *overlapped* save (``overlap=True``) returns before its snapshot is taken: the copy runs
while the caller computes (CPU: in the save's thread; CUDA: on a side stream, so the next
forward and backward run beside the device-to-host copies), and ``staged()`` is where the
caller waits before it changes the state (the optimizer step). A change made during the copy
(torch's version counters; an optimizer step bumps its step counts at least) fails the save
before anything is written.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson
import torch

from ._dist import all_gather
from ._version import __version__
from .buffers import Arena, align_up
from .errors import (
    CheckpointError,
    StoreConfigError,
    StoreUnreachableError,
    kind_of,
    unreachable,
    unreachable_error,
)
from .formats import CheckpointFormat, SaveContext, takes_dtensor
from .layout import Location, check_step
from .limits import CallLimits
from .manifest import MANIFEST_NAME, FileEntry, Manifest, SaveStats
from .retention import InUse
from .storage import IOEngine
from .tree import EncodedState, encode_state


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
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


def versions() -> dict[str, str]:
    import fsspec

    return {
        "ckptstore": __version__,
        "torch": torch.__version__,
        "fsspec": fsspec.__version__,
        "orjson": orjson.__version__,
        "python": platform.python_version(),
    }


class SaveHandle:
    """What ``save()`` returns; ``result()`` waits for durability and re-raises a failure."""

    def __init__(
        self,
        step: int,
        blocking_s: float,
        on_delivered: Callable[[BaseException], None],
        snapshot: Snapshot | None = None,
    ) -> None:
        self.step, self.blocking_s = step, blocking_s
        self._done = threading.Event()
        self._stats: SaveStats | None = None
        self._error: BaseException | None = None
        self._on_delivered = on_delivered
        self._snapshot = snapshot

    def done(self) -> bool:
        return self._done.is_set()

    def staged(self) -> None:
        """Return once the state may change: its snapshot is taken (an overlapped save on
        CUDA: the current stream waits for the copies, the host does not). At once for a
        save that took its snapshot before returning."""
        if self._snapshot is not None:
            self._snapshot.wait()

    def result(self, timeout: float | None = None) -> SaveStats:
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout} s")
        if self._error is not None:
            self._on_delivered(self._error)
            raise self._error
        assert self._stats is not None
        return self._stats

    def finish(self, stats: SaveStats | None, error: BaseException | None) -> None:
        self._stats, self._error = stats, error
        self._done.set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"SaveHandle(step={self.step}, {state}, blocking_s={self.blocking_s:.3f})"


@dataclass(frozen=True, slots=True)
class SaveHooks:
    """What the saver asks of, and tells, the store it works for."""

    writer_error: Callable[[], BaseException | None]  # rank 0: None while it may write
    may_commit: Callable[[], None]  # raises when this run lost the writer lock meanwhile
    committed: Callable[[Manifest, SaveStats], None]  # after the pointer moved (never raises)
    in_use: InUse  # the step being written is never pruned


@dataclass(kw_only=True, slots=True)
class _Save:
    """One save on its way: when it started, its context, and (coordinator) its commit."""

    t0: float
    ctx: SaveContext = field(init=False)
    manifest: Manifest | None = None
    stats: SaveStats | None = None


class Saver:
    """The save pipeline of one store (see the module docstring)."""

    def __init__(
        self,
        loc: Location,
        fmt: CheckpointFormat,
        format_name: str,
        *,
        dist: tuple[int, int, Any],
        io: IOEngine,
        arena: Arena,
        session: str,
        hooks: SaveHooks,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.loc, self.fmt, self.format_name = loc, fmt, format_name
        self.io, self.arena, self.hooks = io, arena, hooks
        self.rank, self.world_size, self.group = dist
        self._session, self._seq = session, 0
        self._clock, self._wall = clock, wall
        self._mutex = threading.Lock()
        self._thread: threading.Thread | None = None
        self._snapshot: Snapshot | None = None  # of the overlapped save in flight
        self._pending: BaseException | None = None
        self.limits = CallLimits()  # how long a wait for the save in flight may last

    @property
    def in_flight(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        metadata: Mapping[str, Any] | None,
        blocking: bool,
        overlap: bool = False,
    ) -> SaveHandle:
        self._seq += 1  # before validation, so every rank derives the same file token
        token = f"{self._session}{self._seq:05x}"
        step, meta = check_step(step), check_metadata(metadata)
        self._join()
        save = _Save(t0=self._clock())
        save.ctx = self._context(step, token, blocking, functools.partial(self._commit, save, meta))
        self.hooks.in_use.add(step)
        pending = self._take_pending()  # a background save that failed: every rank hears
        if overlap and not blocking:
            return self._overlapped(state, save, pending)
        enc, error = self._encode(state, save.ctx)
        staged, error = self._stage(enc, save.ctx, pending or error)
        # Every rank learns whether every rank staged, and whether the previous (background)
        # save failed on any: otherwise a rank that failed would leave the others waiting
        # forever in the collectives of the write.
        self._agree_ok(step, "preparing", error)
        handle = SaveHandle(step, self._clock() - save.t0, self._delivered)
        if blocking:
            self._persist(staged, save, handle)
            self._agree_ok(step, "writing", handle.error)
            return handle
        self._start(step, self._persist, staged, save, handle)
        return handle

    def _start(self, step: int, target: Callable[..., None], *args: Any) -> None:
        self._thread = threading.Thread(
            target=target,
            args=args,
            name=f"ckptstore-save-{step}",
            daemon=False,  # a durable last checkpoint matters more than a prompt exit
        )
        self._thread.start()

    def _overlapped(
        self, state: Mapping[str, Any], save: _Save, pending: BaseException | None
    ) -> SaveHandle:
        """Encode now (``state_dict()`` calls, no copies), snapshot in the background: CUDA
        copies are queued on a side stream at once, CPU copies run in the save's thread.
        ``pending``: a failed background save, which fails this one on every rank."""
        enc, error = self._encode(state, save.ctx)
        error = pending or error
        snap = Snapshot(enc.tensors if enc is not None else {})
        staged = None
        if error is None and snap.cuda:
            try:
                staged, error = snap.on_side_stream(lambda: self._stage(enc, save.ctx, None))
            except Exception as e:  # e.g. no stream to be had: this save fails, as any
                error = e
        step = save.ctx.step
        handle = SaveHandle(step, self._clock() - save.t0, self._delivered, snap)
        self._snapshot = snap
        self._start(step, self._snapshot_then_persist, enc, staged, error, snap, save, handle)
        return handle

    def _snapshot_then_persist(
        self,
        enc: EncodedState | None,
        staged: Any,
        error: BaseException | None,
        snap: Snapshot,
        save: _Save,
        handle: SaveHandle,
    ) -> None:
        """The thread of an overlapped save: the snapshot (CPU copies, or the wait for the
        CUDA ones), the check that nothing changed meanwhile, the agreement, the write."""
        try:
            if error is None and not snap.cuda:
                staged, error = self._stage(enc, save.ctx, None)
            error = snap.taken(save.ctx.step) or error
        finally:
            snap.release()  # staged() never waits for a snapshot that failed
        try:
            self._agree_ok(save.ctx.step, "preparing", error)
        except BaseException as e:
            self._failed(save, handle, e)
            return
        self._persist(staged, save, handle)

    def staged(self) -> None:
        """Wait until the save in flight (if any) has its snapshot: see SaveHandle.staged."""
        snap = self._snapshot
        if snap is not None:
            snap.wait()

    def _context(
        self,
        step: int,
        token: str,
        blocking: bool,
        commit: Callable[[Sequence[FileEntry], dict[str, Any]], None],
    ) -> SaveContext:
        return SaveContext(
            storage=self.loc.storage,
            step_dir=self.loc.step_dir(step),
            step=step,
            token=token,
            rank=self.rank,
            world_size=self.world_size,
            group=self.group,
            io=self.io,
            arena=self.arena,
            background=not blocking,
            commit=commit,
        )

    def _encode(
        self, state: Mapping[str, Any], ctx: SaveContext
    ) -> tuple[EncodedState | None, BaseException | None]:
        """(the state's tree and tensors, as this rank writes them, or the error that stops
        this save): ``state_dict()`` is called now, nothing is copied yet."""
        error = self.hooks.writer_error() if self.rank == 0 else None
        if error is not None or not self.fmt.writes_on(self.rank, self.world_size):
            return None, error
        try:
            return encode_state(state, allow_dtensor=takes_dtensor(self.fmt)), None
        except Exception as e:
            return None, e

    def _stage(
        self, enc: EncodedState | None, ctx: SaveContext, error: BaseException | None
    ) -> tuple[Any, BaseException | None]:
        """(what the format staged -- for a background save, the snapshot --, or the error
        that stops this save)."""
        if error is not None:
            return None, error
        try:
            return self.fmt.stage(enc, ctx), None
        except CheckpointError as e:  # StoreUnreachableError is an OSError too: kept as it is
            return None, e
        except OSError as e:
            return None, CheckpointError(f"cannot save step {ctx.step} under {self.loc.url}: {e}")
        except Exception as e:
            return None, e

    def reserve(self, state: Mapping[str, Any]) -> None:
        if not self.fmt.writes_on(self.rank, self.world_size):
            return
        enc = encode_state(state, allow_dtensor=takes_dtensor(self.fmt))
        nbytes = sum(align_up(_local_nbytes(t)) for t in enc.tensors.values())
        nbytes += 2 * len(orjson.dumps(enc.tree)) + (1 << 20)  # header, padding
        cuda = any(t.is_cuda for t in enc.tensors.values())
        self.arena.reserve(nbytes, pin=cuda, nice=self.io.options.background_nice)

    def _persist(self, staged: Any, save: _Save, handle: SaveHandle) -> None:
        """Write and commit; never raises: the outcome goes to the handle (and, for a
        background save, to the saver, which re-raises it at the next call)."""
        try:
            self.fmt.persist(staged, save.ctx)
            handle.finish(self._outcome(save, handle), None)
        except BaseException as e:
            self._failed(save, handle, e)
        finally:
            self.hooks.in_use.discard(save.ctx.step)

    def _failed(self, save: _Save, handle: SaveHandle, e: BaseException) -> None:
        """A save that will not commit: its error to the handle (a background one's also to
        the saver, which re-raises it at the next call)."""
        err = e
        if unreachable(e) and not isinstance(e, CheckpointError):
            err = unreachable_error(e, f"the save of step {save.ctx.step} to {self.loc.url}")
        elif not isinstance(e, CheckpointError):
            err = CheckpointError(f"save of step {save.ctx.step} to {self.loc.url} failed: {e!r}")
            err.__cause__ = e
        if save.ctx.background:
            with self._mutex:
                self._pending = err
        handle.finish(None, err)

    def _outcome(self, save: _Save, handle: SaveHandle) -> SaveStats:
        if save.stats is None or save.manifest is None:  # another rank committed
            return SaveStats(
                step=save.ctx.step,
                bytes=0,
                blocking_s=handle.blocking_s,
                total_s=self._clock() - save.t0,
                durable_at=self._wall(),
                url=self.loc.storage.url(save.ctx.step_dir),
                format=self.format_name,
                background=save.ctx.background,
            )
        stats = dataclasses.replace(
            save.stats, blocking_s=handle.blocking_s, background=save.ctx.background
        )
        self.hooks.committed(save.manifest, stats)
        return stats

    def _agree_ok(self, step: int, what: str, error: BaseException | None) -> None:
        """Under torch.distributed every rank raises if any rank failed (blocking saves also
        return only once rank 0 has committed). Outside it, just raise our own error."""
        if self.group is None:
            if error is not None:
                self.hooks.in_use.discard(step)
                raise error
            return
        said = None if error is None else (str(error), kind_of(error))
        outcomes = all_gather(self.group, said)
        failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if failed:
            self.hooks.in_use.discard(step)
            if error is not None and failed[0][0] == self.rank:
                raise error
            r, (msg, said_kind) = failed[0]  # every rank raises the same kind of error
            kind = {"down": StoreUnreachableError, "config": StoreConfigError}.get(
                said_kind, CheckpointError
            )
            raise kind(f"{what} step {step} failed on rank {r}: {msg}")

    def _commit(
        self,
        save: _Save,
        meta: dict[str, Any],
        files: Sequence[FileEntry],
        format_data: dict[str, Any],
    ) -> None:
        """Coordinator only, once every rank's payload is durable: manifest, then pointer."""
        self.hooks.may_commit()
        step, loc = save.ctx.step, self.loc
        manifest = Manifest(
            step=step,
            format=self.format_name,
            time=self._wall(),
            world_size=self.world_size,
            files=tuple(files),
            metadata=meta,
            versions=versions(),
            format_data=format_data,
            save_id=save.ctx.token,
            url=loc.storage.url(loc.step_dir(step)),
        )
        path = loc.storage.join(loc.step_dir(step), MANIFEST_NAME)
        loc.storage.write_small(path, manifest.to_json())
        loc.write_pointer(step)
        save.manifest = manifest
        save.stats = SaveStats(
            step=step,
            bytes=manifest.bytes,
            blocking_s=0.0,
            total_s=self._clock() - save.t0,
            durable_at=self._wall(),
            url=manifest.url,
            format=self.format_name,
        )

    def _delivered(self, err: BaseException) -> None:
        with self._mutex:
            if self._pending is err:
                self._pending = None

    def wait(self) -> None:
        """Block until the save in flight is durable; re-raise a background failure."""
        self._join()
        self.raise_pending()

    def _join(self) -> None:
        """Wait for the save in flight, within the limits: one whose store stopped answering
        is given up (StoreUnreachableError; its own calls end it soon after, bounded alike)."""
        t = self._thread
        if t is not None:

            def done(timeout: float) -> bool:
                t.join(timeout)
                return not t.is_alive()

            self.limits.wait(done, f"the save in flight ({t.name}) to {self.loc.url}")
            self._thread = self._snapshot = None

    def raise_pending(self) -> None:
        err = self._take_pending()
        if err is not None:
            raise err

    def _take_pending(self) -> BaseException | None:
        with self._mutex:
            err, self._pending = self._pending, None
        return err


class Snapshot:
    """The copy of an overlapped save: taken in the background, waited for by ``wait()``
    before the caller changes the state. Records each tensor's version counter when the save
    starts; a tensor changed before the copy is complete (or, on CUDA, before ``wait()``
    ordered the caller's stream after the copies) fails the save."""

    _streams: ClassVar[dict[torch.device, Any]] = {}  # one side stream per GPU, reused

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)
        self.versions = {k: t._version for k, t in self.tensors.items()}
        devices = {t.device for t in self.tensors.values() if t.is_cuda}
        self.cuda = bool(devices)
        self._device = next(iter(devices), None)
        self._copied: Any = None  # CUDA: an event after the copies, on the side stream
        self._taken = threading.Event()  # CPU: copied; CUDA: the copies are queued
        self._lock = threading.Lock()
        self._ordered = False  # CUDA: wait() made the caller's stream wait for the copies
        self._changed: list[str] = []

    def on_side_stream(self, stage: Callable[[], Any]) -> Any:
        """Run ``stage`` (which queues the device-to-host copies) on a side stream that first
        waits for everything queued so far: the state as it is now. The caller's stream goes
        on at once."""
        assert self._device is not None
        side = self._streams.get(self._device)
        if side is None:
            side = self._streams.setdefault(self._device, torch.cuda.Stream(self._device))
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            out = stage()
            self._copied = torch.cuda.Event()
            self._copied.record(side)
        for t in self.tensors.values():
            if t.is_cuda:  # the copies read it on the side stream: keep its memory until then
                _local(t).record_stream(side)
        self._taken.set()
        return out

    def taken(self, step: int) -> CheckpointError | None:
        """In the save's thread, once the copy is made (CUDA: waited for): None, or the error
        saying that the state changed meanwhile (nothing is written then)."""
        if self._copied is not None:
            self._copied.synchronize()
        with self._lock:
            changed = self._changed if self._ordered else self._since_start()
        if not changed:
            return None
        return CheckpointError(
            f"save of step {step}: {', '.join(changed[:3])} changed while its snapshot was "
            "taken (an overlapped save: call staged() before changing the state, e.g. before "
            "the optimizer step); nothing was written"
        )

    def release(self) -> None:
        self._taken.set()

    def wait(self) -> None:
        """Until the state may change (see SaveHandle.staged)."""
        self._taken.wait()
        if self._copied is None:
            return
        with self._lock:
            if not self._ordered:
                self._changed, self._ordered = self._since_start(), True
        torch.cuda.current_stream(self._device).wait_event(self._copied)

    def _since_start(self) -> list[str]:
        return [k for k, t in self.tensors.items() if t._version != self.versions[k]]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if type(t).__name__ == "DTensor" else t  # type: ignore[attr-defined]


def _local_nbytes(t: Any) -> int:
    """Bytes this rank snapshots of ``t``: a DTensor's local shard, not its global size."""
    if type(t).__name__ == "DTensor":
        t = t.to_local()
    return int(t.numel() * t.element_size())
