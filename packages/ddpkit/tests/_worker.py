"""A rank of the multi-process tests: ``python _worker.py SCENARIO OUTDIR``.

Launched by torchrun or with SLURM_* variables (a simulated srun). Each rank writes
``OUTDIR/rank<N>.json`` with what it saw; the test process asserts on those files, so a failure
shows the values instead of a bare exit code.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

import ddpkit


def collectives(dist: ddpkit.Dist) -> dict[str, Any]:
    r, n = dist.rank, dist.world_size
    out: dict[str, Any] = {}
    out["mean_float"] = dist.all_reduce(float(r), "mean")
    out["sum_int"] = dist.all_reduce(r + 1, "sum")
    out["max_int"] = dist.all_reduce(r * 3, "max")
    out["min_float"] = dist.all_reduce(r - 0.5, "min")
    out["mean_int"] = dist.all_reduce(r, "mean")
    t = torch.full((3,), float(r))
    same = dist.all_reduce(t, "mean")
    out["tensor_mean"] = t.tolist()
    out["tensor_in_place"] = same is t
    out["tensor_sum_int"] = dist.all_reduce(torch.tensor([r, 1]), "sum").tolist()
    out["dict_mean"] = dist.all_reduce({"loss": float(r), "tokens": 10 * (r + 1)}, "mean")
    out["any_last"] = dist.any_rank(r == n - 1)
    out["any_none"] = dist.any_rank(False)
    out["all_true"] = dist.all_ranks(True)
    out["all_but_0"] = dist.all_ranks(r != 0)
    out["bcast0"] = dist.broadcast_object({"step": 7, "from": r} if r == 0 else None)
    out["bcast_last"] = dist.broadcast_object(f"from {r}", src=n - 1)
    out["gather"] = dist.all_gather_object(r * 10)
    out["gather_uneven"] = [len(x) for x in dist.all_gather_object("x" * (1000 * r))]
    out["bcast_big"] = len(dist.broadcast_object(bytes(range(256)) * 1000 if r == 0 else b""))
    out["bcast_none"] = dist.broadcast_object(None if r == 0 else "not me")
    dist.barrier()
    out.update(ddp_checks(dist))
    out["even_count"] = sum(1 for _ in dist.even(range(3 + r)))
    return out


def ddp_checks(dist: ddpkit.Dist) -> dict[str, Any]:
    r = dist.rank
    ddpkit.seed_everything(1234 + r)  # different init per rank: DDP must broadcast rank 0's
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    ddp = ddpkit.wrap_ddp(model, dist)
    out: dict[str, Any] = {"is_ddp": isinstance(ddp, nn.parallel.DistributedDataParallel)}
    out["unwrap_is_model"] = ddpkit.unwrap(ddp) is model
    out["raw_keys"] = sorted(ddp.state_dict())
    out["clean_keys"] = sorted(ddpkit.clean_state_dict(ddp.state_dict()))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(r)

    def step() -> None:
        x = torch.randn(5, 4, generator=gen)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    out["params_after_step"] = param_digest(model)
    # Uneven inputs: rank r has 2 + r batches; Join keeps the early finishers shadowing.
    with dist.join(ddp):
        for _ in range(2 + r):
            step()
    out["params_after_join"] = param_digest(model)
    return out


def param_digest(model: nn.Module) -> list[float]:
    return [round(float(p.detach().double().sum()), 10) for p in model.parameters()]


def die(dist: ddpkit.Dist, victim: int) -> dict[str, Any]:
    dist.all_reduce(1.0)  # everyone is connected
    if dist.rank == victim:
        os._exit(17)
    time.sleep(0.5)
    dist.all_reduce(1.0)
    return {"unexpected": "all_reduce returned although a peer died"}


def hang(dist: ddpkit.Dist) -> dict[str, Any]:
    dist.all_reduce(1.0)
    if dist.rank == 1:
        time.sleep(600)  # alive (heartbeat keeps beating) but never joins
    dist.any_rank(False)
    return {"unexpected": "any_rank returned although a peer never joined"}


def main() -> int:
    scenario, outdir = sys.argv[1], Path(sys.argv[2])
    timeout = float(os.environ.get("TEST_TIMEOUT", "60"))
    record: dict[str, Any] = {"scenario": scenario, "pid": os.getpid()}
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "?"))
    t0 = time.monotonic()
    try:
        with ddpkit.init(timeout=timeout) as dist:
            record["info"] = {
                "launcher": dist.info.launcher,
                "rank": dist.rank,
                "world_size": dist.world_size,
                "local_rank": dist.local_rank,
                "local_world_size": dist.local_world_size,
                "node_rank": dist.node_rank,
                "num_nodes": dist.info.num_nodes,
                "master_addr": dist.info.master_addr,
                "master_port": dist.info.master_port,
                "job_id": dist.info.job_id,
                "backend": dist.backend,
                "device": str(dist.device),
                "env_master_port": os.environ.get("MASTER_PORT"),
            }
            if scenario == "collectives":
                record["result"] = collectives(dist)
            elif scenario.startswith("die"):
                record["result"] = die(dist, int(scenario[3:]))
            elif scenario == "hang":
                record["result"] = hang(dist)
            elif scenario == "raise":
                raise KeyError("boom inside the with block")
            else:
                raise SystemExit(f"unknown scenario {scenario}")
    except Exception as e:
        record["error_type"] = type(e).__name__
        record["error"] = str(e)
        record["traceback"] = traceback.format_exc()
    record["elapsed"] = time.monotonic() - t0
    record["initialized_after"] = tdist.is_initialized()
    record["env_master_port_after"] = os.environ.get("MASTER_PORT")
    (outdir / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
