"""One rank of the multi-process tests (gloo on 127.0.0.1). Writes result-<rank>.json.

python ckpt_dist_worker.py ROOT   (with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from ckpt_helpers import (  # beside this script
    BIG_DIST,
    FORMATS,
    assert_same_state,
    blank_state,
    make_state,
)

from ckptstore import CheckpointStore, CheckpointWarning


def scenario(root: Path, rank: int) -> dict[str, object]:
    out: dict[str, object] = {}
    # 1 -> 2: checkpoints the test wrote from a single process
    for fmt in FORMATS:
        with CheckpointStore(str(root / f"{fmt}1"), format=fmt) as store:
            loaded = blank_state()
            assert store.load(loaded).step == 1
            assert_same_state(make_state(1), loaded)
    # 2 -> 2, blocking, every format
    for fmt in FORMATS:
        with CheckpointStore(str(root / f"{fmt}2"), format=fmt) as store:
            store.save(2, make_state(2))
            loaded = blank_state()
            assert store.load(loaded).step == 2
            assert_same_state(make_state(2), loaded)
    # async on 2 ranks while training runs collectives on the default group
    with CheckpointStore(str(root / "dcp2"), format="dcp") as store:
        state = make_state(3)
        handle = store.save(3, state, blocking=False)
        with torch.no_grad():
            for p in state["model"].parameters():
                p.mul_(-1.0)
        for i in range(50):
            t = torch.full((1000,), float(i + rank))
            dist.all_reduce(t)
            assert float(t[0]) == 2 * i + 1
        out["async_blocking_s"] = handle.blocking_s
        handle.result()
        loaded = blank_state()
        assert store.load(loaded).step == 3
        assert_same_state(make_state(3), loaded)
        out["stats"] = [s.to_dict() for s in store.saves_completed()]
    # sharded (DTensor, as FSDP2 makes them): each rank writes and reads only its shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(64 * 3, dtype=torch.float32).reshape(64, 3)
    with CheckpointStore(str(root / "sharded"), format="dcp") as store:
        store.save(1, {"w": {"x": distribute_tensor(full, mesh, [Shard(0)])}})
        target = {"w": {"x": distribute_tensor(torch.zeros(64, 3), mesh, [Shard(0)])}}
        store.load(target)
        assert torch.equal(target["w"]["x"].full_tensor(), full)
        assert target["w"]["x"].to_local().shape == (32, 3)
        # into a sharded target of another dtype: read sharded in the saved dtype, then cast
        half = torch.zeros(64, 3, dtype=torch.bfloat16)
        model = torch.nn.Module()
        model.x = torch.nn.Parameter(distribute_tensor(half, mesh, [Shard(0)]))
        store.load({"w": model})
        assert model.x.dtype == torch.bfloat16 and model.x.to_local().shape == (32, 3)
        assert torch.equal(model.x.full_tensor(), full.to(torch.bfloat16))
    # ranks agree on a fallback even when only one of them reads the corrupt bytes
    with CheckpointStore(str(root / "torch3"), format="torch") as store:
        store.save(2, make_state(2, big=BIG_DIST))
        store.save(3, make_state(3, big=BIG_DIST))
        dist.barrier()
        if rank == 0:
            step_dir = root / "torch3" / "step-00000003"
            f = next(step_dir.glob("state.*.safetensors"))
            header = json.loads((step_dir / "manifest.json").read_text())["format_data"]["header"]
            big = header["tensors"]["big"]  # only rank 1 reads it: damage a chunk of its own
            chunk = 4 << 20
            at = (big["offset"] // chunk + 1) * chunk + 100
            assert at + chunk < big["offset"] + big["nbytes"]
            with open(f, "r+b") as fh:
                fh.seek(at)
                b = fh.read(1)
                fh.seek(at)
                fh.write(bytes([b[0] ^ 0xFF]))
        dist.barrier()
        loaded = blank_state(big=BIG_DIST) if rank == 1 else blank_state()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            step = store.load(loaded, strict=True).step
        assert step == 2, step
        msgs = [str(w.message) for w in rec if issubclass(w.category, CheckpointWarning)]
        assert any("rank 1" in m and "checksum mismatch" in m for m in msgs), msgs
        assert_same_state(make_state(2, big=BIG_DIST), loaded, keys=list(loaded))
    return out


def main() -> None:
    root = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    result: dict[str, object] = {"rank": rank}
    try:
        result.update(scenario(root, rank))
        result["ok"] = True
    except BaseException:
        result["ok"] = False
        result["error"] = traceback.format_exc()
    (root / f"result-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
