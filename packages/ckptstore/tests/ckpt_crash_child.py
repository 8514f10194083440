"""Child side of the crash tests: save step 1, then keep saving until the parent SIGKILLs us.

Runs in a forkserver child (torch imported once, in the server) so each kill costs milliseconds.
The store writes through ``PausingStorage``, a wrapper around the real storage (the store takes
any ``Storage``): it stops the process at a chosen point of the commit protocol, so the parent
kills it exactly there.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import torch
from ckpt_helpers import make_state

from ckptstore import CheckpointStore, IOOptions, open_storage

# Points of the commit protocol, in order: some payload bytes written; payload durable, no
# manifest; manifest written under its temp name; manifest committed, pointer not moved; new
# pointer under its temp name; committed.
POINTS = (
    "payload-partial",
    "payload-written",
    "manifest-tmp",
    "manifest-written",
    "latest-tmp",
    "committed",
)


class PausingStorage:
    """Delegates to ``inner``; once armed, stops the process at ``point`` (signalling it by
    creating ``signal_dir/point``) and sleeps until killed."""

    def __init__(self, inner: Any, point: str, signal_dir: str) -> None:
        self._inner, self.point, self.signal_dir = inner, point, signal_dir
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def pause(self, name: str) -> None:
        if self.armed and name == self.point:
            Path(self.signal_dir, name).touch()
            while True:  # the test kills us here
                time.sleep(3600)

    def write_payload(self, path: str, payload: Any, io: Any, *, background: bool = False) -> Any:
        wrapped = _PausingPayload(payload, self)
        return self._inner.write_payload(path, wrapped, io, background=background)

    def write_small(self, path: str, data: bytes) -> None:
        kind = {"manifest.json": "manifest", "latest": "latest"}.get(path.rsplit("/", 1)[-1])
        if kind == "manifest":
            self.pause("payload-written")
        if kind is not None and self.armed and self.point == f"{kind}-tmp":
            # what a kill between writing the temp file and renaming it leaves behind
            self._inner.write_small(f"{path}.tmp-{uuid.uuid4().hex[:12]}", data)
            self.pause(self.point)
        self._inner.write_small(path, data)
        self.pause({"manifest": "manifest-written", "latest": "committed"}.get(kind or "", ""))


class _PausingPayload:
    """A payload that pauses when the writer asks for its second piece (the first is written:
    the child writes with one thread)."""

    def __init__(self, inner: Any, storage: PausingStorage) -> None:
        self._inner, self._storage, self.size = inner, storage, inner.size

    def fill(self, offset: int, out: torch.Tensor) -> None:
        if offset:
            self._storage.pause("payload-partial")
        self._inner.fill(offset, out)

    def view(self, offset: int, length: int) -> torch.Tensor | None:
        if offset:
            self._storage.pause("payload-partial")
        return self._inner.view(offset, length)


def saver(
    url: str,
    fmt: str,
    pause_at: str,
    blocking: bool,
    big: int,
    signal_dir: str,
    storage_options: dict[str, Any],
    keep_going: bool,
) -> None:
    # Small pieces and parts, one at a time, so that even a 12 MB payload is written in several
    # of them, in order.
    io = IOOptions(piece_bytes=4 << 20, s3_part_bytes=8 << 20, threads=1, s3_concurrency=1)
    storage = PausingStorage(open_storage(url, storage_options), pause_at, signal_dir)
    store = CheckpointStore(storage, format=fmt, io=io)
    store.save(1, make_state(1, big=big))
    Path(signal_dir, "saved-1").touch()
    storage.armed = bool(pause_at)
    step = 2
    while True:
        store.save(step, make_state(step, big=big), blocking=blocking)
        store.wait()
        Path(signal_dir, f"saved-{step}").touch()
        if not keep_going:
            break
        step += 1
    Path(signal_dir, "finished").touch()
    while True:  # the parent decides when we die
        time.sleep(60)
