"""What --compile costs a requeued allocation: torch's node-local cache vs. pyrecover-train's.

A requeued job often lands on another node. torch.compile keeps its compiled graphs and kernels
in ``/tmp/torchinductor_USER`` by default: local to the node, and on many clusters wiped with
the job, so every allocation compiles from scratch. pyrecover-train keeps them beside the
experiment (``EXP/compile-cache``, on the file system every allocation sees), so the next
allocation finds them.

Each round runs pyrecover-train three times, as separate processes, interleaved:

* **first allocation**: a fresh experiment, an empty cache (what any run pays once);
* **requeued, torch's default**: the resume of that experiment with ``TORCHINDUCTOR_CACHE_DIR``
  at torch's default place;
* **requeued, pyrecover-train**: the same resume with the shipped default (the experiment's
  ``compile-cache``, filled by the first allocation).

Each run gets an empty ``TMPDIR``, as on a node the job has not run on: torch's default cache
place is there, and so is inductor's precompiled C++ header (kept there whatever the cache
place), which every new node builds again.

Reported from each run's ``startup`` metrics event: the first step (where torch.compile
compiles) and the whole start-up to the end of the first step. Headline: how many times faster
the requeued allocation starts with pyrecover-train's cache than with torch's default.

    python bench/compile_cache.py [--rounds N] [--out DIR] [-- extra trainer flags]
    python bench/compile_cache.py -- --device cuda --model-size 1b --model-dtype bf16  # a GPU

Writes bench/results/compile_cache.json.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import median, print_table, quick, write_results  # noqa: E402

sys.path.insert(0, str(HERE.parent / "apps" / "train" / "tests"))
from train_helpers import make_corpus  # noqa: E402

ENV = "TORCHINDUCTOR_CACHE_DIR"
CASES = ("first allocation", "requeued, torch's default", "requeued, pyrecover-train")


def trainer(args: list[str], env: dict[str, str]) -> None:
    """One pyrecover-train run, as its own process."""
    out = subprocess.run(
        [sys.executable, "-m", "pyrecover_train", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if out.returncode != 0:
        raise SystemExit(f"pyrecover-train failed ({out.returncode}):\n{out.stdout}{out.stderr}")


def node_tmp(work: Path, n: int) -> str:
    folder = work / f"node{n}-tmp"
    folder.mkdir(parents=True)
    return str(folder)


def startup_events(metrics: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("event") == "startup"]


def one_round(work: Path, corpus: Path, extra: list[str]) -> dict[str, dict[str, float]]:
    """The three cases once, in a fresh folder; seconds of the first step and of start-up."""
    ckpt = work / "ckpt"
    flags = [
        *("--dataset", str(corpus), "--cache-dir", str(work.parent / "tokens")),
        *("--checkpoint-dir", str(ckpt), "--tokenizer", "byte", "--eval-every", "0"),
        *("--sequence-length", "32", "--batch-size", "4", "--compile", *extra),
    ]
    base = {k: v for k, v in os.environ.items() if k != ENV}
    base.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    resume = [*flags, "--resume-from-checkpoint", "latest", "--training-steps"]
    # Every allocation on a new node: an empty TMPDIR (its /tmp), where torch's default cache
    # place is and where inductor always keeps its precompiled C++ header.
    trainer([*flags, "--training-steps", "2"], {**base, "TMPDIR": node_tmp(work, 0)})
    tmp = node_tmp(work, 1)  # torch's own place there (pyrecover-train's unless one is set)
    default = os.path.join(tmp, "torchinductor_" + getpass.getuser())
    trainer([*resume, "4"], {**base, "TMPDIR": tmp, ENV: default})
    trainer([*resume, "6"], {**base, "TMPDIR": node_tmp(work, 2)})
    events = startup_events(ckpt / "default-exp" / "metrics.jsonl")
    if len(events) != 3:
        raise SystemExit(f"expected 3 startup events, found {len(events)}")
    return {
        # the first step with its compile (start-up reports compiling as a part of its own)
        case: {
            "first_step_s": e["parts"]["first step"] + e["parts"].get("compile", 0.0),
            "startup_s": e["seconds"],
        }
        for case, e in zip(CASES, events, strict=True)
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1 if quick() else 3)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("extra", nargs="*", help="trainer flags after --, e.g. --device cuda")
    args = p.parse_args(argv)
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")) and "cuda" not in args.extra:
        print("bench/compile_cache.py: torch.compile on CPU needs a C++ compiler (g++)")
        return 2
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as tmp:
        root = Path(tmp)
        corpus = make_corpus(root / "corpus.parquet", docs=200)
        rounds = []
        for i in range(args.rounds):
            rounds.append(one_round(root / f"round{i}", corpus, args.extra))
            print(f"round {i + 1}/{args.rounds}: {json.dumps(rounds[-1])}", flush=True)
    rows, summary = [], {}
    for case in CASES:
        first = median([r[case]["first_step_s"] for r in rounds])
        start = median([r[case]["startup_s"] for r in rounds])
        summary[case] = {"first_step_s": first, "startup_s": start}
        rows.append([case, first, start])
    default, ours = summary[CASES[1]], summary[CASES[2]]
    speedup = default["startup_s"] / ours["startup_s"]
    rows.append(["torch's default / pyrecover-train", "", f"{speedup:.2f}x"])
    print_table(
        f"start-up of a requeued --compile run (median of {args.rounds}; seconds)",
        ["case", "first step (compile)", "start-up to first step done"],
        rows,
    )
    write_results(
        "compile_cache",
        {
            "flags": args.extra,
            "rounds": rounds,
            "median": summary,
            "requeued_startup_speedup": speedup,
            "requeued_first_step_speedup": default["first_step_s"] / ours["first_step_s"],
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
