"""One process of the lock tests (run as a script; helpers beside it).

    python ckpt_lock_child.py MODE URL GO RESULT HOLD_S [STORAGE_OPTIONS_JSON]

Creates RESULT.ready once imported, waits for the file GO (so that every racer starts at the
same instant), then, in MODE ``acquire``, tries to become the experiment's writer, or, in MODE
``train``, saves steps 1, 2, ... every 50 ms for HOLD_S seconds. Writes what happened to RESULT
(JSON), holds for HOLD_S seconds and closes the store (or, in MODE ``acquire-and-die``, takes
the lock and SIGKILLs itself).
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


def race(store: CheckpointStore, mode: str, hold_s: float) -> dict[str, Any]:
    if mode != "train":
        info = store.acquire()
        assert info is not None
        return {"token": info.token}
    saved, end = [], time.monotonic() + hold_s
    while time.monotonic() < end:
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
    try:
        out.update(race(store, mode, float(hold)))
    except LockedError as e:
        out.update(ok=False, error=str(e))
    Path(result).write_text(json.dumps(out))
    if mode == "acquire-and-die" and out["ok"]:
        os.kill(os.getpid(), signal.SIGKILL)  # a killed job: the lock stays behind
    if out["ok"] and mode != "train":
        time.sleep(float(hold))
    store.close()


if __name__ == "__main__":
    main()
