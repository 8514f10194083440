"""pyrecover-train's loop overhead: steps/s against a bare PyTorch loop, side by side.

Candidates, interleaved (A B C A B C ...), each timing the same number of steps after warm-up:

* ``bare``        -- a plain loop: same model, same batches (pre-loaded tensors), same AdamW,
                     schedule and gradient clipping; nothing else.
* ``train``       -- pyrecover-train in this process with checkpointing off (the clock, the
                     signal flag, logging and metrics are all on).       target >= 0.97x bare
* ``train+async`` -- pyrecover-train with --async-checkpoint every 10 steps. target >= 0.95x bare

The trainer is measured from outside, by what it writes: the times of its ``step`` events at the
end of the warm-up and at the last step (its loop as a whole: saves, clock, agreement, logging).
The whole run's wall time (start-up included) is reported too. Reported: median seconds per
step of each, and its throughput as a ratio to ``bare``.
Results: bench/results/train.json and train.png.

    python bench/train.py                 # CPU, tiny model (about 2 minutes on 2 cores)
    BENCH_REPEATS=7 BENCH_STEPS=60 python bench/train.py
    python bench/train.py --mfu           # on a GPU: the 1b preset, seq 2048, bf16,
                                          # compile + fused AdamW; prints MFU per GPU
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPEATS = int(os.environ.get("BENCH_REPEATS", "5"))
STEPS = int(os.environ.get("BENCH_STEPS", "40"))
WARMUP = int(os.environ.get("BENCH_WARMUP", "5"))


def make_corpus(path: Path, docs: int = 400) -> Path:
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rnd = random.Random(0)
    words = [
        "the",
        "king",
        "queen",
        "night",
        "day",
        "sword",
        "crown",
        "heart",
        "love",
        "death",
        "time",
        "fair",
        "honour",
    ]
    texts = [
        " ".join(rnd.choice(words) for _ in range(rnd.randint(50, 300))) + "." for _ in range(docs)
    ]
    pq.write_table(pa.table({"text": texts}), path)
    return path


def base_flags(corpus: Path, cache: Path, seq: int, batch: int) -> list[str]:
    return [
        "--dataset", str(corpus), "--cache-dir", str(cache), "--tokenizer", "byte",
        "--model-size", "tiny", "--sequence-length", str(seq), "--batch-size", str(batch),
        "--model-dtype", "fp32", "--eval-every", "0",
        "--log-every", str(math.gcd(WARMUP, STEPS)),  # step events at both ends of the timing
        "--training-steps", str(WARMUP + STEPS),
    ]  # fmt: skip


WHOLE: dict[str, list[float]] = {}  # wall seconds of each whole call, start-up included


def run_trainer(flags: list[str], work: Path, name: str) -> float:
    """Seconds for STEPS steps of pyrecover-train after WARMUP, from its metrics: the time of the
    ``step`` event at the end of the warm-up to that of the last step."""
    import orjson

    from pyrecover_train.config import config_from_args
    from pyrecover_train.session import train

    ckpt = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    cfg = config_from_args([*flags, "--checkpoint-dir", str(ckpt)])
    t0 = time.perf_counter()
    result = train(cfg)
    WHOLE.setdefault(name, []).append(time.perf_counter() - t0)
    assert result.exit_code == 0 and result.metrics_path is not None, result
    lines = result.metrics_path.read_bytes().splitlines()
    at = {e["step"]: e["time"] for e in map(orjson.loads, lines) if e["event"] == "step"}
    return float(at[WARMUP + STEPS] - at[WARMUP])


def bare_loop(corpus: Path, cache: Path, seq: int, batch: int) -> float:
    """The same model, data and optimisation as the trainer, as a plain loop."""
    from parquetlm import PackedLoader, ParquetSource, TokenCache, load_tokenizer
    from pyrecover_train.lr_schedule import warmup_cosine
    from pyrecover_train.model import build_model, preset_config

    source = ParquetSource(str(corpus))
    tok = load_tokenizer("byte", source)
    tcache = TokenCache.build(source, tok, cache / "tokens")
    loader = PackedLoader(tcache, seq_len=seq, batch_size=batch, seed=42)
    batches = [torch.from_numpy(loader.next_batch()) for _ in range(WARMUP + STEPS)]
    torch.manual_seed(42)
    model = build_model(preset_config("tiny", vocab_size=tok.vocab_size, max_seq_len=seq), seed=42)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.95),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine(warmup=30, total=WARMUP + STEPS, min_ratio=0.1)
    )
    t0, start = 0.0, time.perf_counter()
    for i, b in enumerate(batches):
        if i == WARMUP:
            t0 = time.perf_counter()
        logits = model(b[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    end = time.perf_counter()
    WHOLE.setdefault("bare", []).append(end - start)
    return end - t0


def cpu_overhead(args: argparse.Namespace) -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)  # what the trainer does on CPU
    # One thread by default: on a shared machine, threads that wait for a busy core make both
    # candidates noisy; the ratio is what matters. BENCH_THREADS=0 keeps torch's default.
    threads = int(os.environ.get("BENCH_THREADS", "1"))
    if threads:
        torch.set_num_threads(threads)
    seq, batch = args.seq, args.batch
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        work = Path(tmp)
        corpus = make_corpus(work / "corpus.parquet")
        cache = work / "cache"
        flags = base_flags(corpus, cache, seq, batch)
        bare_loop(corpus, cache, seq, batch)  # builds the token cache outside the timings
        WHOLE.clear()
        candidates = {
            "bare": lambda: bare_loop(corpus, cache, seq, batch),
            "train": lambda: run_trainer([*flags, "--checkpoint-frequency", "0"], work, "train"),
            "train+async": lambda: run_trainer(
                [*flags, "--checkpoint-frequency", "10", "--async-checkpoint"], work, "train+async"
            ),
        }
        samples = common.interleaved(candidates, repeats=REPEATS, warmup=1)
    med = {k: common.median(v) / STEPS for k, v in samples.items()}
    ratio = {k: med["bare"] / v for k, v in med.items()}
    targets = {"bare": None, "train": 0.97, "train+async": 0.95}
    rows = [
        [k, f"{med[k] * 1000:.2f}", f"{1 / med[k]:.2f}", f"{ratio[k]:.3f}", targets[k] or "-"]
        for k in candidates
    ]
    common.print_table(
        f"pyrecover-train vs a bare loop (tiny model, seq {seq}, batch {batch}, {STEPS} steps, "
        f"median of {REPEATS}, torch threads {torch.get_num_threads()})",
        ["candidate", "ms/step", "steps/s", "x bare", "target"],
        rows,
    )
    # The first (warm-up) call of each candidate is not in the samples.
    whole = {k: common.median(v[1:]) for k, v in WHOLE.items()}
    common.print_table(
        "whole runs, start-up included (trainer: data, model, store; bare: loader, model)",
        ["candidate", "median s"],
        [[k, f"{v:.2f}"] for k, v in whole.items()],
    )
    data: dict[str, Any] = {
        "whole_run_s": whole,
        "steps": STEPS,
        "repeats": REPEATS,
        "seq_len": seq,
        "batch_size": batch,
        "threads": torch.get_num_threads(),
        "samples_s": samples,
        "median_s_per_step": med,
        "throughput_vs_bare": ratio,
        "targets": targets,
    }
    common.write_results("train", data)
    common.bar_chart(
        common.RESULTS / "train.png",
        [f"{k} (side by side)" for k in ratio],
        list(ratio.values()),
        title="pyrecover-train throughput relative to a bare loop (CPU)",
        ylabel="x bare loop (higher is better; targets 0.97 off, 0.95 async)",
    )


def gpu_mfu(args: argparse.Namespace) -> None:
    """The 1b preset on one GPU: bf16 autocast, compile, fused AdamW; MFU from the metrics."""
    import orjson

    if not torch.cuda.is_available():
        sys.exit("--mfu needs a CUDA GPU")
    from pyrecover_train.config import config_from_args
    from pyrecover_train.session import train

    with tempfile.TemporaryDirectory(prefix="bench-mfu-") as tmp:
        work = Path(tmp)
        corpus = make_corpus(work / "corpus.parquet", docs=4000)
        flags = [
            "--dataset", str(corpus), "--cache-dir", str(work / "cache"),
            "--tokenizer", "byte", "--model-size", args.model_size,
            "--sequence-length", str(args.seq), "--batch-size", str(args.batch),
            "--grad-accum", str(args.grad_accum),
            "--model-dtype", "bf16", "--fused-optimizer", *(["--compile"] if args.compile else []),
            "--training-steps", str(args.steps), "--log-every", "5",
            "--checkpoint-frequency", "0", "--checkpoint-dir", str(work / "ckpt"),
            "--eval-every", "0",
        ]  # fmt: skip
        result = train(config_from_args(flags))
        assert result.metrics_path is not None
        events = [orjson.loads(line) for line in result.metrics_path.read_bytes().splitlines()]
    steps = [e for e in events if e["event"] == "step" and e["step"] > 10]
    mfus = [e["mfu"] for e in steps if e.get("mfu") is not None]
    tps = [e["tokens_per_s_per_rank"] for e in steps]
    data = {
        "gpu": torch.cuda.get_device_name(0),
        "model_size": args.model_size,
        "seq_len": args.seq,
        "batch_size": args.batch,
        "grad_accum": args.grad_accum,
        "compile": args.compile,
        "steps": args.steps,
        "mfu_median": common.median(mfus) if mfus else None,
        "tokens_per_s_per_gpu_median": common.median(tps) if tps else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    common.print_table(
        "MFU per GPU (pyrecover-train)",
        ["gpu", "model", "seq", "batch x accum", "tokens/s/GPU", "MFU"],
        [[
            data["gpu"], args.model_size, args.seq, f"{args.batch} x {args.grad_accum}",
            f"{data['tokens_per_s_per_gpu_median']:.0f}",
            f"{(data['mfu_median'] or 0) * 100:.1f}%",
        ]],
    )  # fmt: skip
    common.write_results("train_mfu", data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mfu", action="store_true", help="GPU MFU measurement instead of CPU overhead")
    p.add_argument("--model-size", default="1b")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--no-compile", dest="compile", action="store_false", help="--mfu: eager")
    args = p.parse_args()
    if args.mfu:
        args.seq = args.seq or 2048
        args.batch = args.batch or 8
        gpu_mfu(args)
    else:
        args.seq = args.seq or 64
        args.batch = args.batch or 8
        cpu_overhead(args)


if __name__ == "__main__":
    main()
