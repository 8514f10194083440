"""One rank of the two-rank outage test (gloo on 127.0.0.1). Writes result-<rank>.json.

python ckpt_outage_worker.py ROOT FORMAT   (with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

The store writes through a storage wrapper (its public seam) that refuses every write as a dead
endpoint would (ConnectionRefusedError) while ROOT/down exists; the classification of a real
endpoint's refusals is tested against moto_server in test_outage.py.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptstore import CheckpointStore, StoreUnreachableError, open_storage


class Flaky:
    def __init__(self, inner: Any, down: Path) -> None:
        self._inner, self._down = inner, down

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write_payload(self, path: str, payload: Any, io: Any, *, background: bool = False) -> Any:
        if self._down.exists():
            raise ConnectionRefusedError(111, "Connection refused")
        return self._inner.write_payload(path, payload, io, background=background)


def scenario(root: Path, rank: int, fmt: str) -> dict[str, object]:
    out: dict[str, object] = {}
    storage = Flaky(open_storage(str(root / "exp")), root / "down")
    with CheckpointStore(storage, format=fmt) as store:
        store.save(1, {"w": torch.ones(4)})
        dist.barrier()
        if rank == 0:
            (root / "down").touch()
        dist.barrier()
        store.save(2, {"w": torch.full((4,), 2.0)}, blocking=False)  # fails in the background
        try:  # every rank hears of it here; rank 1 waited forever in the agreement before
            store.save(3, {"w": torch.full((4,), 3.0)})
        except StoreUnreachableError as e:
            out["error"] = str(e)
        dist.barrier()
        if rank == 0:
            (root / "down").unlink()
        dist.barrier()
        store.save(4, {"w": torch.full((4,), 4.0)})
        out["steps"] = store.steps() if rank == 0 else None
    return out


def main() -> None:
    root = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    try:
        result: dict[str, object] = {"ok": True, **scenario(root, rank, sys.argv[2])}
    except BaseException as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    (root / f"result-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
