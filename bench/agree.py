"""What the per-step stop agreement costs, next to a training step: 2-process gloo on CPU.

Every step, pyrecover-train's ranks agree whether to stop (one tiny all-reduce), so one slow
rank's clock or a signal delivered to one rank stops all of them at the same step. This measures,
interleaved round by round in the same two processes:

* the candidates of ``python -m ddpkit.bench_any_rank`` (``Dist.any_rank``, a bare one-element
  ``all_reduce`` -- the floor any agreement pays --, barrier, object collectives), reused as is;
* the trainer's own agreement: ``Dist.all_reduce`` of three ints (stop code, save due, cannot
  save) with MAX, read back with ``.tolist()``;
* a DDP training step of the trainer's ``tiny`` model (sequence 128, batch 8, fp32, AdamW).

Headline: agreement cost / step time (how much of a step the agreement takes) and
``any_rank`` / bare all_reduce. Medians over rounds; rank 0 reports.

    python bench/agree.py [--quick] [--rounds N] [--out DIR]

Writes bench/results/agree.json and agree.png.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, bar_chart, print_table, write_results  # noqa: E402

SEQ, BATCH, VOCAB = 128, 8, 4096


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)  # two processes on a shared 2-core machine: one thread each
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from ddpkit import init

    with init(backend="gloo", timeout=300, device="cpu") as dist:
        samples = _measure(dist, args)
        if dist.is_main:
            _report(samples, dist.backend or "?", args)


def _measure(dist: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    """Microseconds per call (per step for the training step), one sample per round."""
    import torch
    import torch.nn.functional as F

    from ddpkit import wrap_ddp
    from ddpkit.bench_any_rank import measure
    from pyrecover_train.model import build_model, preset_config

    model = wrap_ddp(
        build_model(preset_config("tiny", vocab_size=VOCAB, max_seq_len=SEQ), seed=0), dist
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.rank)
    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)

    def step() -> None:
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def trainer_agreement() -> None:
        # What pyrecover-train's _decide sends: stop code, save due, cannot save.
        agreed = dist.all_reduce(torch.tensor([0, 0, 0]), op="max")
        agreed.tolist()

    def timed_us(fn: Any, n: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    samples: dict[str, list[float]] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up and is dropped
        got = {name: s[0] for name, s in measure(dist, args.iters, 1).items()}
        got["trainer agreement (3 ints)"] = timed_us(trainer_agreement, args.iters)
        got["DDP training step (tiny)"] = timed_us(step, args.steps)
        if rnd:
            for name, us in got.items():
                samples.setdefault(name, []).append(us)
    return samples


def _report(samples: dict[str, list[float]], backend: str, args: argparse.Namespace) -> None:
    med = {name: statistics.median(s) for name, s in samples.items()}
    step = med["DDP training step (tiny)"]
    floor = med["all_reduce 1 int (floor)"]
    rows = [
        [name, f"{us:.1f}", f"{us / floor:.2f}", f"{us / step * 100:.3f}%"]
        for name, us in med.items()
    ]
    print_table(
        f"stop agreement, 2 processes, {backend}, CPU, torch threads 1 (median of {args.rounds} "
        f"interleaved rounds; {args.iters} calls / {args.steps} steps per sample)",
        ["candidate", "us/call", "x bare all_reduce", "of a tiny step"],
        rows,
    )
    headline = {
        "any_rank_over_step": med["Dist.any_rank"] / step,
        "trainer_agreement_over_step": med["trainer agreement (3 ints)"] / step,
        "any_rank_over_all_reduce": med["Dist.any_rank"] / floor,
    }
    print_table("headline", ["figure", "value"], [[k, f"{v:.4f}"] for k, v in headline.items()])
    out = Path(args.out) if args.out else RESULTS
    write_results(
        "agree",
        {
            "headline": headline,
            "world_size": 2,
            "backend": backend,
            "model": f"tiny, seq {SEQ}, batch {BATCH}, fp32, DDP, AdamW",
            "rounds": args.rounds,
            "iters": args.iters,
            "steps": args.steps,
            "us_median": med,
            "samples_us": samples,
        },
        out,
    )
    agreement = [k for k in med if k != "DDP training step (tiny)"]
    bar_chart(
        out / "agree.png",
        agreement,
        [med[k] / step * 100 for k in agreement],
        title="Per-step agreement cost, 2 ranks gloo CPU",
        ylabel="% of one tiny-model DDP training step (lower is better)",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    quick = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    ap.add_argument("--quick", action="store_true", default=quick, help="a fast smoke run")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds (default 7)")
    ap.add_argument("--iters", type=int, default=None, help="agreement calls per sample")
    ap.add_argument("--steps", type=int, default=None, help="training steps per sample")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 7)
    args.iters = args.iters or (100 if args.quick else 500)
    args.steps = args.steps or (5 if args.quick else 20)
    if min(args.rounds, args.iters, args.steps) < 1:
        ap.error("--rounds, --iters and --steps must be >= 1")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(port, args), nprocs=2, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
