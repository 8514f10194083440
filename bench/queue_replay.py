#!/usr/bin/env python3
"""Our training job in a real, busy SLURM queue: one policy against a replayed workload.

A real SLURM 22.05 (``tools/localslurm.py``: one node whose CPUs stand in for the nodes of a
cluster, see below) with ``sched/backfill`` and ``priority/multifactor`` (age and job size; no
fair share: it needs an accounting database), time-scaled: every duration of the model is divided
by ``--scale`` (20: a 1 h limit is played as 3 min, SLURM's limits being whole minutes, and the
121 s requeue hold as 6 s, ``cred_expire`` taking no value under 5). The other
users' jobs come from the Lublin-Feitelson model (``queue_workload.py``, cited there) and are
``sleep``s of their runtimes with their own limits. Our job is ``queue_standin.sh``: start-up,
steps, a final save before the deadline it reads (``slurmclock end-time``), then the policy's way
to the next allocation:

- ``requeue``: ``scontrol requeue`` (today's default): SLURM holds the job ``cred_expire`` + 1 s
  and resets its submit time (back of the age order);
- ``successor``: ``sbatch --dependency=afterany:JOB`` of the same script and options at the
  stop, then exit: a new job, no hold;
- ``successor-early``: that successor submitted while the job trains, without a dependency
  (slurmclock's ``--successor-early``: the chain's median wait + 60 s before the end, at half of
  the allocation before a wait is known); when it starts it asks the running one to hand over
  (SIGUSR1), which saves and stops (``queue_early.sh``);
- ``+tmin``: submitted with ``--time-min`` (backfill may start it early with a lower limit).

Everything reported is read from SLURM's own records (``scontrol show job`` of every job, kept
for ``MinJobAge``) and the job's timeline (the stand-in's ``events.log``, whose ``alloc`` lines
are SLURM's record of each allocation as it started). Why one node with N CPUs and not N nodes
(``MultiNodeCluster``): backfill plans and reserves CPUs of ``select/cons_tres`` the same way it
does nodes (every job here asks for whole CPUs, one per "node", and runs a sleep), and N
slurmd in namespaces would cost the shared 2-core machine far more than the one slurmctld does.

    python bench/queue_replay.py --policy requeue --load 0.85 --window 12 --out DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from queue_workload import Job, lublin_jobs  # noqa: E402

POLICIES = ("requeue", "requeue+tmin", "successor", "successor+tmin", "successor-early")


def _localslurm() -> Any:
    spec = importlib.util.spec_from_file_location("localslurm", ROOT / "tools/localslurm.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["localslurm"] = mod
    spec.loader.exec_module(mod)
    return mod


def slurm_conf(scale: float) -> dict[str, str]:
    """SLURM's defaults, time-scaled where they are durations (see the module docstring)."""
    return {
        "PriorityType": "priority/multifactor",
        "PriorityWeightAge": "1000",
        "PriorityWeightJobSize": "1000",
        # Default 7 days, scaled.
        "PriorityMaxAge": _hms(7 * 86400 / scale),
        # bf_interval 30 s, bf_resolution 60 s, bf_window 1 day, sched_interval 60 s: scaled.
        "SchedulerParameters": (
            f"sched_interval={max(1, round(60 / scale))},bf_interval={max(1, round(30 / scale))},"
            f"bf_resolution={max(1, round(60 / scale))},bf_window={max(2, round(1440 / scale))},"
            "bf_continue"
        ),
        # cred_expire 120 s: a requeued job is held 121 s, scaled (SLURM takes no value under 5:
        # "AuthInfo=cred_expire=4 invalid", and then holds 121 s; hence the default scale 20).
        "AuthInfo": f"cred_expire={max(5, round(121 / scale - 1))}",
        "KillWait": str(max(1, round(30 / scale))),
        "MinJobAge": "7200",
        "MaxJobCount": "20000",
    }


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def parse_time(text: str) -> float | None:
    """scontrol's local time stamps; None for Unknown/None."""
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except (ValueError, TypeError):
        return None


