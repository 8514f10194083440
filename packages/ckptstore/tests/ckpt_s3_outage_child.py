"""python ckpt_s3_outage_child.py: an async save to a moto_server that dies mid-upload.

The store writes through a storage wrapper (its public seam) that stops the server when the
upload asks for its third part, while the first parts are on the wire. Prints the one-line error
the caller gets (with its type: the store did not answer) and exits 1.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from ckpt_helpers import s3server

from ckptstore import CheckpointError, CheckpointStore, IOOptions, open_storage

PART = 8 << 20


class _DyingPayload:
    def __init__(self, inner: Any, server: Any) -> None:
        self._inner, self._server, self.size = inner, server, inner.size

    def _maybe_die(self, offset: int) -> None:
        if offset >= 2 * PART:
            self._server.stop()

    def fill(self, offset: int, out: torch.Tensor) -> None:
        self._maybe_die(offset)
        self._inner.fill(offset, out)

    def view(self, offset: int, length: int) -> torch.Tensor | None:
        self._maybe_die(offset)
        return self._inner.view(offset, length)


class EndpointDies:
    def __init__(self, inner: Any, server: Any) -> None:
        self._inner, self._server = inner, server

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write_payload(self, path: str, payload: Any, io: Any, *, background: bool = False) -> Any:
        dying = _DyingPayload(payload, self._server)
        return self._inner.write_payload(path, dying, io, background=background)


def main() -> int:
    server = s3server.MotoServer().start()
    server.make_bucket("outage")
    storage = open_storage("s3://outage/run", server.storage_options())
    store = CheckpointStore(EndpointDies(storage, server), io=IOOptions(s3_part_bytes=PART))
    store.save(1, {"w": torch.ones(10)})
    try:
        store.save(2, {"w": torch.randn(16_000_000)}, blocking=False)  # 64 MB: 8 parts
        store.wait()
    except CheckpointError as e:
        print(f"error: {type(e).__name__}: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
