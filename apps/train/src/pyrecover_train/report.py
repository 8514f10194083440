"""``pyrecover-train report EXP_DIR``: a summary of an experiment across all its allocations, and a
PNG with the loss curve and the checkpoint / stop / resume timeline.

Definitions (each process start is one "run" in the metrics file):

* wall time: from each run's start (its allocation's, when SLURM gave it; else the process's) to
  its last event, summed over runs;
* start-up: from that start to the end of the run's first step (launch, imports, set-up, data,
  model, store, resume, first step: the ``startup`` event);
* persisted steps of a run: those a later run resumed from (or, for the last run, those in its
  last durable checkpoint); steps computed beyond that are *lost* (redone after a restart);
* goodput: time spent in persisted steps / wall time (start-up, saves, evaluation, lost steps and
  idle time are what it is not);
* checkpoint overhead: time training was blocked by saves / wall time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

import slurmclock
from slurmclock.untrusted import quote, read_records

from .config import _Parser
from .metrics import READ_LIMIT, VAL_LOSS, events_of, fmt_duration

PLOT_HINT = "pip install 'pyrecover-train[plot]' (matplotlib)"
NOTHING_TO_DO = "nothing to do"
RUNNING = "running"  # no stop event yet, and still going (Liveness)
# How each run's end is marked on the timeline, and the legend that says so.
MARKERS = {"done": "*", NOTHING_TO_DO: "o", "time": "v", "signal": "x", RUNNING: ">"}
LEGEND = (
    "timeline: | durable checkpoint, ^ resume, v stop (time), x signal, X killed/error, "
    "* done, o nothing to do, > running"
)


@dataclass(slots=True)
class RunSummary:
    run: str
    started: float
    ended: float
    start_step: int
    end_step: int
    persisted_until: int = 0
    step_time_s: float | None = None
    saves: int = 0
    save_blocking_s: float = 0.0
    durable_s: list[float] = field(default_factory=list)
    # done | nothing to do (done at once: already finished) | time | signal | error | killed
    # (no stop event: SIGKILL)
    outcome: str = "killed"
    reason: str = "no stop event (killed or crashed)"
    resumed: bool = False
    startup_s: float | None = None  # start -> end of the first step
    startup_parts: dict[str, float] = field(default_factory=dict)
    # Who ran it (the start event), to tell a run still going from a killed one.
    host: str | None = None
    pid: int | None = None
    job_id: str | None = None
    process_start: float | None = None
    longest_gap_s: float = 0.0  # between two of its events

    @property
    def wall_s(self) -> float:
        return max(0.0, self.ended - self.started)

    @property
    def steps_done(self) -> int:
        return max(0, self.end_step - self.start_step)

    @property
    def persisted_steps(self) -> int:
        return max(0, min(self.persisted_until, self.end_step) - self.start_step)

    @property
    def lost_steps(self) -> int:
        """Computed but not in a checkpoint a later run resumed from; none while it runs."""
        return 0 if self.outcome == RUNNING else self.unsaved_steps

    @property
    def unsaved_steps(self) -> int:
        return self.steps_done - self.persisted_steps


@dataclass(slots=True)
class Summary:
    runs: list[RunSummary]
    final_step: int
    target_steps: int | None
    wall_s: float
    persisted_step_s: float
    lost_steps: int
    save_blocking_s: float
    saves: int
    goodput: float | None
    checkpoint_overhead: float | None
    last_loss: float | None
    last_val_loss: float | None
    startup_s_mean: float | None = None
    startup_s_max: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for r, run in zip(d["runs"], self.runs, strict=True):
            r.update(wall_s=run.wall_s, lost_steps=run.lost_steps, steps_done=run.steps_done)
        return d


def summarize(
    events: list[dict[str, Any]], running: Callable[[RunSummary], str | None] | None = None
) -> Summary:
    """The numbers above, from the events of one metrics file. ``running``: why the last run,
    if it has no stop event, is still going (None: it is not; see :class:`Liveness`)."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by_run.setdefault(str(e.get("run", "?")), []).append(e)
    runs = [_run_summary(rid, evs) for rid, evs in by_run.items()]
    runs.sort(key=lambda r: r.started)
    last = runs[-1] if runs else None  # only the newest run can still be going
    if last is not None and last.outcome == "killed" and running is not None:
        why = running(last)
        if why is not None:
            last.outcome, last.reason = RUNNING, why
    for run, nxt in zip(runs, runs[1:], strict=False):
        run.persisted_until = nxt.start_step if nxt.resumed else run.persisted_until
    wall = sum(r.wall_s for r in runs)
    persisted = sum(r.persisted_steps * (r.step_time_s or 0.0) for r in runs)
    blocking = sum(r.save_blocking_s for r in runs)
    target = next(
        (e["args"].get("training_steps") for e in reversed(events) if e["event"] == "start"),
        None,
    )
    losses = [e["loss"] for e in events if e["event"] == "step" and e.get("loss") is not None]
    vals = [e[VAL_LOSS] for e in events if e["event"] == "eval"]
    startups = [r.startup_s for r in runs if r.startup_s is not None]
    return Summary(
        runs=runs,
        final_step=max((r.end_step for r in runs), default=0),
        target_steps=target,
        wall_s=wall,
        persisted_step_s=persisted,
        lost_steps=sum(r.lost_steps for r in runs),
        save_blocking_s=blocking,
        saves=sum(r.saves for r in runs),
        goodput=persisted / wall if wall > 0 else None,
        checkpoint_overhead=blocking / wall if wall > 0 else None,
        last_loss=losses[-1] if losses else None,
        last_val_loss=vals[-1] if vals else None,
        startup_s_mean=sum(startups) / len(startups) if startups else None,
        startup_s_max=max(startups, default=None),
    )


