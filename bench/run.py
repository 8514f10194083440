"""Run the benchmark suites and print one table of headline ratios against their targets.

    python bench/run.py                    # all suites: ckpt ckpt_s3 data train agree simulate
                                           # simulate_cluster compile_cache race (~45 min; the
                                           # race needs SLURM)
    python bench/run.py ckpt data          # some of them
    python bench/run.py --quick            # a smoke run of everything, a few minutes (also
                                           # BENCH_QUICK=1); CI runs it: nox -s bench_smoke
    python bench/run.py --list             # the suites and what each measures
    nox -s bench -- [suites...]            # the same, in a venv with every package installed

Each suite runs as its own process (``bench/SUITE.py``), so one that fails or crashes does not
take the others down; the run goes on and exits 1 at the end if any failed. Results (JSON + PNG
per suite, a log per suite, ``summary.json``) go to bench/results/, or to ``--out``; a quick run
goes to bench/results/quick/ (not committed) unless ``--out`` says otherwise, so it never
overwrites the results of a full run.

Every figure comes from a suite's JSON of THIS run (a suite that leaves an older JSON behind is
reported as failed, not with stale numbers) and is compared with its target from the issues; a
missed target is printed as missed. Ratios from a shared, noisy machine: see each suite's
machine description (load average included) in its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, print_table  # noqa: E402


@dataclass(frozen=True, slots=True)
class Target:
    """One headline figure: where it is in the suite's JSON, and what it must reach."""

    label: str
    get: Callable[[dict[str, Any]], float]
    op: str | None = None  # ">=" or "<=", None: informational, no target
    goal: float | None = None
    unit: str = "x"  # "x" ratio, "%" share, "ms", "Mtok/s"

    def met(self, value: float) -> bool | None:
        if self.op is None or self.goal is None:
            return None
        return value >= self.goal if self.op == ">=" else value <= self.goal

    def show(self, value: float | None) -> str:
        if value is None:
            return "-"
        if self.unit == "%":
            return f"{value * 100:.3g}%"
        if self.unit == "x":
            return f"{value:.3f}x" if abs(value) < 10 else f"{value:.1f}x"
        return f"{value:.3g} {self.unit}"

    def goal_text(self) -> str:
        if self.op is None or self.goal is None:
            return "(no target)"
        return f"{self.op} {self.show(self.goal)}"


@dataclass(frozen=True, slots=True)
class Suite:
    name: str
    about: str
    quick_args: tuple[str, ...] = ()
    quick_env: dict[str, str] = field(default_factory=dict)
    targets: tuple[Target, ...] = ()

    @property
    def script(self) -> Path:
        return HERE / f"{self.name}.py"


def _summary(key: str) -> Callable[[dict[str, Any]], float]:
    return lambda d: float(d["summary"][key])


def _agree(key: str) -> Callable[[dict[str, Any]], float]:
    return lambda d: float(d["headline"][key])


def _worst_restore_ms(d: dict[str, Any]) -> float:
    return max(float(v) for v in d["restore_ms"].values())


