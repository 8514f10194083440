"""What the per-step stop agreement costs, next to a training step: 2-process gloo on CPU.

Every step, pyrecover-train's ranks agree whether to stop and whether to save (a few small ints),
so one slow rank's clock or a signal delivered to one rank stops all of them at the same step.
This measures, interleaved round by round (A B C ... B C A ...: the order rotates) in the same
processes:

* a bare one-element ``all_reduce`` + ``.item()`` -- the floor any agreement pays -- and a bare
  all_reduce of a reused 3-int tensor + ``.tolist()`` (the floor for three values);
* ``Dist.any_rank`` (one flag) and ``Dist.agree`` (three ints in a reused buffer: stop code,
  save due, cannot save);
* the trainer's agreement before ddpkit had ``agree``: ``Dist.all_reduce`` of a *new*
  ``torch.tensor([code, due, cannot])`` with MAX, read back with ``.tolist()``;
* barrier, ``Dist.all_reduce(float)`` and the object collectives, for scale;
* a DDP training step of the trainer's ``tiny`` model (sequence 128, batch 8, fp32, AdamW).

Headline: each agreement's cost as a share of a step, and as a ratio to the bare all_reduce.
Medians over rounds; rank 0 reports.

    python bench/agree.py [--quick] [--rounds N] [--out DIR]
    srun -n 8 python bench/agree.py --no-step   # your cluster's own backend (NCCL between GPUs)

Writes bench/results/agree.json and agree.png.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, bar_chart, print_table, write_results  # noqa: E402

SEQ, BATCH, VOCAB = 128, 8, 4096
FLOOR, FLOOR3 = "all_reduce 1 int (floor)", "all_reduce 3 ints, reused tensor"
ANY, AGREE = "Dist.any_rank", "Dist.agree(3 ints)"
TRAINER = "trainer agreement (3 ints, new tensor)"
STEP = "DDP training step (tiny)"


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)  # processes on a shared 2-core machine: one thread each
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    _run(args, backend="gloo", device="cpu")


def _run(args: argparse.Namespace, *, backend: str = "auto", device: str | None = None) -> None:
    from ddpkit import init

    with init(backend=backend, timeout=300, device=device) as dist:
        samples = _measure(dist, args)
        if dist.is_main:
            _report(samples, dist, args)


def _candidates(dist: Any) -> dict[str, Callable[[], object]]:
    """The agreement candidates: each call is one agreement, read back on the host."""
    import torch
    import torch.distributed as tdist

    flag = torch.zeros(1, dtype=torch.int32, device=dist.device)
    three = torch.zeros(3, dtype=torch.int64, device=dist.device)

    def floor() -> object:
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        return flag.item()

    def floor3() -> object:
        tdist.all_reduce(three, op=tdist.ReduceOp.MAX)
        return three.tolist()

    def trainer() -> object:
        # What pyrecover-train's _decide sent every step: stop code, save due, cannot save.
        return dist.all_reduce(torch.tensor([0, 0, 0], device=dist.device), op="max").tolist()

    return {
        FLOOR: floor,
        FLOOR3: floor3,
        ANY: lambda: dist.any_rank(False),
        AGREE: lambda: dist.agree(0, 0, 0),
        TRAINER: trainer,
        "Dist.all_reduce(float)": lambda: dist.all_reduce(1.0, "max"),
        "barrier": dist.barrier,
        "all_gather_object(bool)": lambda: dist.all_gather_object(False),
        "broadcast_object(bool)": lambda: dist.broadcast_object(False),
    }


def _training_step(dist: Any) -> Callable[[], None] | None:
    """One DDP step of the trainer's tiny model, or None without pyrecover-train installed."""
    import torch
    import torch.nn.functional as F

    from ddpkit import wrap_ddp

    try:
        from pyrecover_train.model import build_model, preset_config
    except ImportError:
        return None
    config = preset_config("tiny", vocab_size=VOCAB, max_seq_len=SEQ)
    model = wrap_ddp(build_model(config, seed=0), dist)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.rank)
    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(dist.device)

    def step() -> None:
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _measure(dist: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    """Microseconds per call (per step for the training step), one sample per round."""
    cands = _candidates(dist)
    step = None if args.no_step else _training_step(dist)

    def timed_us(fn: Callable[[], object], n: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    samples: dict[str, list[float]] = {}
    names = list(cands)
    for rnd in range(args.rounds + 1):  # round 0 warms up and is dropped
        # Rotate the order each round and settle after the training step: the first
        # collective after a step ran measurably slower, which would always bill one candidate.
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        timed_us(cands[FLOOR], max(args.iters // 10, 1))
        got = {name: timed_us(cands[name], args.iters) for name in order}
        if step is not None:
            got[STEP] = timed_us(step, args.steps)
        if rnd:
            for name, us in got.items():
                samples.setdefault(name, []).append(us)
    return {name: samples[name] for name in [*names, STEP] if name in samples}


def _report(samples: dict[str, list[float]], dist: Any, args: argparse.Namespace) -> None:
    med = {name: statistics.median(s) for name, s in samples.items()}
    floor, step = med[FLOOR], med.get(STEP)
    rows = [
        [name, f"{us:.1f}", f"{us / floor:.2f}", f"{us / step * 100:.3f}%" if step else "-"]
        for name, us in med.items()
    ]
    where = f"{dist.world_size} processes, {dist.backend}, {dist.device}"
    print_table(
        f"stop agreement, {where} (median of {args.rounds} interleaved rounds; {args.iters} "
        f"calls / {args.steps} steps per sample)",
        ["candidate", "us/call", "x bare all_reduce", "of a tiny step"],
        rows,
    )
    headline = {
        "any_rank_over_all_reduce": med[ANY] / floor,
        "agree_over_all_reduce": med[AGREE] / floor,
        "agree_over_any_rank": med[AGREE] / med[ANY],
        "trainer_agreement_over_agree": med[TRAINER] / med[AGREE],
    }
    if step:
        headline |= {
            "any_rank_over_step": med[ANY] / step,
            "agree_over_step": med[AGREE] / step,
            "trainer_agreement_over_step": med[TRAINER] / step,
        }
    print_table("headline", ["figure", "value"], [[k, f"{v:.4f}"] for k, v in headline.items()])
    out = Path(args.out) if args.out else RESULTS
    write_results(
        "agree",
        {
            "headline": headline,
            "world_size": dist.world_size,
            "backend": dist.backend,
            "device": str(dist.device),
            "model": f"tiny, seq {SEQ}, batch {BATCH}, fp32, DDP, AdamW" if step else None,
            "rounds": args.rounds,
            "iters": args.iters,
            "steps": args.steps,
            "us_median": med,
            "samples_us": samples,
        },
        out,
    )
    agreement = [k for k in med if k != STEP]
    scale, unit = (100 / step, "% of one tiny-model DDP training step") if step else (1, "us")
    bar_chart(
        out / "agree.png",
        agreement,
        [med[k] * scale for k in agreement],
        title=f"Per-step agreement cost, {where}",
        ylabel=f"{unit} (lower is better)",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    quick = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    ap.add_argument("--quick", action="store_true", default=quick, help="a fast smoke run")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds (default 9)")
    ap.add_argument("--iters", type=int, default=None, help="agreement calls per sample")
    ap.add_argument("--steps", type=int, default=None, help="training steps per sample")
    ap.add_argument("--procs", type=int, default=2, help="local processes (no launcher)")
    ap.add_argument("--no-step", action="store_true", help="skip the training step")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 9)
    args.iters = args.iters or (100 if args.quick else 500)
    args.steps = args.steps or (5 if args.quick else 20)
    if min(args.rounds, args.iters, args.steps) < 1 or args.procs < 2:
        ap.error("--rounds, --iters and --steps must be >= 1, --procs >= 2")
    from ddpkit import detect

    if detect().is_distributed:  # under srun / torchrun: measure this job as it is
        _run(args)
        return 0
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _worker, args=(args.procs, port, args), nprocs=args.procs, start_method="spawn"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