def _run_summary(rid: str, evs: list[dict[str, Any]]) -> RunSummary:
    start = next((e for e in evs if e["event"] == "start"), evs[0])
    start_step = int(start.get("step") or 0)
    steps = [int(e["step"]) for e in evs if isinstance(e.get("step"), int)]
    run = RunSummary(
        run=rid,
        started=float(
            start["process_start"] if start.get("process_start") is not None else start["time"]
        ),
        ended=max(float(e["time"]) for e in evs),
        start_step=start_step,
        end_step=max([start_step, *steps]),
        persisted_until=start_step,
        resumed=any(e["event"] == "resume" for e in evs),
        host=start.get("host"),
        pid=start.get("pid") if isinstance(start.get("pid"), int) else None,
        job_id=None if start.get("job_id") is None else str(start["job_id"]),
        process_start=start.get("process_start"),
    )
    times = sorted(float(e["time"]) for e in evs)
    run.longest_gap_s = max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)
    timed = [(e["step_time_s"], e.get("steps", 1)) for e in evs if e["event"] == "step"]
    if timed:
        run.step_time_s = sum(t * n for t, n in timed) / sum(n for _, n in timed)
    for e in evs:
        if e["event"] == "save":
            run.saves += 1
            run.save_blocking_s += float(e.get("blocking_s") or 0.0)
        elif e["event"] == "saved":
            run.persisted_until = max(run.persisted_until, int(e["step"]))
            if e.get("total_s") is not None:
                run.durable_s.append(float(e["total_s"]))
        elif e["event"] == "stop":
            run.outcome, run.reason = str(e.get("cause", "done")), str(e.get("reason", ""))
        elif e["event"] == "startup":
            run.startup_s, run.startup_parts = float(e["seconds"]), dict(e.get("parts") or {})
            # The allocation's start (SLURM's) comes before the process's: count from there.
            run.started = min(run.started, float(e.get("allocation_start") or run.started))
    if run.outcome == "done" and not timed and run.end_step == run.start_step:
        run.outcome = NOTHING_TO_DO  # e.g. a requeued job that found the training finished
    return run


# A run whose last event is younger than this (or than 3 of its longest silences) may still be
# going, when neither its process nor SLURM can be asked.
FRESH_S = 120.0