def _race(contestant: str, key: str, worst: Callable[..., float] = min) -> Callable[..., float]:
    """A contestant's figure over every allocation length raced (the worst one)."""

    def get(d: dict[str, Any]) -> float:
        rows = [r for r in d["results"] if r["contestant"] == contestant]
        return float(worst(float(r[key]) for r in rows))

    return get


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            "ckpt",
            "checkpoint save/load on a local disk, ~1 GB state (issues 5, 22)",
            quick_args=("--gb", "0.1", "--repeats", "1"),
            targets=(
                Target("sync save vs torch.save+fsync", _summary("sync_vs_torch_save"), ">=", 1.5),
                Target(
                    "sync save vs dcp.save 2 threads", _summary("sync_vs_dcp_2threads"), ">=", 1.2
                ),
                Target(
                    "async save blocking, share of torch.save",
                    _summary("async_blocking_fraction_of_torch_save"),
                    "<=",
                    0.05,
                    "%",
                ),
                Target(
                    "training step slowdown during a persist",
                    _summary("training_slowdown_during_persist"),
                    "<=",
                    0.10,
                    "%",
                ),
                Target(
                    "verified cold load, fresh, vs torch.load",
                    _summary("load_fresh_vs_torch_load"),
                    ">=",
                    1.0,
                ),
                Target(
                    "verified cold load in place vs torch.load+load_state_dict",
                    _summary("load_inplace_vs_torch_load"),
                    ">=",
                    1.0,
                ),
            ),
        ),
        Suite(
            "ckpt_s3",
            "checkpoints on an object store (moto_server) vs s3fs and DCP fsspec (issue 5)",
            quick_args=("--gb", "0.05", "--repeats", "1"),
            targets=(
                Target(
                    "S3 restore vs DCP FsspecReader",
                    _summary("restore_vs_dcp_fsspec_reader"),
                    ">=",
                    10.0,
                ),
                Target(
                    "S3 save vs DCP FsspecWriter", _summary("save_vs_dcp_fsspec_writer"), ">=", 1.0
                ),
            ),
        ),
        Suite(
            "data",
            "parquetlm streaming, restore, tokenization (issue 6)",
            quick_env={"BENCH_DATA_MB": "1", "BENCH_REPEATS": "2"},
            targets=(
                Target(
                    "cached stream",
                    lambda d: float(d["stream_tokens_per_s"]["parquetlm cache stream"]) / 1e6,
                    ">=",
                    100.0,
                    "Mtok/s",
                ),
                Target(
                    "BPE build vs raw encode_batch",
                    lambda d: float(d["bpe_build_vs_raw"]),
                    ">=",
                    0.9,
                ),
                Target("restore, worst of 3 positions", _worst_restore_ms, "<=", 10.0, "ms"),
            ),
        ),
        Suite(
            "train",
            "pyrecover-train vs a bare loop, CPU (issue 7)",
            quick_env={"BENCH_REPEATS": "1", "BENCH_STEPS": "10", "BENCH_WARMUP": "2"},
            targets=(
                Target(
                    "trainer vs bare loop (side by side)",
                    lambda d: float(d["throughput_vs_bare"]["train"]),
                    ">=",
                    0.97,
                ),
                Target(
                    "trainer + async ckpt every 10 steps vs bare (side by side)",
                    lambda d: float(d["throughput_vs_bare"]["train+async"]),
                    ">=",
                    0.95,
                ),
            ),
        ),
        Suite(
            "agree",
            "per-step stop agreement, 2-process gloo (issue 7)",
            quick_args=("--quick",),
            targets=(
                Target("any_rank cost / tiny DDP step", _agree("any_rank_over_step"), unit="%"),
                Target(
                    "trainer's agreement / tiny DDP step",
                    _agree("trainer_agreement_over_step"),
                    unit="%",
                ),
                Target("any_rank / bare all_reduce", _agree("any_rank_over_all_reduce")),
                Target("Dist.agree / bare all_reduce", _agree("agree_over_all_reduce"), "<=", 1.2),
            ),
        ),
        Suite(
            "simulate",
            "time-budget simulator: stop rules per allocation, checkpoint intervals vs MTBF",
            quick_args=("--quick",),
            targets=(  # issue 12
                Target("1.5B profile, 1 h: goodput", _agree("goodput_1b_1h"), ">=", 0.99, "%"),
                Target("1.5B profile, 24 h: goodput", _agree("goodput_1b_24h"), ">=", 0.998, "%"),
                Target("8B profile, 1 h: goodput", _agree("goodput_8b_1h"), ">=", 0.95, "%"),
                Target(
                    "8B profile, 1 h: final saves killed",
                    _agree("final_save_killed_8b_1h"),
                    "<=",
                    0.01,
                    "%",
                ),
                Target(
                    "slurmclock goodput / best other rule, worst case from 30 min",
                    _agree("slurmclock_vs_best_other_min_from_30min"),
                    ">=",
                    1.0,
                ),
                Target(
                    "slurmclock goodput / best other rule, median",
                    _agree("slurmclock_vs_best_other_median"),
                ),
                Target(
                    "slurmclock final save killed, worst case from 30 min",
                    _agree("slurmclock_final_save_killed_max_from_30min"),
                    "<=",
                    0.01,
                    unit="%",
                ),
                Target(
                    "slurmclock final save killed, early allocations (2nd, 6th), from 30 min",
                    _agree("slurmclock_final_save_killed_max_early_from_30min"),
                    unit="%",
                ),
                Target(
                    "Young/Daly auto / best fixed interval, worst case",
                    _agree("auto_vs_best_fixed_min"),
                ),
            ),
        ),
        Suite(
            "simulate_cluster",
            "cluster simulator: a 16-node job over months, queue waits and failures, by "
            "recovery policy (issue 27)",
            quick_args=("--quick",),
            targets=(  # issue 27 sets none (issue 35: the successor): what the policies change
                Target(
                    "no failures, 1 h allocations, idle queue: goodput",
                    _agree("no_failures_idle_1h"),
                    unit="%",
                ),
                Target(
                    "no failures, 1 h allocations, busy queue (replay): goodput",
                    _agree("no_failures_busy_replay_1h"),
                    unit="%",
                ),
                Target(
                    "no failures, 1 h allocations, busy queue GUESSED (was the default): goodput",
                    _agree("no_failures_busy_guess_1h"),
                    unit="%",
                ),
                Target(  # issue 35's goal, on the replay's measured waits
                    "1 h, busy queue (replay): REQUEUE=successor / requeue",
                    _agree("successor_vs_requeue_busy_replay_1h"),
                    ">=",
                    1.5,
                ),
                Target(
                    "1 h, idle queue: REQUEUE=successor / requeue",
                    _agree("successor_vs_requeue_idle_1h"),
                    ">=",
                    1.0,
                ),
                Target(  # the same goal for the opt-in early successor
                    "1 h, busy queue (replay): REQUEUE=successor-early / requeue",
                    _agree("successor_early_vs_requeue_busy_replay_1h"),
                    ">=",
                    1.5,
                ),
                Target(
                    "1 h, idle queue: REQUEUE=successor-early / requeue",
                    _agree("successor_early_vs_requeue_idle_1h"),
                    ">=",
                    1.0,
                ),
                Target(
                    "flaky nodes, 24 h, busy queue (replay): goodput today",
                    _agree("today_flaky_busy_replay_1d"),
                    unit="%",
                ),
                Target(
                    "flaky nodes, 24 h, busy queue (replay): hot spare / today",
                    _agree("hot_spare_flaky_busy_replay_1d_vs_today"),
                ),
                Target(
                    "flaky nodes, 24 h, idle queue: go on with N-1 / today",
                    _agree("N1_flaky_idle_1d_vs_today"),
                ),
                Target(
                    "flaky nodes, 24 h, idle queue: N-1 or requeue / today",
                    _agree("N1_or_requeue_flaky_idle_1d_vs_today"),
                ),
                Target(
                    "flaky nodes, 1 h, busy queue (replay): crash restart / today",
                    _agree("crash_restart_flaky_busy_replay_1h_vs_today"),
                ),
                Target(
                    "flaky nodes, 24 h, busy queue (replay): training one failure costs, today",
                    _agree("minutes_per_failure_today_flaky_busy_replay_1d"),
                    unit="min",
                ),
                Target(
                    "flaky nodes, 24 h, busy queue (replay): training one failure costs, hot spare",
                    _agree("minutes_per_failure_hot_spare_flaky_busy_replay_1d"),
                    unit="min",
                ),
            ),
        ),
        Suite(
            "compile_cache",
            "--compile: a requeued allocation's start-up, torch's cache vs the experiment's",
            # BENCH_QUICK: one round instead of three (each round: three real compiles)
            targets=(
                Target(
                    "requeued start-up, torch's default cache / pyrecover-train's",
                    lambda d: float(d["requeued_startup_speedup"]),
                    ">=",
                    1.0,
                ),
            ),
        ),
        Suite(
            "race",
            "the same job under SLURM time limits: Lightning built-in vs +ours vs pyrecover-train",
            quick_args=("--times", "1", "--steps", "40"),
            targets=(
                Target(
                    "pyrecover-train: steps lost, worst",
                    _race("pyrecover-train", "lost_steps", max),
                    "<=",
                    0,
                    "steps",
                ),
                Target(
                    "pyrecover-train: bitwise equal to a straight run",
                    _race("pyrecover-train", "bitwise_equal_straight"),
                    ">=",
                    1,
                    "(1 = yes)",
                ),
                Target(
                    "Lightning + ckptstore/slurmclock: steps lost, worst",
                    _race("lightning+ours", "lost_steps", max),
                    "<=",
                    0,
                    "steps",
                ),
                Target(
                    "pyrecover-train: use of the allocation", _race("pyrecover-train", "use_share")
                ),
                Target(
                    "Lightning built-in: use of the allocation",
                    _race("lightning-builtin", "use_share"),
                ),
            ),
        ),
    )
}


