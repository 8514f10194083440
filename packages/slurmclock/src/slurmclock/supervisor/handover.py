"""A successor already waiting (``slurmclock supervise --successor-early``): the next job is
submitted while this one trains, so that it waits in the queue (its age counting) meanwhile.

**When** (:func:`plan_submit`): the expected wait before the end of this allocation, planned from
the waits this chain has seen -- each link's own wait (submit to start, ``squeue -o '%V|%S'``:
no accounting database needed) is exported to its successor in :data:`WAITS`, the last
:data:`KEEP_WAITS` of them; their median, plus :data:`LEAD_S`, before this allocation's end. With
none measured yet: at half of the allocation. Never before this allocation started.

**How**: ``sbatch`` of the same successor command without a dependency (it just pends), exporting
:data:`PREDECESSOR` (this job). When it starts while this job still runs, its supervisor
(:func:`await_predecessor`) sends SIGUSR1 to this job's batch shell (``scancel --batch``): this
supervisor forwards "save and stop now" (SIGTERM) to the step and ends handing over, keeping the
successor. The successor waits until this job has ended -- its processes gone, so the checkpoint
lock released -- at most :func:`handover_bound` seconds (a fraction of its own time left, at most
:data:`HANDOVER_MAX_S`), then cancels it and waits :data:`KILL_S` more; past that it ends itself
(one line): two allocations are never held longer than a hand-over. A stop signal ends the wait.

**Otherwise**: this job reaching its stop first keeps the waiting successor (no second one); this
job finishing training, giving up, being cancelled or stopped (``slurmclock stop``) cancels it;
a refused early submission (``QOSMaxSubmitJobPerUserLimit``, any sbatch error) is one line, and
the successor is submitted at the stop as with ``--successor``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from slurmclock.commands import CommandError, Runner, last_line

__all__ = [
    "HANDOVER_MAX_S",
    "HOLDING",
    "KEEP_WAITS",
    "KILL_S",
    "LEAD_S",
    "PREDECESSOR",
    "WAITS",
    "Early",
    "Waiter",
    "await_predecessor",
    "chain_waits",
    "early_exports",
    "handover_bound",
    "job_state",
    "own_times",
    "plan_submit",
]

PREDECESSOR = "SLURMCLOCK_PREDECESSOR"  # the job an early successor takes over from
WAITS = "SLURMCLOCK_CHAIN_WAITS"  # the chain's measured waits in the queue, seconds, ':'-separated
KEEP_WAITS = 8  # the most recent waits planned from
LEAD_S = 60.0  # submitted this long before the expected wait would end the allocation
HANDOVER_MAX_S = 300.0  # the most a successor waits for its predecessor to save and end
KILL_S = 60.0  # after cancelling the predecessor: SLURM's KillWait (30 s by default) and margin
HOLDING = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING"})
_POLL_S = 1.0


def chain_waits(env: Mapping[str, str]) -> tuple[list[float], int]:
    """The waits :data:`WAITS` carries (another job wrote it: untrusted): the last
    :data:`KEEP_WAITS` whole or decimal seconds >= 0, and how many items were skipped."""
    raw = env.get(WAITS, "")[: 32 * KEEP_WAITS * 2]
    waits: list[float] = []
    bad = 0
    for item in (i.strip() for i in raw.split(":") if i.strip()):
        try:
            value = float(item)
        except ValueError:
            bad += 1
            continue
        if 0 <= value < 1e8:
            waits.append(value)
        else:
            bad += 1
    return waits[-KEEP_WAITS:], bad


def own_times(job: str, run: Runner, timeout: float) -> tuple[float, float] | None:
    """(submitted, started) of ``job`` as epoch seconds (``squeue -h -j JOB -o '%V|%S'``, local
    time as SLURM prints it), or None when SLURM did not say."""
    try:
        out = run(["squeue", "-h", "-j", job, "-o", "%V|%S"], timeout)
    except CommandError:
        return None
    parts = last_line(out).split("|")
    if len(parts) != 2:
        return None
    try:
        submit, start = (time.mktime(time.strptime(p.strip(), "%Y-%m-%dT%H:%M:%S")) for p in parts)
    except (ValueError, OverflowError):
        return None
    return (submit, start) if start >= submit else None


def plan_submit(
    *, started: float, end: float | None, waits: Sequence[float]
) -> tuple[float | None, str]:
    """When to submit the successor early (epoch seconds; None: not early, no end known), and
    why in words."""
    if end is None:
        return None, "no end of this allocation known: the successor is submitted at the stop"
    if not waits:
        at = started + max(0.0, end - started) / 2
        return at, "no wait in the queue measured in this chain yet: at half of the allocation"
    expect = statistics.median(waits)
    at = max(started, end - expect - LEAD_S)
    return at, (
        f"the chain's median wait in the queue is {expect:.0f} s (of {len(waits)}): "
        f"{expect + LEAD_S:.0f} s before the end"
    )


def early_exports(job: str, waits: Sequence[float]) -> dict[str, str]:
    """What the successor is told: its predecessor (this job) and the chain's waits."""
    return {PREDECESSOR: job, WAITS: ":".join(f"{w:.0f}" for w in waits[-KEEP_WAITS:])}


