"""The mirror: each committed checkpoint copied, verified chunk by chunk, to a second location.

A ``Mirror`` knows two ``Location``s and an I/O configuration; what the store wants to know or
do after a copy (record its stats, prune the mirror) it passes in as callbacks. One background
thread copies; when it falls behind, only the newest commit waits (older ones are skipped).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import CorruptCheckpointError, MirrorError, warn
from .layout import ExperimentLocation, Location
from .manifest import MANIFEST_NAME, Manifest
from .storage import FilePayload, IOEngine, IOOptions


def check_mirror(
    url: str,
    mirror: str,
    *,
    experiment: str | None = None,
    storage_options: dict[str, Any] | None = None,
    mirror_storage_options: dict[str, Any] | None = None,
) -> None:
    """Whether ``mirror`` can be the second copy of the experiment at ``url[/experiment]``, as
    ``CheckpointStore(url, mirror=mirror, ...)`` checks it: ValueError (one line, with the fix)
    if not. For an application's own checks before it starts (no I/O but looking at local
    folders)."""
    primary = Location.open(url, experiment, storage_options)
    second = Location.open(mirror, experiment, mirror_storage_options)
    check_locations(primary, second, said=mirror)


def check_locations(primary: Location, mirror: Location, *, said: str | None = None) -> None:
    """ValueError (one line, with the fix) for a mirror that cannot be a second copy: the
    experiment's own folder, a folder inside it or around it (one failure domain: what loses
    one copy loses both), or a local folder this user cannot create or write. Looks at local
    folders only (an object store answers when the store takes the mirror's lock). ``said``:
    the mirror as the user gave it, for the message."""
    p, m = _comparable(primary.where), _comparable(mirror.where)
    name, fix = said or mirror.url, "give a second location (another disk, node or bucket)"
    if p == m:
        raise ValueError(f"{name} is the checkpoint location itself: {fix}, or drop the mirror")
    for inner, outer, where in ((m, p, "inside"), (p, m, "around")):
        if inner.startswith(outer.rstrip("/") + "/"):
            raise ValueError(
                f"{name} is {where} the experiment's own folder {primary.url}: what loses the "
                f"checkpoints would lose the mirror too; {fix}, or drop the mirror"
            )
    local = mirror.where.local_path
    if local is not None:
        _check_writable(local, name)


def _comparable(where: ExperimentLocation) -> str:
    return os.path.realpath(where.local_path) if where.local_path else where.url


def _check_writable(folder: str, url: str) -> None:
    existing = folder
    while not os.path.exists(existing) and existing != os.path.dirname(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{url}: {existing} is a file, not a folder: give a folder for the mirror")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"{url}: {existing} cannot be written by this user (read-only, or its permissions): "
            "give a folder the run can write, or drop the mirror"
        )


@dataclass(frozen=True, slots=True)
class MirrorCopy:
    """One checkpoint that reached the mirror: what ``on_copied`` receives."""

    manifest: Manifest  # the primary's manifest (the mirror holds the same bytes)
    url: str  # the mirror's step folder
    seconds: float  # from the commit on the primary until the mirror copy was durable


class Mirror:
    """Copies committed checkpoints from ``source`` to ``dest`` in the background."""

    def __init__(
        self,
        source: Location,
        dest: Location,
        io: IOOptions,
        *,
        on_copied: Callable[[MirrorCopy], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source, self.dest = source, dest
        self.io = IOEngine(io)
        self._on_copied, self._clock = on_copied, clock
        self._cv = threading.Condition()
        self._pending: tuple[Manifest, float] | None = None
        self._busy: int | None = None
        self._error: MirrorError | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, manifest: Manifest) -> None:
        """Copy this commit next (replacing one still waiting)."""
        with self._cv:
            self._pending = (manifest, self._clock())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True)
                self._thread.name = "ckptstore-mirror"
                self._thread.start()
            self._cv.notify_all()

    def busy_steps(self) -> set[int]:
        """Steps being copied or waiting: not to be pruned on the source meanwhile."""
        with self._cv:
            out = {self._busy} if self._busy is not None else set()
            if self._pending is not None:
                out.add(self._pending[0].step)
            return out

    def _next(self) -> tuple[Manifest, float] | None:
        with self._cv:
            while self._pending is None and not self._closed:
                self._cv.wait()
            job, self._pending = self._pending, None
            self._busy = job[0].step if job is not None else None
            return job

    def _run(self) -> None:
        while (job := self._next()) is not None:
            err = None
            try:
                self.copy(*job)
            except Exception as e:
                err = MirrorError(
                    f"mirroring step {job[0].step} to {self.dest.url} failed (the primary copy "
                    f"is fine; the next checkpoint will be mirrored again): {e}"
                )
                warn(f"ckptstore: {err}")  # before wait() can return: callers catch it
            with self._cv:
                self._busy, self._error = None, err
                self._cv.notify_all()

    def copy(self, manifest: Manifest, t0: float) -> None:
        """Payload files (verified on the way), then the manifest, then the pointer."""
        step = manifest.step
        src_dir, dst_dir = self.source.step_dir(step), self.dest.step_dir(step)
        src, dst = self.source.storage, self.dest.storage
        dst.makedirs(dst_dir)
        for f in manifest.files:
            payload = FilePayload(src, src.join(src_dir, f.path), f)
            got = dst.write_payload(dst.join(dst_dir, f.path), payload, self.io, background=True)
            if got.checksum != f.checksum or got.size != f.size:
                raise CorruptCheckpointError(f"{f.path}: copy does not match the manifest")
        dst.write_small(dst.join(dst_dir, MANIFEST_NAME), manifest.to_json())
        self.dest.write_pointer(step)
        self._on_copied(MirrorCopy(manifest, dst.url(dst_dir), self._clock() - t0))

    def wait(self, timeout: float | None = None) -> None:
        """Until nothing is waiting or being copied; MirrorError if the last copy failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending is not None or self._busy is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"mirror copy to {self.dest.url} still running")
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