@dataclass(slots=True)
class Liveness:
    """Is a run without a stop event still going? Asked in order:

    1. its process, when it ran on this host: alive and holding ``metrics`` open (the trainer
       keeps it open for the whole run), or gone;
    2. SLURM, when it ran in a job: the job's current allocation began before the process did
       (``slurmclock.allocation_start``: one squeue), or the job moved on to a new allocation;
    3. else its last event: recent for its own pace -- a guess, and said as one.
    """

    metrics: Path
    now: float
    host: str = field(default_factory=socket.gethostname)
    runner: slurmclock.Runner | None = None  # squeue's (tests inject one)

    def __call__(self, run: RunSummary) -> str | None:
        if run.host == self.host and run.pid is not None:
            holds = _holds_open(run.pid, self.metrics)
            if holds is not None:
                return f"its process {run.pid} on this host writes the metrics" if holds else None
        if run.job_id is not None and run.process_start is not None:
            began = self._allocation_start(run.job_id)
            if began is not None:  # SLURM answered
                if began <= float(run.process_start) + 1:
                    return f"SLURM job {run.job_id} is still in the allocation it started in"
                return None  # requeued since: this run's allocation is over
        quiet = self.now - run.ended
        if quiet <= max(FRESH_S, 3 * run.longest_gap_s):
            return f"its last event was {quiet:.0f} s ago (or it was killed just now)"
        return None

    def _allocation_start(self, job_id: str) -> float | None:
        said = logging.getLogger("slurmclock")
        level = said.level
        said.setLevel(logging.ERROR)  # a job SLURM no longer lists is an answer, not a warning
        try:
            found = slurmclock.allocation_start(
                env={"SLURM_JOB_ID": job_id}, runner=self.runner, timeout=5.0
            )
        finally:
            said.setLevel(level)
        return found.at if found.source == "squeue" else None


def _holds_open(pid: int, path: Path) -> bool | None:
    """True when process ``pid`` has ``path`` open, False when it is gone, None when this
    cannot be told (no /proc, another user's process, or it holds other files: the pid taken
    again, or a metrics file it could not open)."""
    if not Path("/proc/self/fd").is_dir():
        return None
    folder = Path(f"/proc/{pid}/fd")
    try:
        fds = list(folder.iterdir())
    except FileNotFoundError:
        return False
    except OSError:
        return None
    target = os.path.realpath(path)
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            if os.readlink(fd) == target:
                return True
    return None


def format_summary(s: Summary) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:.1f}%"

    target = f"/{s.target_steps}" if s.target_steps else ""
    lines = [
        f"step {s.final_step}{target} over {len(s.runs)} run(s), wall {fmt_duration(s.wall_s)}",
        f"goodput {pct(s.goodput)} (time in persisted steps {fmt_duration(s.persisted_step_s)} "
        f"/ wall time)",
        f"lost steps {s.lost_steps} (computed, then redone after a restart)",
        f"checkpoint overhead {pct(s.checkpoint_overhead)} ({s.saves} saves, "
        f"{s.save_blocking_s:.1f} s blocking)",
    ]
    if s.startup_s_max is not None and s.startup_s_mean is not None:
        slowest = max((r for r in s.runs if r.startup_s is not None), key=_startup_key)
        lines.append(
            f"start-up to the first step {s.startup_s_mean:.1f} s mean, {s.startup_s_max:.1f} s "
            f"max ({_parts(slowest.startup_parts)})"
        )
    if s.last_loss is not None:
        val = "" if s.last_val_loss is None else f", validation {s.last_val_loss:.4f}"
        lines.append(f"last loss {s.last_loss:.4f}{val}")
    for i, r in enumerate(s.runs):
        durable = f", durable in {max(r.durable_s):.2f} s max" if r.durable_s else ""
        started = "" if r.startup_s is None else f", first step after {r.startup_s:.1f} s"
        lost = (
            f"{r.unsaved_steps} not saved yet" if r.outcome == RUNNING else f"lost {r.lost_steps}"
        )
        lines.append(
            f"  run {i + 1}: steps {r.start_step}->{r.end_step} in {fmt_duration(r.wall_s)}"
            f"{started}, {r.saves} saves{durable}, {lost}; {r.outcome}: {r.reason}"
        )
    return "\n".join(lines)


def _startup_key(r: RunSummary) -> float:
    return r.startup_s or 0.0


def _parts(parts: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in parts.items())


