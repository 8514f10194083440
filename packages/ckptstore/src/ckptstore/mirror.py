"""The mirror: each committed checkpoint copied, verified chunk by chunk, to a second location.

A ``Mirror`` knows two ``Location``s and an I/O configuration; what the store wants to know or
do after a copy (record its stats, prune the mirror) it passes in as callbacks. One background
thread copies; when it falls behind, only the newest commit waits (older ones are skipped).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import CorruptCheckpointError, MirrorError, warn
from .layout import Location
from .manifest import MANIFEST_NAME, Manifest
from .storage import FilePayload, IOEngine, IOOptions


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
