"""What does the per-step stop agreement cost? ``python -m ddpkit.bench_any_rank``.

Measures :meth:`Dist.any_rank` side by side with the alternatives a training loop might use,
interleaved (A B C A B C ...) over several repeats, and prints median microseconds per call and
the ratio to a bare one-element ``all_reduce`` (the floor any agreement must pay).

Without a launcher it spawns ``--procs`` local gloo processes on CPU. Under torchrun or srun it
measures the job it runs in (e.g. NCCL between GPUs): ``srun -n 8 python -m
ddpkit.bench_any_rank``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as tdist

from ddpkit.dist import Dist, init
from ddpkit.env import detect


def _candidates(dist: Dist) -> dict[str, Callable[[], object]]:
    flag = torch.zeros(1, dtype=torch.int32, device=dist.device)

    def raw_all_reduce() -> object:
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        return flag.item()

    return {
        "all_reduce 1 int (floor)": raw_all_reduce,
        "Dist.any_rank": lambda: dist.any_rank(False),
        "Dist.all_reduce(float)": lambda: dist.all_reduce(1.0, "max"),
        "barrier": dist.barrier,
        "all_gather_object(bool)": lambda: dist.all_gather_object(False),
        "broadcast_object(bool)": lambda: dist.broadcast_object(False),
    }


def measure(dist: Dist, iters: int, repeats: int) -> dict[str, list[float]]:
    """Microseconds per call, one sample per repeat, interleaved across candidates."""
    cands = _candidates(dist)
    samples: dict[str, list[float]] = {name: [] for name in cands}
    for rep in range(repeats + 1):  # the first round warms up and is dropped
        for name, fn in cands.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            elapsed = time.perf_counter() - t0
            if rep:
                samples[name].append(elapsed / iters * 1e6)
    return samples


def report(samples: dict[str, list[float]], dist: Dist, out: str | None) -> None:
    floor = statistics.median(samples["all_reduce 1 int (floor)"])
    rows = [
        (name, statistics.median(s), statistics.median(s) / floor) for name, s in samples.items()
    ]
    print(
        f"\nany_rank cost: {dist.world_size} processes, backend {dist.backend}, device "
        f"{dist.device}, torch {torch.__version__}, {os.cpu_count()} CPUs "
        f"(median of {len(next(iter(samples.values())))} interleaved repeats)"
    )
    width = max(len(r[0]) for r in rows)
    print(f"{'candidate'.ljust(width)}  {'us/call':>9}  {'x floor':>7}")
    print(f"{'-' * width}  {'-' * 9}  {'-' * 7}")
    for name, us, ratio in rows:
        print(f"{name.ljust(width)}  {us:9.1f}  {ratio:7.2f}")
    sys.stdout.flush()
    if out:
        payload: dict[str, Any] = {
            "world_size": dist.world_size,
            "backend": dist.backend,
            "device": str(dist.device),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "us_per_call_median": {name: us for name, us, _ in rows},
            "ratio_to_floor": {name: ratio for name, _, ratio in rows},
            "samples_us": samples,
        }
        with open(out, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {out}")


def _worker(
    rank: int,
    world_size: int,
    port: int,
    iters: int,
    repeats: int,
    out: str | None,
    device: str | None,
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    _run(iters, repeats, out, device)


def _run(iters: int, repeats: int, out: str | None, device: str | None) -> None:
    with init(timeout=120, device=device) as dist:
        samples = measure(dist, iters, repeats)
        if dist.is_main:
            report(samples, dist, out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpkit.bench_any_rank", description=__doc__)
    parser.add_argument("--procs", type=int, default=2, help="local processes (no launcher)")
    parser.add_argument("--iters", type=int, default=500, help="calls per sample")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved samples")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: init()'s)")
    args = parser.parse_args(argv)
    if args.procs < 2 or args.iters < 1 or args.repeats < 1:
        parser.error("--procs must be >= 2, --iters and --repeats >= 1")
    if detect().is_distributed:
        _run(args.iters, args.repeats, args.json, args.device)
        return 0
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _worker,
        args=(args.procs, port, args.iters, args.repeats, args.json, args.device),
        nprocs=args.procs,
        start_method="spawn",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
