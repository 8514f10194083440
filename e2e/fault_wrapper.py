#!/usr/bin/env python3
"""TRAIN_CMD of the fault matrix -- the test's side, not product code.

Writes this task's pid to ``$FAULT_DIR/pid.RESTART.RANK`` (so the test can kill, freeze or slow
the very process that trains), then runs ``pyrecover-train`` in this process with the arguments
the shipped sbatch script gives it, at nice 10: the matrix shares the machine's cores with the
scenarios that measure start-up and goodput (its own figures are SLURM's delays, not speed).
``FAULT_CRASH_AT=N``: the task kills itself with SIGSEGV at the first step >= N it logs to
``$FAULT_METRICS`` (a deterministic crash at a fixed step, as a bug in the model code would be;
nothing in the product knows about it).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path


def main() -> None:
    os.nice(int(os.environ.get("FAULT_NICE", "10")))
    folder = Path(os.environ["FAULT_DIR"])
    restart = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
    rank = os.environ.get("SLURM_PROCID", "0") or "0"
    tmp = folder / f".pid.{restart}.{rank}"
    tmp.write_text(str(os.getpid()))
    tmp.rename(folder / f"pid.{restart}.{rank}")  # complete when the test sees it
    crash = os.environ.get("FAULT_CRASH_AT", "")
    if crash and rank == "0":
        metrics = Path(os.environ["FAULT_METRICS"])
        threading.Thread(target=crash_at, args=(int(crash), metrics), daemon=True).start()
    sys.argv = ["pyrecover-train", *sys.argv[1:]]
    runpy.run_module("pyrecover_train", run_name="__main__", alter_sys=True)


def crash_at(step: int, metrics: Path) -> None:
    """SIGSEGV this process at the first ``step`` event >= ``step`` written after it started."""
    offset = metrics.stat().st_size if metrics.exists() else 0
    pending = b""
    while True:
        try:
            with metrics.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        offset += len(chunk)
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "step" and event.get("step", 0) >= step:
                os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(0.002)


if __name__ == "__main__":
    main()
