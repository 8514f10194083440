"""The race: the same training job under SLURM time limits, three ways, side by side.

    python bench/race.py                     # --times 3,5 (minutes), --steps 800; ~20 min
    python bench/race.py --times 2 --steps 400 --out /tmp/race   # a quicker look

Contestants (same model, data, steps and ``--time``; pyrecover-train's tiny GPT on byte tokens of
its Shakespeare corpus, one CPU thread each, run at the same time on a private SLURM cluster from
tools/localslurm.py):

- ``lightning-builtin``: Lightning's own SLURM support as documented -- ``srun python train.py``
  under ``#SBATCH --signal=SIGUSR1@90``; ``SLURMEnvironment(auto_requeue=True)`` saves
  ``hpc_ckpt_N.ckpt`` inside the SIGUSR1 handler and requeues; the job resumes from it.
- ``lightning+ours``: the same Trainer with ``slurmclock.lightning.TimeAwareCallback`` and
  ``ckptstore.lightning.CkptStoreIO``, under examples/slurm/requeue-on-75.sh (no warning signal:
  the callback reads the end time from SLURM).
- ``pyrecover-train``: the app, under the same wrapper.

Measured from outside: the harness polls ``scontrol show job`` (allocation start/end), and reads
the job logs (the step each allocation resumed from and every step it trained, with timestamps).
Per contestant and allocation length: allocations needed; ``use_share``, the share of the allocated
time that went into persisted steps (persisted steps x the step time of a straight run of the
same program, run side by side with the series, under the same load / the
allocations' ``--time``, the last one counted only until the job finished); ``held_share``, the
same over the time the job actually held the node; lost steps (trained, then not saved); and
whether the final weights equal the straight run's bitwise.
Results: bench/results/race.json and a table on stdout (copied into bench/README.md).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, print_table, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "bench" / "race_worker.py"
WRAPPER = ROOT / "examples" / "slurm" / "requeue-on-75.sh"
CONTESTANTS = ("lightning-builtin", "lightning+ours", "pyrecover-train")
MAX_ALLOCATIONS = 12


def _load_localslurm() -> Any:
    spec = importlib.util.spec_from_file_location("localslurm", ROOT / "tools" / "localslurm.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Allocation:
    start: float
    end: float | None = None
    resumed_from: int | None = None
    trained_to: int | None = None
    useful_s: float = 0.0  # from this allocation's resume to its last persisted step (job log)


@dataclass
class Series:
    contestant: str
    minutes: int
    job_id: str = ""
    state: str = ""
    allocations: list[Allocation] = field(default_factory=list)
    digest: str | None = None


# -- the commands ------------------------------------------------------------------------------


def worker_cmd(mode: str, root: Path, steps: int, cache: Path) -> list[str]:
    return [sys.executable, str(WORKER), "--mode", mode, "--root", str(root), "--steps",
            str(steps), "--cache-dir", str(cache)]  # fmt: skip


def pyrecover_cmd(root: Path, steps: int, cache: Path, *, resume: bool) -> list[str]:
    train = shutil.which("pyrecover-train") or "pyrecover-train"
    cmd = [train, "--tokenizer", "byte", "--model-size", "tiny", "--eval-every", "0",
           "--training-steps", str(steps), "--log-every", "1", "--cache-dir", str(cache),
           "--checkpoint-dir", str(root), "--experiment_name", "race",
           "--async-checkpoint", "--checkpoint-frequency", "100"]  # fmt: skip
    return [*cmd, "--resume-from-checkpoint", "latest"] if resume else cmd


def job_env() -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYRECOVER_END_TIME": ""}


# -- reading what happened ---------------------------------------------------------------------

_STEP = re.compile(r"^RACE (start|step) (\d+) ([\d.]+)$", re.MULTILINE)


def lightning_events(log: str) -> list[tuple[str, int, float]]:
    return [(m.group(1), int(m.group(2)), float(m.group(3))) for m in _STEP.finditer(log)]


def pyrecover_events(metrics: Path) -> list[tuple[str, int, float]]:
    out = []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") in ("start", "step"):
                out.append((e["event"], int(e["step"]), float(e["time"])))
    return out


def step_time(events: list[tuple[str, int, float]]) -> float:
    """Mean seconds per step of an uninterrupted run, after its first 5 steps (warm-up)."""
    steps = [(s, t) for kind, s, t in events if kind == "step" and s > 5]
    (s0, t0), (s1, t1) = steps[0], steps[-1]
    return (t1 - t0) / (s1 - s0)


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, value in sorted(tensors.items()):
        h.update(name.encode() + value.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def pyrecover_digest(root: Path) -> str | None:
    from ckptstore import CheckpointStore

    try:
        with CheckpointStore(str(root / "race"), distributed=False) as store:
            _, values = store.read(keys=["model"])
    except Exception:
        return None
    return weights_digest(values["model"])


def fill_steps(series: Series, events: list[tuple[str, int, float]]) -> None:
    """Assign log events to allocations by time: where each resumed, how far each trained, and
    how long it spent on steps that were persisted (resume -> last step the next one resumed
    from, or the last step of the job). Start-up, lost steps and an early stop are not in it."""
    windows = []
    for alloc in series.allocations:
        end = alloc.end if alloc.end is not None else float("inf")
        mine = [(k, s, t) for k, s, t in events if alloc.start - 1 <= t <= end + 1]
        starts = [(s, t) for k, s, t in mine if k == "start"]
        steps = {s: t for k, s, t in mine if k == "step"}
        alloc.resumed_from = starts[0][0] if starts else None
        alloc.trained_to = max(steps) if steps else alloc.resumed_from
        windows.append((starts[0][1] if starts else None, steps))
    for i, (alloc, (start_t, steps)) in enumerate(zip(series.allocations, windows, strict=True)):
        nxt = series.allocations[i + 1].resumed_from if i + 1 < len(series.allocations) else None
        persisted = nxt if nxt is not None else alloc.trained_to
        if start_t is not None and persisted in steps:
            alloc.useful_s = round(steps[persisted] - start_t, 3)


# -- running -----------------------------------------------------------------------------------


class Straight:
    """Both programs once without any limit, started side by side with a series' jobs, so the
    reference step time is measured under the same load as the race itself. Output goes to
    files: a pipe nobody reads until the end would stall a program once it is full."""

    def __init__(self, work: Path, tag: str, steps: int, cache: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYRECOVER_"))}
        env.update(job_env())
        self.lroot, self.proot = work / f"straight-lightning-{tag}", work / f"straight-pyr-{tag}"
        self.logs = [work / f"straight-lightning-{tag}.log", work / f"straight-pyr-{tag}.log"]
        cmds = (
            worker_cmd("ours", self.lroot, steps, cache),
            pyrecover_cmd(self.proot, steps, cache, resume=False),
        )
        self.procs = []
        for cmd, log in zip(cmds, self.logs, strict=True):
            with open(log, "w") as out:
                self.procs.append(
                    subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
                )

    def wait(self) -> list[str]:
        for proc, log in zip(self.procs, self.logs, strict=True):
            if proc.wait() != 0:
                tail = log.read_text(errors="replace")[-3000:]
                raise SystemExit(f"race: straight run {proc.args!r} failed:\n{tail}")
        return [log.read_text(errors="replace") for log in self.logs]

    def result(self) -> dict[str, Any]:
        lout, _ = self.wait()
        m = re.search(r"^RACE weights (\w+)$", lout, re.MULTILINE)
        return {
            "lightning": {"step_s": step_time(lightning_events(lout)), "digest": m and m.group(1)},
            "pyrecover": {
                "step_s": step_time(pyrecover_events(self.proot / "race" / "metrics.jsonl")),
                "digest": pyrecover_digest(self.proot),
            },
        }


def warm_caches(work: Path, cache: Path) -> None:
    """Build the corpus and token caches once, before anything is timed."""
    Straight(work, "warmup", 2, cache).wait()


def submit(cluster: Any, name: str, minutes: int, work: Path, steps: int, cache: Path) -> str:
    d = work / f"{name}-{minutes}m"
    d.mkdir(parents=True)
    common = ["--cpus-per-task=1", f"--time={minutes}", f"--output={d}/job.out", "--requeue",
              "--open-mode=append", f"--job-name=race-{name}"]  # fmt: skip
    # The jobs' timelines (slurmclock's exit measurements) stay in the race's folder.
    env = {**job_env(), "SLURMCLOCK_DIR": str(work / "timelines")}
    if name == "lightning-builtin":
        line = " ".join(worker_cmd("builtin", d / "root", steps, cache))
        script = f"#!/bin/bash\n#SBATCH --signal=SIGUSR1@90\nsrun {line}\n"
        return str(cluster.sbatch(script, *common, env=env, cwd=d))
    if name == "lightning+ours":
        cmd = worker_cmd("ours", d / "root", steps, cache)
    else:
        cmd = pyrecover_cmd(d / "root", steps, cache, resume=True)
    env["MAX_RESTARTS"] = str(MAX_ALLOCATIONS)
    return str(cluster.sbatch(WRAPPER, *common, env=env, cwd=d, script_args=cmd))


def watch(cluster: Any, series: list[Series], timeout: float) -> None:
    """Poll the jobs; record when each allocation starts and ends (seen from outside)."""
    end = time.monotonic() + timeout
    open_jobs = {s.job_id: s for s in series}
    while open_jobs and time.monotonic() < end:
        now = time.time()
        for job_id, s in list(open_jobs.items()):
            try:
                state = cluster.job(job_id).get("JobState", "")
            except Exception:
                continue
            running = state == "RUNNING"
            current = s.allocations[-1] if s.allocations else None
            if running and (current is None or current.end is not None):
                s.allocations.append(Allocation(start=now))
            elif not running and current is not None and current.end is None:
                current.end = now
            s.state = state
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                del open_jobs[job_id]
            elif len(s.allocations) > MAX_ALLOCATIONS:
                cluster.run(["scancel", job_id], check=False)
                s.state = f"gave up after {MAX_ALLOCATIONS} allocations"
                del open_jobs[job_id]
        time.sleep(1.0)
    for job_id, s in open_jobs.items():
        cluster.run(["scancel", job_id], check=False)
        s.state = f"timed out after {timeout:.0f} s"


def race(
    cluster: Any, minutes: int, work: Path, steps: int, cache: Path
) -> tuple[list[Series], dict[str, Any]]:
    series = [Series(name, minutes) for name in CONTESTANTS]
    straight = Straight(work, f"{minutes}m", steps, cache)
    for s in series:
        s.job_id = submit(cluster, s.contestant, minutes, work, steps, cache)
    watch(cluster, series, timeout=60 * (minutes + 1) * MAX_ALLOCATIONS)
    ref = straight.result()
    print(f"race: {minutes} min: straight runs {json.dumps(ref)}", flush=True)
    read_logs(series, work)
    return series, ref


def read_logs(series: list[Series], work: Path) -> None:
    for s in series:
        d = work / f"{s.contestant}-{s.minutes}m"
        if s.contestant == "pyrecover-train":
            fill_steps(s, pyrecover_events(d / "root" / "race" / "metrics.jsonl"))
            s.digest = pyrecover_digest(d / "root") if s.state == "COMPLETED" else None
        else:
            log = (d / "job.out").read_text(errors="replace")
            fill_steps(s, lightning_events(log))
            m = re.findall(r"^RACE weights (\w+)$", log, re.MULTILINE)
            s.digest = m[-1] if m else None


def figures(s: Series, steps: int, step_s: float, digest: str | None) -> dict[str, Any]:
    allocs = s.allocations
    resumed = [a.resumed_from if a.resumed_from is not None else 0 for a in allocs]
    finished = s.state == "COMPLETED" and s.digest is not None
    persisted = [*resumed[1:], steps if finished else resumed[-1] if resumed else 0]
    lost = [max(0, (a.trained_to or 0) - p) for a, p in zip(allocs, persisted, strict=True)]
    gained = [p - r for p, r in zip(persisted, resumed, strict=True)]
    walls = [(a.end or a.start) - a.start for a in allocs]
    useful = [a.useful_s for a in allocs[:-1]] + ([allocs[-1].useful_s] if finished else [])
    # Allocated time: every allocation's full --time (what stopping early, start-up and unsaved
    # steps throw away), except that the last one counts until the job finished.
    allocated = 60.0 * s.minutes * (len(allocs) - 1) + (
        walls[-1] if finished and allocs else 60.0 * s.minutes
    )
    return {
        "contestant": s.contestant,
        "minutes": s.minutes,
        "state": s.state,
        "allocations": len(allocs),
        "finished": finished,
        "persisted_steps": gained,
        "lost_steps": sum(lost),
        "lost_per_allocation": lost,
        "use_share": round(sum(useful) / allocated, 3) if allocs else 0.0,
        "held_share": round(sum(useful) / sum(walls), 3) if allocs else 0.0,
        # The same estimated from a straight run's step time instead of the job log (drifts
        # with the machine's load: the straight run shares the CPUs with a different crowd).
        "use_share_from_straight_step": round(sum(gained) * step_s / allocated, 3)
        if allocs
        else 0.0,
        "wall_s": [round(w, 1) for w in walls],
        "bitwise_equal_straight": bool(finished and digest and s.digest == digest),
    }


def report(series: list[Series], refs: dict[str, Any], steps: int, out: Path) -> None:
    rows, results = [], []
    for s in series:
        ref = refs[f"{s.minutes}min"]
        r = ref["pyrecover" if s.contestant == "pyrecover-train" else "lightning"]
        f = figures(s, steps, r["step_s"], r["digest"])
        results.append({**f, "series": asdict(s)})
        rows.append([f"{s.minutes} min", f["contestant"], f["allocations"], f["use_share"],
                     f["held_share"], f["lost_steps"], f["bitwise_equal_straight"],
                     f["state"]])  # fmt: skip
        print(json.dumps(f), flush=True)
    print_table(
        f"race: {steps} steps, one CPU thread each",
        ["--time", "contestant", "allocations", "use", "held use", "lost", "bitwise", "state"],
        rows,
    )
    payload = {"steps": steps, "margin": "slurmclock default", "straight": refs}
    write_results("race", {**payload, "results": results}, out)


def recompute(previous: Path, work: Path | None, out: Path) -> int:
    if work is None:
        raise SystemExit("race: --recompute needs --keep DIR, the work dir of that race")
    data = json.loads(previous.read_text())
    series = []
    for r in data["results"]:
        raw = dict(r["series"])
        allocs = [Allocation(start=a["start"], end=a["end"]) for a in raw.pop("allocations")]
        series.append(Series(**{**raw, "allocations": allocs}))
    read_logs(series, work)
    report(series, data["straight"], data["steps"], out)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--times", default="3,5", help="allocation lengths in minutes (sbatch --time)")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps of the job")
    p.add_argument("--out", type=Path, default=RESULTS, help="where race.json goes")
    p.add_argument("--keep", type=Path, default=None, help="keep logs and checkpoints here")
    p.add_argument(
        "--recompute",
        type=Path,
        default=None,
        help="no new race: re-derive the figures from a race.json whose --keep dir still exists",
    )
    args = p.parse_args(argv)
    if args.recompute is not None:
        return recompute(args.recompute, args.keep, args.out)
    minutes = [int(x) for x in args.times.split(",")]
    localslurm = _load_localslurm()
    if (why := localslurm.unavailable_reason()) is not None:
        print(f"race: no SLURM here: {why}", file=sys.stderr)
        return 2
    work = args.keep or Path(tempfile.mkdtemp(prefix="race-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"
    print(f"race: {args.steps} steps, allocations of {minutes} min; work dir {work}", flush=True)
    warm_caches(work, cache)
    refs: dict[str, Any] = {}
    all_series: list[Series] = []
    with localslurm.LocalCluster(work / "slurm", cpus=4) as cluster:
        for m in minutes:
            series, refs[f"{m}min"] = race(cluster, m, work, args.steps, cache)
            all_series.extend(series)
    report(all_series, refs, args.steps, args.out)
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
