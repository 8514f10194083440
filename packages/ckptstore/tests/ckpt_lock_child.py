"""One process of the lock tests (run as a script; helpers beside it).

    python ckpt_lock_child.py MODE URL GO RESULT HOLD_S [STORAGE_OPTIONS_JSON]

Creates RESULT.ready once imported, waits for the file GO (so that every racer starts at the
same instant), then, in MODE ``acquire``, tries to become the experiment's writer, or, in MODE
``train``, saves steps 1, 2, ... every 50 ms. Writes what happened to RESULT (JSON) and closes
the store (or, in MODE ``acquire-and-die``, takes the lock and SIGKILLs itself). A winner holds
the lock -- keeps training, or waits -- until the test creates the file ``release`` beside GO:
never for a fixed time, which a busy machine may not give the other racers to start (issue 24:
a second trainer whose torch import took longer than a 4 s hold found the lock free). HOLD_S
only caps the wait, in case the test died.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ckptstore import CheckpointStore, LockedError


def race(store: CheckpointStore, mode: str, release: Path, hold_s: float) -> dict[str, Any]:
    if mode != "train":
        info = store.acquire()
        assert info is not None
        return {"token": info.token}
    saved, end = [], time.monotonic() + hold_s
    while not release.exists() and time.monotonic() < end:
        step = len(saved) + 1
        store.save(step, {"w": torch.full((1000,), float(step))})
        saved.append(step)
        time.sleep(0.05)
    return {"saved": saved}


def main() -> None:
    mode, url, go, result, hold = sys.argv[1:6]
    opts = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    store = CheckpointStore(url, storage_options=opts, distributed=False)
    Path(result + ".ready").touch()
    while not os.path.exists(go):
        time.sleep(0.001)
    out: dict[str, Any] = {"pid": os.getpid(), "ok": True}
    release, end = Path(go).with_name("release"), time.monotonic() + float(hold)
    try:
        out.update(race(store, mode, release, float(hold)))
    except LockedError as e:
        out.update(ok=False, error=str(e))
    Path(result).write_text(json.dumps(out))
    if mode == "acquire-and-die" and out["ok"]:
        os.kill(os.getpid(), signal.SIGKILL)  # a killed job: the lock stays behind
    while out["ok"] and mode != "train" and not release.exists() and time.monotonic() < end:
        time.sleep(0.01)  # the winner holds the lock until every racer has tried
    store.close()


if __name__ == "__main__":
    main()