def plot(events: list[dict[str, Any]], summary: Summary, out: Path) -> Path:
    """Loss curve (top) and step-vs-time timeline with saves, stops and resumes (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_time) = plt.subplots(2, 1, figsize=(9, 7))
    _plot_loss(ax_loss, events, summary)
    _plot_timeline(ax_time, events, summary)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_loss(ax: Any, events: list[dict[str, Any]], summary: Summary) -> None:
    for i, run in enumerate(summary.runs):
        # One line per run: steps redone after a restart overlap instead of zig-zagging.
        pts = [
            (e["step"], e["loss"])
            for e in events
            if e["event"] == "step" and str(e.get("run")) == run.run
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), color=f"C{i % 10}", label=f"train loss, run {i + 1}")
    evals = [e for e in events if e["event"] == "eval"]
    if evals:
        ax.plot([e["step"] for e in evals], [e[VAL_LOSS] for e in evals], "ko", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.set_title("loss")


def _plot_timeline(ax: Any, events: list[dict[str, Any]], summary: Summary) -> None:
    t0 = min((r.started for r in summary.runs), default=0.0)

    def minutes(t: float) -> float:
        return (t - t0) / 60

    for i, run in enumerate(summary.runs):
        evs = [e for e in events if str(e.get("run")) == run.run]
        pts = [(minutes(e["time"]), e["step"]) for e in evs if e["event"] == "step"]
        ax.axvspan(minutes(run.started), minutes(run.ended), color=f"C{i % 10}", alpha=0.08)
        if pts:
            ax.plot(*zip(*pts, strict=True), color=f"C{i % 10}", label=f"run {i + 1}")
        saves = [(minutes(e["time"]), e["step"]) for e in evs if e["event"] == "saved"]
        if saves:
            ax.plot(*zip(*saves, strict=True), "|", color="k", markersize=10)
        marker = MARKERS.get(run.outcome, "X")
        ax.plot(minutes(run.ended), run.end_step, marker, color="C3", markersize=9)
        if run.resumed:
            ax.plot(minutes(run.started), run.start_step, "^", color="C2", markersize=9)
    ax.set_xlabel("minutes since the first start")
    ax.set_ylabel("step")
    ax.set_title(LEGEND, fontsize=9)
    if summary.runs:
        ax.legend(loc="upper left", fontsize=8)


def _parser() -> _Parser:
    p = _Parser(
        prog="pyrecover-train report",
        description="Summarise an experiment (goodput, lost steps, checkpoint overhead) and plot "
        "its loss curve and checkpoint/stop/resume timeline.",
    )
    p.add_argument("exp_dir", type=Path, help="experiment folder (holding metrics.jsonl)")
    p.add_argument("--metrics", type=Path, help="metrics file (default EXP_DIR/metrics.jsonl)")
    p.add_argument("--out", type=Path, help="PNG to write (default EXP_DIR/report.png)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-plot", action="store_true", help="summary only")
    return p


def _read(path: Path) -> tuple[list[dict[str, Any]], Summary] | str:
    """The events and their summary, or the one line that says why there are none."""
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "not found"
        return (
            f"{path} {what}: give the experiment folder (e.g. checkpoints/default-exp) or "
            "--metrics FILE"
        )
    found = read_records(path, limit=READ_LIMIT)
    if found.error is not None:
        return f"{path} cannot be read: {found.error}"
    if found.skipped:  # said once, quoted: the file is another process's
        said = found.describe_skipped(quote(str(path)))
        print(f"pyrecover-train report: {said}", file=sys.stderr)
    events = list(events_of(found))
    if not events:
        return f"{path} holds no events"
    try:
        return events, summarize(events, Liveness(path, time.time()))
    except (KeyError, TypeError, ValueError) as e:  # events of another program, or hand-edited
        return (
            f"{path} is not a metrics file of pyrecover-train (an event lacks or mangles {e}): "
            "give the experiment folder of a run"
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    found = _read(args.metrics or args.exp_dir / "metrics.jsonl")
    if isinstance(found, str):
        print(f"pyrecover-train report: error: {found}", file=sys.stderr)
        return 2
    events, summary = found
    if args.json:
        sys.stdout.write(
            orjson.dumps(summary.to_dict(), option=orjson.OPT_INDENT_2).decode() + "\n"
        )
    else:
        print(format_summary(summary))
    if args.no_plot:
        return 0
    try:
        out = plot(events, summary, args.out or args.exp_dir / "report.png")
    except ImportError:
        print(
            f"pyrecover-train report: no plot: matplotlib is missing: {PLOT_HINT}", file=sys.stderr
        )
        return 1
    except OSError as e:  # --out under a file, a folder we cannot create
        print(f"pyrecover-train report: error: cannot write the plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}", file=sys.stderr if args.json else sys.stdout)
    return 0
