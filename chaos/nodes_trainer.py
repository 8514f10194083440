"""A stand-in trainer for chaos/test_nodes.py, one per rank under ``srun``: what the node cases
need from a trainer and nothing else (no torch: the cases measure the supervisor and SLURM, and a
case must cost seconds on two busy cores).

Rank 0 steps a state (``sha256`` of the state before and the step: a resume that loses or
repeats a step gives another value) and saves it every ``EVERY`` steps atomically (``ckpt.json``:
tmp, fsync, rename) with a ``checkpoint`` event in the job's timeline; every rank appends
``HOST STEP`` to ``steps-RANK.log`` (which nodes trained). It resumes from ``ckpt.json`` and
exits 0 once ``STEPS`` are done.

    python nodes_trainer.py FOLDER STEPS EVERY STEP_SECONDS
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from slurmclock import JobTimeline


def advance(state: str, step: int) -> str:
    return hashlib.sha256(f"{state}:{step}".encode()).hexdigest()


def straight(steps: int) -> str:
    """The state after ``steps`` steps without any fault."""
    state = "seed"
    for step in range(1, steps + 1):
        state = advance(state, step)
    return state


def main() -> int:
    folder, steps, every, step_s = (
        Path(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        float(sys.argv[4]),
    )
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    ckpt = folder / "ckpt.json"
    saved = json.loads(ckpt.read_text()) if ckpt.exists() else {"step": 0, "state": "seed"}
    step, state = int(saved["step"]), str(saved["state"])
    timeline = JobTimeline()
    host = socket.gethostname()
    with open(folder / f"steps-{rank}.log", "a") as log:
        while step < steps:
            t0 = time.monotonic()
            time.sleep(step_s)
            step += 1
            state = advance(state, step)
            log.write(f"{host} {step}\n")
            log.flush()
            if rank == 0 and step == int(saved["step"]) + 1:
                timeline.mark("first_step", step=step, seconds=round(time.monotonic() - t0, 3))
            if rank == 0 and (step % every == 0 or step == steps):
                tmp = folder / f".ckpt.{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump({"step": step, "state": state}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, ckpt)
                timeline.mark("checkpoint", step=step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