def parse_record(line: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for word in line.split():
        key, sep, value = word.partition("=")
        if sep and key not in out:
            out[key] = value
    return out


class Replay:
    """Submits the other users' jobs at their (scaled) arrival times from a thread."""

    def __init__(self, cluster: Any, jobs: list[Job], scale: float, t0: float) -> None:
        self.cluster, self.jobs, self.scale, self.t0 = cluster, jobs, scale, t0
        self.stop = threading.Event()
        self.submitted: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for job in self.jobs:
            at = self.t0 + job.arrival / self.scale
            if self.stop.wait(max(0.0, at - time.time())):
                return
            limit = max(1, math.ceil(job.limit_min / self.scale))
            argv = [
                "sbatch", "--parsable", "-J", "other", "-n", str(job.size), "-t", str(limit),
                "-o", "/dev/null", "--no-requeue",
                "--wrap", f"sleep {job.runtime / self.scale:.1f}",
            ]  # fmt: skip
            out = self.cluster.run(argv, check=False, timeout=30)
            if out.returncode == 0:
                self.submitted.append(out.stdout.strip().split(";")[0])


def run_policy(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    localslurm = _localslurm()
    if (why := localslurm.unavailable_reason()) is not None:
        raise SystemExit(f"queue_replay: {why}")
    scale = args.scale
    span_model = (args.warmup + args.window) * 60 * scale
    jobs = (
        lublin_jobs(
            seed=args.seed,
            cluster=args.cluster,
            span_s=span_model,
            load=args.load,
            max_runtime_s=args.max_runtime_h * 3600,
        )
        if args.load > 0
        else []
    )
    state = out / "state"
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    with localslurm.LocalCluster(
        out / "slurm", cpus=args.cluster, extra_conf=slurm_conf(scale)
    ) as cluster:
        t0 = time.time()
        replay = Replay(cluster, jobs, scale, t0)
        replay.thread.start()
        time.sleep(max(0.0, t0 + args.warmup * 60 - time.time()))
        submitted = time.time()
        our = submit_ours(cluster, args, state)
        time.sleep(max(0.0, submitted + args.window * 60 - time.time()))
        ended = time.time()
        replay.stop.set()
        records = all_jobs(cluster)
        replay.thread.join(timeout=30)
        cluster.run(["scancel", "--user=root"], check=False)
    events = read_events(state / "events.log")
    return report(args, records, events, our, submitted, ended, len(jobs))


def submit_ours(cluster: Any, args: argparse.Namespace, state: Path) -> str:
    scale = args.scale
    limit = max(1, round(60 / scale))  # 1 h
    opts = f"-J ours -n {args.size} -t {limit} -o {state}/ours-%j.out --open-mode=append"
    if args.policy.endswith("+tmin"):
        opts += f" --time-min={max(1, round(args.time_min_min / scale))}"
    policy = args.policy.split("+")[0]
    opts += " --requeue" if policy == "requeue" else " --no-requeue"
    env = {
        "STATE": str(state),
        "POLICY": policy,
        "STARTUP": f"{args.startup / scale:.2f}",
        "STEP": f"{args.step / scale:.3f}",
        "SAVE": f"{args.save / scale:.2f}",
        "MARGIN": f"{max(1.0, args.margin / scale):.2f}",
        "SUBMIT_ARGS": opts,
        "STANDIN": str(HERE / "queue_standin.sh"),
        "LEAD": f"{60 / scale:.0f}",  # supervisor/handover.py's LEAD_S, scaled
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    return str(cluster.sbatch(HERE / "queue_standin.sh", *opts.split(), env=env))


def all_jobs(cluster: Any) -> list[dict[str, str]]:
    text = cluster.run(["scontrol", "-o", "show", "job"], timeout=60).stdout
    return [parse_record(line) for line in text.splitlines() if line.startswith("JobId=")]


def read_events(path: Path) -> list[tuple[str, float, str, str]]:
    rows: list[tuple[str, float, str, str]] = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3:
            continue
        try:
            rows.append((parts[0], float(parts[1]), parts[2], parts[3] if len(parts) > 3 else ""))
        except ValueError:
            continue
    return rows


def _allocations(
    events: list[tuple[str, float, str, str]], submitted: float, ended: float
) -> list[dict[str, Any]]:
    """One record per allocation, in the order they started; ``wait_s``: from the previous
    allocation's stop (``submitted`` for the first) to this one's start, 0 when it started
    before (a successor already waiting takes over from a running job)."""
    allocs: list[dict[str, Any]] = []
    for kind, at, job, rest in events:
        if kind == "alloc":
            rec = parse_record(rest)
            start = parse_time(rec.get("StartTime", "")) or at
            allocs.append(
                {
                    "job": job,
                    "start": start,
                    "time_limit": rec.get("TimeLimit"),
                    "time_min": rec.get("TimeMin"),
                    "end_time": rec.get("EndTime"),
                    "granted_s": (parse_time(rec.get("EndTime", "")) or start) - start,
                }
            )
            continue
        mine = next((a for a in reversed(allocs) if a["job"] == job), None)
        if kind == "first_step" and mine is not None:
            mine["first_step"] = at
        elif kind == "stop" and mine is not None:
            mine["stop"] = at
    ready = submitted
    for a in allocs:
        a["wait_s"] = max(0.0, a["start"] - ready)
        if "first_step" in a:
            a["first_step_after_ready_s"] = a.pop("first_step") - ready
        ready = a.get("stop", ready)
    allocs = [a for a in allocs if a["start"] <= ended]
    if allocs and "stop" in allocs[-1] and allocs[-1]["stop"] < ended:
        # Still waiting when the window ends: a wait of at least this long (not an allocation).
        allocs.append({"job": None, "start": None, "wait_s": ended - allocs[-1]["stop"]})
    return allocs


def report(
    args: argparse.Namespace,
    records: list[dict[str, str]],
    events: list[tuple[str, float, str, str]],
    our: str,
    submitted: float,
    ended: float,
    n_jobs: int,
) -> dict[str, Any]:
    window = ended - submitted
    scale = args.scale
    allocs = _allocations(events, submitted, ended)
    saved, steps = trained(events, ended, args.step / scale)
    step_real = args.step / scale
    waits = [a["wait_s"] * scale for a in allocs]
    hours = window * scale / 3600
    return {
        "policy": args.policy,
        "load": args.load,
        "seed": args.seed,
        "scale": scale,
        "window_model_h": round(hours, 2),
        "our_first_job": our,
        "allocations": sum(1 for a in allocs if a["start"] is not None),
        "wait_per_allocation_model_s": _stats(waits),
        "granted_limits": [a["time_limit"] for a in allocs if a["start"] is not None],
        "steps": steps,
        "steps_saved": saved,
        "submitted": submitted,
        "ended": ended,
        "steps_per_model_hour": round(steps / hours, 1),
        "goodput": round(steps * step_real / window, 4),
        "next_first_step_after_stop_model_s": _stats(
            [
                a["first_step_after_ready_s"] * scale
                for a in allocs[1:]
                if "first_step_after_ready_s" in a
            ]
        ),
        "others": others(records, submitted, ended, scale),
        "other_jobs_in_model": n_jobs,
        "allocation_records": allocs,
    }


def trained(
    events: list[tuple[str, float, str, str]], ended: float, step_real: float
) -> tuple[int, int]:
    """(steps saved by ``ended``, steps trained by then): the allocation running at the end
    counts the steps it did (it would save them at its own end), so that a run is not judged by
    where the window happens to cut it."""
    saved = [(at, int(rest.split()[0].split("=")[1])) for k, at, _, rest in events if k == "saved"]
    done = max((n for at, n in saved if at <= ended), default=0)
    first = [at for k, at, _, _ in events if k == "first_step" and at <= ended]
    last_first = max(first, default=None)
    if last_first is not None and not any(last_first < at <= ended for at, _ in saved):
        return done, done + 1 + int((ended - last_first) / step_real)
    return done, done


def rescore(folder: Path) -> None:
    """Recompute each run's steps from its ``state/events.log`` (after a change of the rule)."""
    for path in sorted(folder.glob("*/result.json")):
        r = json.loads(path.read_text())
        events = read_events(path.parent / "state/events.log")
        scale, step_real = r["scale"], 15.0 / r["scale"]
        if "submitted" not in r:
            first = r["allocation_records"][0]
            r["submitted"] = first["start"] - first["wait_s"]
            r["ended"] = r["submitted"] + r["window_model_h"] * 3600 / scale
        window = r["ended"] - r["submitted"]
        r["steps_saved"], r["steps"] = trained(events, r["ended"], step_real)
        allocs = _allocations(events, r["submitted"], r["ended"])
        r["allocations"] = sum(1 for a in allocs if a["start"] is not None)
        r["wait_per_allocation_model_s"] = _stats([a["wait_s"] * scale for a in allocs])
        r["allocation_records"] = allocs
        r["steps_per_model_hour"] = round(r["steps"] / (window * scale / 3600), 1)
        r["goodput"] = round(r["steps"] * step_real / window, 4)
        path.write_text(json.dumps(r, indent=2) + "\n")


def others(records: list[dict[str, str]], t0: float, t1: float, scale: float) -> dict[str, Any]:
    """The other users' jobs submitted in our window: waits and bounded slowdown (10 model
    seconds' bound, as Feitelson's metric), from SLURM's records."""
    waits: list[float] = []
    slow: list[float] = []
    for rec in records:
        if rec.get("JobName") != "other":
            continue
        sub = parse_time(rec.get("SubmitTime", ""))
        start = parse_time(rec.get("StartTime", ""))
        end = parse_time(rec.get("EndTime", ""))
        if sub is None or not t0 <= sub <= t1:
            continue
        state = rec.get("JobState", "")
        if start is None or state == "PENDING" or start > t1:
            waits.append((t1 - sub) * scale)  # still waiting at the end: at least this
            continue
        waits.append((start - sub) * scale)
        if state == "COMPLETED" and end is not None:
            run = max(end - start, 10 / scale)
            slow.append(max(1.0, (end - sub) / run))
    return {
        "jobs": len(waits),
        "wait_model_s": _stats(waits),
        "bounded_slowdown": _stats(slow),
    }


def _stats(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "mean": round(statistics.fmean(values), 1),
        "median": round(statistics.median(values), 1),
        "max": round(max(values), 1),
    }


def summarize(folder: Path) -> list[dict[str, Any]]:
    """One row per ``result.json`` under ``folder`` (runs of several policies, loads and
    seeds), and each one's steps per hour as a ratio of today's (``requeue``) on the same
    replay (load and seed)."""
    rows = []
    for path in sorted(folder.glob("*/result.json")):
        r = json.loads(path.read_text())
        rows.append(
            {
                "run": path.parent.name,
                "policy": r["policy"],
                "load": r["load"],
                "seed": r.get("seed"),
                "allocations": r["allocations"],
                "wait_mean_model_min": round(
                    r["wait_per_allocation_model_s"].get("mean", 0) / 60, 1
                ),
                "steps_per_model_hour": r["steps_per_model_hour"],
                "goodput": r["goodput"],
                "others_wait_mean_model_min": round(
                    r["others"]["wait_model_s"].get("mean", 0) / 60, 1
                ),
                "others_bounded_slowdown_mean": r["others"]["bounded_slowdown"].get("mean"),
            }
        )
    base = {
        (r["load"], r["seed"]): r["steps_per_model_hour"] for r in rows if r["policy"] == "requeue"
    }
    for r in rows:
        b = base.get((r["load"], r["seed"]))
        r["vs_requeue"] = round(r["steps_per_model_hour"] / b, 3) if b else None
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", choices=POLICIES)
    p.add_argument("--summarize", type=Path, help="a folder of runs: print their table")
    p.add_argument("--load", type=float, default=0.85, help="the others' offered load (0: idle)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--scale", type=float, default=20.0, help="model seconds per real second")
    p.add_argument("--cluster", type=int, default=16, help="nodes (CPUs of the one node)")
    p.add_argument("--size", type=int, default=4, help="our job's nodes")
    p.add_argument("--warmup", type=float, default=3.0, help="real minutes before we submit")
    p.add_argument("--window", type=float, default=12.0, help="real minutes we are measured")
    p.add_argument("--max-runtime-h", type=float, default=4.0, help="the partition's MaxTime")
    p.add_argument("--startup", type=float, default=60.0, help="model seconds")
    p.add_argument("--step", type=float, default=15.0, help="model seconds")
    p.add_argument("--save", type=float, default=30.0, help="model seconds")
    p.add_argument("--margin", type=float, default=30.0, help="model seconds for the exit")
    p.add_argument("--time-min-min", type=float, default=20.0, help="model minutes (--time-min)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.summarize is not None:
        rescore(args.summarize)
        rows = summarize(args.summarize)
        (args.summarize / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
        keys = list(rows[0]) if rows else []
        print("| " + " | ".join(keys) + " |")
        print("|" + "---|" * len(keys))
        for r in rows:
            print("| " + " | ".join(str(r[k]) for k in keys) + " |")
        return 0
    if args.policy is None or args.out is None:
        p.error("give --policy and --out (or --summarize FOLDER)")
    args.out.mkdir(parents=True, exist_ok=True)
    result = run_policy(args, args.out)
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    brief = {k: v for k, v in result.items() if k != "allocation_records"}
    print(json.dumps(brief, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
