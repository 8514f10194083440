"""The queue waits our job met in ``queue_replay.py``'s runs, as ``simulate_cluster.py`` draws them.

``simulate_cluster.py`` draws the wait *after* a requeued job may start again: it adds the job's
exit, the requeue and SLURM's requeue hold (``cred_expire`` + 1 s, its ``requeue_delay``)
itself. A replay's ``wait_s`` runs from the previous allocation's stop to the next one's start, so
it holds all of those too: the stand-in's ``scontrol requeue`` and exit (3.8-5.0 s of wall clock
in the committed runs, x20 = 76-100 model seconds) and the hold (6 s, x20 = 120 model seconds).
Taken as they are they would be counted twice. What is taken here is SLURM's own record of the
queue alone, ``StartTime - EligibleTime`` of each allocation (the ``alloc`` lines of the run's
``state/events.log``; a first submission is eligible at once), times the run's ``scale``
(model seconds per wall second; SLURM's times are whole seconds: 20 model seconds apart). A wait
still under way when a run's window ended (the last record, no allocation) counts as what it had
lasted by then, less the run's median stop-to-eligible gap (its requeue and hold): a lower bound.

Runs of one policy are read: ``requeue`` (today's, the default) or ``successor`` (a job submitted
at the stop with ``--dependency=afterany``: SLURM makes it eligible when ours ended, no hold; the
simulator adds only its submission). ``successor-early`` and the ``+tmin`` runs are not read: an
early successor is eligible while ours still runs, and ``--time-min`` changes the allocation's
length, neither of which the simulator models. Everything read is untrusted: a file that
cannot be read, is too large, is not JSON or not a replay's result, a wait that is negative, NaN
or has no SLURM record is skipped and counted; when nothing usable is left, one ValueError line
names the path and the fix. Stdlib only (the repo's tests load it without numpy).
"""

from __future__ import annotations

import calendar
import json
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POLICY = "requeue"
POLICIES = ("requeue", "successor")  # the ones whose StartTime - EligibleTime is a queue wait
MAX_FILES = 1000  # result.json files read under one folder
MAX_BYTES = 8 << 20  # a result.json or events.log larger than this is not a replay's
SLURM_TICK = 1.0  # SLURM's times are whole seconds


@dataclass(frozen=True, slots=True)
class ReplayWaits:
    """Queue waits in model seconds from the ``policy`` runs under ``path``."""

    path: str
    waits: tuple[float, ...]
    policy: str = POLICY
    runs: int = 0  # runs of the policy that gave at least one wait
    under_way: int = 0  # waits still under way at a window's end (lower bounds)
    skipped: Counter[str] = field(default_factory=Counter)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.waits)

    def about(self) -> str:
        cut = f", {self.under_way} of them under way at the window's end (lower bounds)"
        skipped = f"; skipped: {_counts(self.skipped)}" if self.skipped else ""
        job, hold = (
            ("requeued job", "the requeue hold is added by --cred-expire, not counted twice")
            if self.policy == POLICY
            else ("successor job", "eligible when ours ended: no requeue hold")
        )
        return (
            f"MEASURED on a real SLURM (queue_replay.py, {self.path}): SLURM's StartTime - "
            f"EligibleTime of our {job}, x scale, n={len(self.waits)} waits from "
            f"{self.runs} runs{cut if self.under_way else ''} (a small sample; {hold}){skipped}"
        )


def _counts(c: Counter[str]) -> str:
    return ", ".join(f"{n} {why}" for why, n in sorted(c.items()))


