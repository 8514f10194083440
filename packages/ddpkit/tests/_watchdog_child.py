"""A rank of the watchdog tests: ``python _watchdog_child.py OUTDIR``, launched by torchrun,
mpirun, srun or with SLURM_* variables.

It joins, writes ``OUTDIR/ready<rank>`` (its pid), then all-reduces every 0.1 s -- as a training
loop would -- until ``OUTDIR/finish`` appears (or 600 s pass), and leaves normally. ``TEST_ROLE``
changes one rank: ``gil:R`` makes rank R hold the GIL (a C call through ctypes.PyDLL) for good
after a few steps, ``raise:R`` makes it raise, ``late:R`` makes it keep running 3 s after the
others left (a clean, uneven end), ``fork:R`` makes it fork a child that sleeps 60 s (as a
DataLoader worker would live on; its pid in ``OUTDIR/fork<R>``). Exit 0 after a normal end; the
watchdog's exit is 69.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import ddpkit


def role(rank: int) -> str:
    what, _, who = os.environ.get("TEST_ROLE", "").partition(":")
    return what if who and int(who) == rank else ""


def main() -> int:
    out = Path(sys.argv[1])
    timeout = float(os.environ.get("TEST_TIMEOUT", "60"))
    with ddpkit.init(timeout=timeout) as dist:
        mine = role(dist.rank)
        if mine == "fork":
            child = os.fork()
            if child == 0:
                time.sleep(60)
                os._exit(0)
            (out / f"fork{dist.rank}").write_text(str(child))
        (out / f"ready{dist.rank}").write_text(f"{os.getpid()} {dist.info.master_port}")
        step = 0
        while not dist.any_rank((out / "finish").exists() or step >= 6000):
            if mine == "gil" and step == 5:
                # libc's sleep through PyDLL: the GIL stays held, the heartbeat thread starves.
                ctypes.PyDLL(None).sleep(600)
            if mine == "raise" and step == 5:
                raise KeyError("boom on purpose")
            step += 1
            time.sleep(0.1)
        if mine == "late":
            time.sleep(3)  # no collectives: the others have left
    (out / f"done{dist.rank}").write_text(str(step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