def job_state(job: str, run: Runner, timeout: float) -> str:
    """SLURM's state of ``job`` (``PENDING``, ``RUNNING``, ...); "" when SLURM no longer lists it.
    Raises :class:`CommandError` when squeue did not answer (transient)."""
    try:
        out = run(["squeue", "-h", "-j", job, "-o", "%T"], timeout)
    except CommandError as e:
        if "invalid job id" in f"{e.stderr} {e}".lower():
            return ""
        raise
    return last_line(out).split()[0].upper() if last_line(out) else ""


def handover_bound(seconds_left: float | None) -> float:
    """How long a successor waits for its predecessor to save and end: a quarter of its own
    time left, at most :data:`HANDOVER_MAX_S`, at least 10 s."""
    if seconds_left is None:
        return HANDOVER_MAX_S
    return max(10.0, min(HANDOVER_MAX_S, seconds_left / 4))


@dataclass(slots=True)
class Early:
    """The early successor's state in the supervisor: ``at`` when to submit it (once
    ``planned``; ``waits``: the chain's, this job's too), ``job_id`` once SLURM took it,
    ``done`` once submitted, refused or not to be submitted; ``kept``: the run goes on in it
    (this job's stop came first); ``handed_over``: it started and this job hands over."""

    at: float | None = None
    waits: list[float] = field(default_factory=list)
    job_id: str | None = None
    done: bool = False
    planned: bool = False
    kept: bool = False
    handed_over: bool = False


@dataclass(frozen=True, slots=True)
class Waiter:
    """What :func:`await_predecessor` needs: the runner, the clock, a pause, the log, whether a
    stop signal came (``stopped``), and the command timeout."""

    run: Runner
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    log: Callable[[str], None]
    stopped: Callable[[], bool]
    timeout: float


def await_predecessor(job: str, bound: float, w: Waiter) -> int | None:
    """Ask ``job`` (still holding its allocation) to save and hand over, and wait until it has
    ended: None to go on; an exit status when it did not end (this job ends: never two
    allocations longer than a hand-over) or a stop signal came (None: the caller handles it)."""
    state = _state_or(job, w, "RUNNING")
    if state not in HOLDING:
        return None
    try:
        w.run(["scancel", "--batch", "--signal=USR1", job], w.timeout)
    except CommandError as e:
        w.log(f"could not ask job {job} to hand over ({last_line(e.stderr) or e})")
    w.log(
        f"job {job} (the predecessor) still runs: asked it to save and hand over (SIGUSR1 to "
        f"its batch shell); waiting up to {bound:.0f} s for it to end"
    )
    started = w.clock()
    if _wait_gone(job, started + bound, w):
        _ended(job, started, w)
        return None
    try:
        w.run(["scancel", job], w.timeout)
    except CommandError as e:
        w.log(f"scancel {job}: {last_line(e.stderr) or e}")
    w.log(f"job {job} did not end within {bound:.0f} s of the hand-over: cancelled it")
    if _wait_gone(job, w.clock() + KILL_S, w):
        _ended(job, started, w)
        return None
    w.log(
        f"gave up: job {job} still holds its allocation {KILL_S:.0f} s after scancel; this job "
        "ends rather than hold two allocations (the chain resumes from the newest checkpoint "
        "when you submit again)"
    )
    return 1


def _ended(job: str, started: float, w: Waiter) -> None:
    if not w.stopped():  # a stop: the caller says what comes next
        w.log(f"job {job} ended {w.clock() - started:.1f} s after the hand-over: resuming")


def _wait_gone(job: str, until: float, w: Waiter) -> bool:
    """True once ``job`` no longer holds an allocation or a stop came; False at ``until``."""
    while not w.stopped():
        if _state_or(job, w, "RUNNING") not in HOLDING:
            return True
        if w.clock() >= until:
            return False
        w.sleep(min(_POLL_S, max(0.0, until - w.clock())))
    return True


def _state_or(job: str, w: Waiter, default: str) -> str:
    try:
        return job_state(job, w.run, w.timeout)
    except CommandError:
        return default  # squeue did not answer: asked again at the next poll, bounded