@dataclass(slots=True)
class Outcome:
    suite: str
    status: str  # "ok", "failed (exit N)", "failed (no results)", ...
    seconds: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)  # as the suite ended (load average)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_suite(suite: Suite, out: Path, quick: bool, timeout: float | None) -> Outcome:
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    result = out / f"{suite.name}.json"
    env = {**os.environ, "BENCH_RESULTS": str(out), "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, str(suite.script)]
    if quick:
        env.update(BENCH_QUICK="1", **suite.quick_env)
        args += suite.quick_args
    print(f"\n=== {suite.name}: {suite.about}\n$ {' '.join(args[1:])}", flush=True)
    start_wall, t0 = time.time(), time.perf_counter()
    status = _stream(args, env, out / "logs" / f"{suite.name}.log", timeout)
    seconds = time.perf_counter() - t0
    if status == "ok" and not (result.exists() and result.stat().st_mtime >= start_wall - 1):
        status = f"failed (exit 0 but no new {result.name})"
    outcome = Outcome(suite.name, status, seconds, machine=machine())
    if result.exists() and status == "ok":
        data = json.loads(result.read_text())
        outcome.rows = [_row(t, data) for t in suite.targets]
    print(f"=== {suite.name}: {status} in {seconds:.0f} s", flush=True)
    return outcome


def _stream(args: list[str], env: dict[str, str], log: Path, timeout: float | None) -> str:
    """Run, echoing output live and into ``log``; the status in words. The suite gets its own
    process group so that a timeout also ends what it started (moto_server, worker processes)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(
            args,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=HERE.parent,
            start_new_session=True,
        )
        assert proc.stdout is not None
        pipe = proc.stdout

        def copy() -> None:
            for line in pipe:
                sys.stdout.write(line)
                sys.stdout.flush()
                f.write(line)

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(e, KeyboardInterrupt):
                raise
            return f"failed (over --timeout {timeout:.0f} s)"
        finally:
            reader.join(timeout=10)
    return "ok" if code == 0 else f"failed (exit {code})"


def _row(t: Target, data: dict[str, Any]) -> dict[str, Any]:
    try:
        value: float | None = t.get(data)
        note = ""
    except (KeyError, TypeError, ValueError) as e:
        value, note = None, f"not in the results ({type(e).__name__}: {e})"
    met = None if value is None else t.met(value)
    verdict = (
        "info" if t.op is None else ("MISSING" if value is None else "met" if met else "NOT MET")
    )
    return {
        "figure": t.label,
        "value": value,
        "shown": t.show(value),
        "target": t.goal_text(),
        "verdict": verdict,
        "note": note,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bench/run.py",
        description=__doc__.split("\n\n")[0],
        epilog="suites: " + ", ".join(SUITES),
    )
    ap.add_argument("suites", nargs="*", default=["all"], help="suite names, or all (default)")
    quick_env = os.environ.get("BENCH_QUICK", "") not in ("", "0")
    ap.add_argument("--quick", action="store_true", default=quick_env, help="fast smoke sizes")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds allowed per suite")
    ap.add_argument("--list", action="store_true", help="list the suites and exit")
    args = ap.parse_args(argv)
    if args.list:
        for s in SUITES.values():
            print(f"{s.name:10s} {s.about}")
        return 0
    names = list(SUITES) if "all" in args.suites else list(dict.fromkeys(args.suites))
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        ap.error(f"unknown suite {', '.join(unknown)}: pick from all, {', '.join(SUITES)}")
    if args.timeout is not None and args.timeout <= 0:
        ap.error("--timeout must be > 0 seconds")
    default_out = HERE / "results" / ("quick" if args.quick else "")
    out = Path(args.out).resolve() if args.out else default_out
    outcomes = [run_suite(SUITES[n], out, args.quick, args.timeout) for n in names]
    return report(outcomes, out, args.quick)


def report(outcomes: list[Outcome], out: Path, quick: bool) -> int:
    rows: list[list[object]] = []
    for o in outcomes:
        if not o.ok:
            rows.append([o.suite, "(suite)", o.status, "-", "FAILED"])
        rows.extend([o.suite, r["figure"], r["shown"], r["target"], r["verdict"]] for r in o.rows)
    info = machine()
    print_table(
        f"headline ratios{' (QUICK smoke sizes: not representative)' if quick else ''}; "
        f"{info.get('processor')}, {info.get('cpus')} CPUs, load {info.get('load_avg_1_5_15')}",
        ["suite", "figure", "value", "target", "verdict"],
        rows,
    )
    judged = [r for o in outcomes for r in o.rows if r["verdict"] != "info"]
    met = sum(r["verdict"] == "met" for r in judged)
    failed = [o.suite for o in outcomes if not o.ok]
    print(
        f"\n{met}/{len(judged)} targets met; suites failed: {', '.join(failed) or 'none'}; "
        f"results in {out}"
    )
    # A run of some suites updates their entries and keeps the others' from earlier runs.
    path = out / "summary.json"
    suites: dict[str, Any] = {}
    if path.exists():
        try:
            suites = json.loads(path.read_text()).get("suites", {})
        except (ValueError, AttributeError):
            suites = {}
    when = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    for o in outcomes:
        suites[o.suite] = {
            "status": o.status,
            "when": when,
            "quick": quick,
            "seconds": round(o.seconds, 1),
            "machine": o.machine,
            "figures": o.rows,
        }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"suites": suites}, indent=2))
    tmp.replace(path)  # never a half-written summary
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