def read_replay(path: str | Path, label: str | None = None, policy: str = POLICY) -> ReplayWaits:
    """Every usable queue wait of the ``policy`` runs in ``path`` (a folder of runs, each
    ``RUN/result.json`` + ``RUN/state/events.log``, or one run's folder), named ``label`` (default:
    the path) in ``about()``. Raises ValueError, one line, when none is usable."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: the queue waits of {' or '.join(POLICIES)} are read")
    root = Path(path)
    files = _result_files(root)
    skipped: Counter[str] = Counter()
    waits: list[float] = []
    runs = under_way = 0
    for f in files:
        got = _run_waits(f, skipped, policy)
        if got:
            runs += 1
            waits += [w for w, _ in got]
            under_way += sum(1 for _, cut in got if cut)
    if not waits:
        why = f"{len(files)} result.json read"
        why += f", skipped: {_counts(skipped)}" if skipped else f", none of a {policy!r} run"
        raise ValueError(
            f"{path}: no usable {policy!r} queue waits ({why}); give a folder of "
            "bench/queue_replay.py runs (RUN/result.json + RUN/state/events.log), e.g. "
            "bench/results/queue-busy"
        )
    return ReplayWaits(
        path=label or str(path),
        waits=tuple(waits),
        policy=policy,
        runs=runs,
        under_way=under_way,
        skipped=skipped,
    )


def _result_files(root: Path) -> list[Path]:
    try:
        if (root / "result.json").is_file():
            return [root / "result.json"]
        if not root.is_dir():
            raise ValueError(
                f"{root}: no such folder; give a folder of bench/queue_replay.py runs, "
                "e.g. bench/results/queue-busy"
            )
        return sorted(root.glob("*/result.json"))[:MAX_FILES]
    except OSError as e:
        raise ValueError(f"{root}: cannot be read ({e.strerror}); check the path") from None


def _read_text(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_BYTES:
        return None
    return data.decode("utf-8", errors="replace")


def _run_waits(path: Path, skipped: Counter[str], policy: str) -> list[tuple[float, bool]]:
    """(model seconds, under way at the end) of each usable wait of one run; [] when the run is
    not one of ``policy`` or unusable (counted in ``skipped``)."""
    text = _read_text(path)
    if text is None:
        skipped["unreadable or too large"] += 1
        return []
    try:
        result = json.loads(text)
    except ValueError:
        skipped["not JSON"] += 1
        return []
    if not isinstance(result, dict) or result.get("policy") != policy:
        if not isinstance(result, dict) or not isinstance(result.get("policy"), str):
            skipped["not a replay's result"] += 1
        return []  # another policy's run: not today's queue, not counted as bad
    scale, recs = _number(result.get("scale")), result.get("allocation_records")
    if scale is None or scale <= 0 or not isinstance(recs, list):
        skipped["not a replay's result"] += 1
        return []
    events = _read_text(path.parent / "state" / "events.log")
    slurm = _alloc_waits(events or "")
    return _waits(recs, slurm, scale, skipped)


def _number(x: Any) -> float | None:
    """``x`` as a finite float; None for anything else (a string, a bool, NaN, inf)."""
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return float(x) if ok else None


def _stamp(text: str | None) -> float | None:
    """scontrol's time stamp as seconds (UTC taken: only differences are used)."""
    try:
        return float(calendar.timegm(time.strptime(text or "", "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def _alloc_waits(events: str) -> list[float | None]:
    """StartTime - EligibleTime (wall seconds) of each ``alloc`` line, in order; None where the
    record lacks either."""
    out: list[float | None] = []
    for line in events.splitlines():
        parts = line.split(" ", 3)
        if parts[0] != "alloc" or len(parts) < 4:
            continue
        rec = dict(w.partition("=")[::2] for w in parts[3].split() if "=" in w)
        start, eligible = _stamp(rec.get("StartTime")), _stamp(rec.get("EligibleTime"))
        out.append(None if start is None or eligible is None else start - eligible)
    return out


def _waits(
    recs: list[Any], slurm: list[float | None], scale: float, skipped: Counter[str]
) -> list[tuple[float, bool]]:
    """The run's queue waits (model seconds): each allocation's from SLURM's record (the k-th
    allocation record, the k-th ``alloc`` line), a wait under way at the end from ``wait_s``."""
    got: list[tuple[float, bool]] = []
    gaps: list[float] = []  # stop to eligible: the requeue and its hold, or the submission
    k = 0
    for i, rec in enumerate(recs):
        if not isinstance(rec, dict) or not (
            rec.get("start") is None or _number(rec["start"]) is not None
        ):
            skipped["not an allocation record"] += 1
            continue
        wait, allocated = _number(rec.get("wait_s")), rec.get("start") is not None
        if wait is not None and -SLURM_TICK <= wait < 0:
            wait = 0.0  # SLURM's StartTime is a whole second: up to 1 s before our stop
        queued = (slurm[k] if k < len(slurm) else None) if allocated else None
        k += allocated  # the k-th allocation record is the k-th alloc line
        if wait is None or wait < 0:
            skipped["negative, NaN or missing wait_s"] += 1
        elif not allocated:  # under way when the window ended
            if gaps:
                got.append((max(0.0, wait - statistics.median(gaps)) * scale, True))
            else:
                skipped["wait under way, no requeue measured before it"] += 1
        elif queued is None or queued < 0:
            skipped["no SLURM record of the allocation"] += 1
        else:
            if i > 0:
                gaps.append(max(0.0, wait - queued))
            got.append((queued * scale, False))
    return got
