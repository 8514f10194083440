"""Start-up cost: seconds from the allocation's start to the end of the first training step.

Every second of it is a second of the allocation that trains nothing, in every allocation of a
requeued job; so it is measured in parts, shown in the start line and the ``startup`` metrics
event, and summarised by ``pyrecover-train report``:

=============  ================================================================================
part           from -> to
=============  ================================================================================
launch         the allocation's start (SLURM) -> this process's start: batch script, ``srun``
imports        process start -> torch and the packages imported
setup          launcher, process group (with NCCL: the GPU's context too), logging
store          the checkpoint store and its writer lock (first: a second writer is refused at once)
device         determinism switches, precision, the GPU's context (CUDA init; ~0 on CPU)
data           corpus, tokenizer, token cache, loaders
model          model (on the meta device, then memory for it), wrappers, optimizer, LR schedule
resume         where to start, then the checkpoint's load (the model materialised from it)
compile        torch.compile's compilation during the first step (its own timers; the cache in
               the experiment's folder makes a requeued allocation's compile warm)
first step     the rest of the first training step
=============  ================================================================================

Beside the parts, the kernel's count of how long this process was ready to run but waited for a
CPU (``cpu_wait``): a start-up that is slow because the node is oversubscribed (other jobs, too
many loader workers) says so, instead of looking like a slow trainer.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import slurmclock

__all__ = ["PARTS", "Startup", "cpu_wait_seconds"]

PARTS = (
    "launch",
    "imports",
    "setup",
    "store",
    "device",
    "data",
    "model",
    "resume",
    "compile",
    "first step",
)
COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")  # torch._dynamo's


def cpu_wait_seconds(path: str = "/proc/self/schedstat") -> float | None:
    """Seconds this process's main thread has been runnable but waiting for a CPU since it
    started: the kernel's run delay, the second field of ``/proc/self/schedstat`` (nanoseconds).
    None where the kernel keeps no such count (not Linux, no schedstat) or the file is garbled."""
    try:
        with open(path, "rb") as f:
            fields = f.read(256).split()
        waited = int(fields[1])
    except (OSError, IndexError, ValueError):
        return None
    return waited / 1e9 if waited >= 0 else None


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process so far, by dynamo's own timers
    (each compiled frame, and the backward compiled at its first call); 0 when torch's compiler
    was never imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    timers = getattr(utils, "compilation_time_metrics", None) or {}
    return float(sum(sum(timers.get(name, ())) for name in COMPILE_TIMERS))


@dataclass(slots=True)
class Startup:
    """Marks of one process's start-up. ``origin`` is when timing began (epoch seconds): the
    process's start for the command line, the call for an in-process :func:`train`."""

    origin: float
    origin_name: str = "process start"
    clock: Callable[[], float] = time.time
    marks: list[tuple[str, float]] = field(default_factory=list)
    allocation: slurmclock.AllocationStart | None = None
    compiled_before: float = field(default_factory=compile_seconds)
    compile_s: float = 0.0  # compiling inside the first step
    cpu_wait: Callable[[], float | None] = cpu_wait_seconds
    cpu_wait_s: float | None = None  # at the last mark: ready to run, no CPU free

    @classmethod
    def at_process_start(cls) -> Startup:
        return cls(slurmclock.process_start_time())

    @classmethod
    def now(cls) -> Startup:
        return cls(time.time(), "train() call")

    def mark(self, part: str) -> None:
        """``part`` (one of :data:`PARTS`) ended now; a part marked twice adds up."""
        if part not in PARTS or part == "compile":  # compile: torch's timers measure it
            raise ValueError(f"unknown start-up part {part!r}: one of {', '.join(PARTS)}")
        if part == "first step":
            self.compile_s = compile_seconds() - self.compiled_before
        self.cpu_wait_s = self.cpu_wait()
        self.marks.append((part, self.clock()))

    def locate(self) -> None:
        """Ask when the allocation started (``SLURM_JOB_START_TIME`` or one ``squeue``; outside
        SLURM: the process's start). Once, after the first step: it is not on the way to it."""
        if self.allocation is None:
            self.allocation = slurmclock.allocation_start()

    @property
    def from_slurm(self) -> bool:
        return self.allocation is not None and self.allocation.source != "process"

    @property
    def start(self) -> float:
        """Where the count starts: the allocation's start when SLURM gave it (never after this
        process's start: SLURM's start time has whole seconds), else ``origin``."""
        a = self.allocation
        return min(a.at, self.origin) if a is not None and self.from_slurm else self.origin

    @property
    def source(self) -> str:
        a = self.allocation
        if a is not None and self.from_slurm:
            return f"allocation start ({a.source})"
        return self.origin_name

    def parts(self) -> dict[str, float]:
        """Seconds of each part so far, in :data:`PARTS` order (parts not reached are absent)."""
        out: dict[str, float] = {}
        if self.from_slurm:
            out["launch"] = self.origin - self.start
        previous = self.origin
        for part, at in self.marks:
            out[part] = out.get(part, 0.0) + max(0.0, at - previous)
            previous = max(previous, at)
        if self.compile_s > 0 and "first step" in out:
            out["compile"] = min(self.compile_s, out["first step"])
            out["first step"] -= out["compile"]
        return {p: out[p] for p in PARTS if p in out}

    def launch(self) -> float | None:
        """Seconds from the allocation's start to this process's start, once :meth:`locate`
        found the allocation's start in SLURM (else None): the time budget guesses the first
        allocation's exit from it."""
        return self.parts().get("launch") if self.from_slurm else None

    def seconds(self) -> float:
        """From :attr:`start` to the last mark (the first step's end, once it is marked)."""
        last = self.marks[-1][1] if self.marks else self.clock()
        return max(0.0, last - self.start)

    def describe(self) -> str:
        """``4.1 s from the allocation's start (squeue): launch 0.5 s, imports 1.9 s, ...``"""
        parts = ", ".join(f"{p} {s:.1f} s" for p, s in self.parts().items())
        said = f"{self.seconds():.1f} s from the {self.source}: {parts}"
        waited = self.cpu_wait_s
        if waited is not None and waited >= max(1.0, 0.2 * self.seconds()):
            said += f"; {waited:.1f} s of it waiting for a CPU (the node is busy)"
        return said

    def event(self) -> dict[str, object]:
        """The ``startup`` metrics event's fields."""
        return {
            "seconds": round(self.seconds(), 3),
            "parts": {p: round(s, 3) for p, s in self.parts().items()},
            "since": self.source,
            "allocation_start": self.start,
            "cpu_wait": None if self.cpu_wait_s is None else round(self.cpu_wait_s, 3),
        }
