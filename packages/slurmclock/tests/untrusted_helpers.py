"""What the tests of the readers of untrusted files (test_untrusted.py) share with the chaos
rows of chaos/test_files.py, which loads this file by path: a call bounded in time, and what
can sit at a path in place of a regular file."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPARSE_BYTES = 2 * 1024**3  # a 2 GB file of holes: costs no disk, would cost 2 GB to read


def finishes(fn: Callable[[], Any], seconds: float = 10.0) -> Any:
    """``fn()``'s result; fails when it has not returned within ``seconds`` (a blocked read is
    a failed test, not a hung suite)."""
    box: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} blocked for more than {seconds:.0f} s"
    if errors:
        raise errors[0]
    return box[0] if box else None


def sparse(path: Path) -> None:
    """A regular file of :data:`SPARSE_BYTES` holes at ``path``."""
    with open(path, "wb") as f:
        f.truncate(SPARSE_BYTES)


# What a reader must refuse without waiting on it, by kind: each puts it at a path.
NONREGULAR: dict[str, Callable[[Path], None]] = {
    "fifo": os.mkfifo,
    "dev-zero": lambda path: path.symlink_to("/dev/zero"),
    "loop": lambda path: path.symlink_to(path),
    "directory": Path.mkdir,
}
