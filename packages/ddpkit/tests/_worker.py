"""A rank of the multi-process tests: ``python _worker.py SCENARIO OUTDIR``.

Launched by torchrun or with SLURM_* variables (a simulated srun). Each rank writes
``OUTDIR/rank<N>.json`` with what it saw; the test process asserts on those files, so a failure
shows the values instead of a bare exit code.
"""

from __future__ import annotations

import contextlib
import hashlib
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
    out["agree_max"] = dist.agree(r, 5 - r, r == n - 1)
    out["agree_max_again"] = dist.agree(3 - r, 7, False)  # the same buffer, new values
    out["agree_min"] = dist.agree(r + 1, 20 - r, op="min")
    out["agree_one"] = dist.agree(62 - r)
    out["agree_many"] = dist.agree(*[(r + i) % 7 for i in range(9)])  # nine fields of 7 bits
    out.update(rng_checks(dist))
    return out


def rng_checks(dist: ddpkit.Dist) -> dict[str, Any]:
    r, n = dist.rank, dist.world_size
    ddpkit.seed_everything(7, r)
    saved = ddpkit.capture_rng(dist)
    expected = [float(torch.rand(1)) for _ in range(3)]
    torch.manual_seed(12345)  # lose the stream
    how = ddpkit.restore_rng(saved, dist, seed=7, step=5)
    again = [float(torch.rand(1)) for _ in range(3)]
    fewer = {k: v for k, v in saved.items() if k != f"rank{n - 1}"}  # written by n-1 ranks
    other = ddpkit.restore_rng(fewer, dist, seed=7, step=5)
    return {
        "rng_keys": sorted(saved),
        "rng_restored": (how.how, again == expected),
        "rng_other_world": (other.how, other.saved_world_size, other.seed),
    }


def fsdp_run(dist: ddpkit.Dist, **options: Any) -> dict[str, Any]:
    """Four FSDP2 steps of a small transformer-like model, two micro-batches each."""
    ddpkit.set_determinism(dist.device)
    ddpkit.seed_everything(0)  # FSDP does not broadcast: every rank builds the same weights
    model = TinyLM()
    ddpkit.shard_model(model, dist, blocks="layers", **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ddpkit.seed_everything(1, dist.rank)  # per-rank dropout
    gen = torch.Generator().manual_seed(dist.rank)
    dtype = options.get("dtype") or torch.float32
    losses, norms = [], []
    for _ in range(4):
        for micro in range(2):
            x = torch.randn(4, 8, 16, generator=gen).to(dtype)
            with ddpkit.no_sync(model) if micro == 0 else contextlib.nullcontext():
                loss = model(x).float().pow(2).mean()
                loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append(float(ddpkit.full_value(norm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    weight = model.layers[0].up.weight
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(bytes(p.full_tensor().detach().float().view(torch.uint8).flatten().tolist()))
    return {
        "digest": digest.hexdigest(),
        "losses": losses,
        "norms": norms,
        "sharded": ddpkit.is_sharded(model),
        "local_rows": weight.to_local().shape[0],
        "full_rows": weight.shape[0],
        "param_dtype": str(weight.dtype),
        "moment_dtype": str(opt.state[weight]["exp_avg"].dtype),
    }


class TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.layers = nn.ModuleList(TinyBlock() for _ in range(3))
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


FSDP_CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "checkpointed": {"activation_checkpointing": True},
    "no_reshard": {"reshard_after_forward": False},
    "mixed_bf16": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "bf16_params": {"dtype": torch.bfloat16, "reduce_dtype": torch.float32},
}


def fsdp(dist: ddpkit.Dist) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, options in FSDP_CONFIGS.items():
        first, second = fsdp_run(dist, **options), fsdp_run(dist, **options)
        out[name] = {**first, "repeat_equal": first == second}
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
            elif scenario == "fsdp":
                record["result"] = fsdp(dist)
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
