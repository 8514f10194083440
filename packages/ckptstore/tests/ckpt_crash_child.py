"""Child side of the crash tests: save step 1, then keep saving until the parent SIGKILLs us.

Runs in a forkserver child (torch imported once, in the server) so each kill costs milliseconds.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ckpt_helpers import make_state

from ckptstore import CheckpointStore, IOOptions
from ckptstore._testing import ENV_PAUSE, ENV_SIGNAL_DIR


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
    os.environ[ENV_SIGNAL_DIR] = signal_dir
    # Small pieces and parts, so that even a 12 MB payload is written in several of them.
    io = IOOptions(piece_bytes=4 << 20, s3_part_bytes=8 << 20)
    store = CheckpointStore(url, format=fmt, storage_options=storage_options, io=io)
    store.save(1, make_state(1, big=big))
    Path(signal_dir, "saved-1").touch()
    if pause_at:
        os.environ[ENV_PAUSE] = pause_at
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
