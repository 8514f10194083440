"""``slurmclock`` command line: the job's deadline for bash scripts, and self-requeue.

    slurmclock status [--json]      job id, restarts, deadline (ISO-8601), seconds left, source
    slurmclock seconds-left         an integer, for `$(...)`; exit 1 without a deadline
    slurmclock end-time [--epoch]   the deadline (ISO-8601 or epoch); exit 1 without one
    slurmclock requeue              scontrol requeue $SLURM_JOB_ID; exit 0 only when requeued
                                    (SIGTERM is ignored meanwhile: SLURM sends it at once)

Exit codes: 0 success, 1 the answer is "no" (no deadline, not requeued), 2 usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from slurmclock import __version__
from slurmclock.commands import Runner
from slurmclock.deadline import DeadlineWatcher
from slurmclock.job import array_task, job_id, restart_count
from slurmclock.requeue import requeue

__all__ = ["main", "status"]


def status(
    *,
    end_time: str | None = None,
    time_limit: str | None = None,
    started_at: float | None = None,
    env: Mapping[str, str] | None = None,
    runner: Runner | None = None,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """What ``slurmclock status --json`` prints, as a dict."""
    watcher = DeadlineWatcher(
        end_time=end_time,
        time_limit=time_limit,
        started_at=started_at,
        env=env,
        runner=runner,
        command_timeout=timeout,
    )
    deadline = watcher.get()
    left = deadline.seconds_left(watcher.clock())
    return {
        "job_id": job_id(env),
        "array_task": array_task(env),
        "restart_count": restart_count(env),
        "deadline": deadline.iso(),
        "end_time": deadline.end,
        "seconds_left": None if left is None else round(left, 3),
        "source": deadline.source,
    }


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--job-id", help="job to ask SLURM about (default: $SLURM_JOB_ID)")
    common.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for squeue/scontrol"
    )
    deadline = argparse.ArgumentParser(add_help=False)
    deadline.add_argument("--end-time", help="override: the deadline as epoch seconds or ISO-8601")
    deadline.add_argument(
        "--time-limit",
        help="override: a limit counted from now (seconds, 90m, 2h, or [D-]HH:MM:SS)",
    )
    parser = argparse.ArgumentParser(
        prog="slurmclock",
        description="How much time this SLURM job has left, and self-requeue.",
        epilog="Exit codes: 0 success, 1 no deadline / not requeued, 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"slurmclock {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("status", parents=[common, deadline], help="job, deadline, time left")
    p.add_argument("--json", action="store_true", help="one JSON object (for jq)")
    sub.add_parser(
        "seconds-left",
        parents=[common, deadline],
        help="whole seconds left (rounded down); exit 1 without a deadline",
    )
    p = sub.add_parser(
        "end-time", parents=[common, deadline], help="the deadline; exit 1 without one"
    )
    p.add_argument("--epoch", action="store_true", help="epoch seconds instead of ISO-8601")
    sub.add_parser("requeue", parents=[common], help="scontrol requeue the job; 0 when requeued")
    return parser


def main(
    argv: Sequence[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    runner: Runner | None = None,
) -> int:
    """Entry point of ``slurmclock``; returns the exit code (usage errors exit 2 via argparse)."""
    args = _parser().parse_args(argv)
    # Warnings (a broken squeue, a malformed variable) go to stderr; stdout stays parseable.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("slurmclock: %(levelname)s: %(message)s"))
    logger = logging.getLogger("slurmclock")
    logger.addHandler(handler)
    try:
        return _run(args, env, runner)
    finally:
        logger.removeHandler(handler)


def _run(args: argparse.Namespace, env: Mapping[str, str] | None, runner: Runner | None) -> int:
    if args.job_id:
        env = {**(os.environ if env is None else env), "SLURM_JOB_ID": args.job_id}
    if args.command == "requeue":
        # An accepted requeue makes SLURM send SIGTERM to every process of this run at once:
        # ignored here (and so in scontrol, which inherits it), the answer is still printed and
        # the exit status is still 0 -- SIGKILL comes only KillWait seconds later.
        with _sigterm_ignored():
            result = requeue(env=env, runner=runner, timeout=args.timeout)
            print(result.message, file=sys.stdout if result.ok else sys.stderr, flush=True)
        return 0 if result.ok else 1
    try:
        info = status(
            end_time=args.end_time,
            time_limit=args.time_limit,
            started_at=time.time(),  # the CLI's --time-limit counts from now
            env=env,
            runner=runner,
            timeout=args.timeout,
        )
    except ValueError as e:
        print(f"slurmclock: error: {e}", file=sys.stderr)
        return 2
    if args.command == "status":
        print(json.dumps(info) if args.json else _human(info))
        return 0
    if info["end_time"] is None:
        print(f"slurmclock: no deadline (source: {info['source']})", file=sys.stderr)
        return 1
    if args.command == "seconds-left":
        print(math.floor(info["seconds_left"]))
    else:
        print(math.floor(info["end_time"]) if args.epoch else info["deadline"])
    return 0


@contextlib.contextmanager
def _sigterm_ignored() -> Iterator[None]:
    """SIGTERM ignored inside the block (main thread only; elsewhere nothing changes)."""
    try:
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread: Python cannot touch handlers there
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _human(info: Mapping[str, Any]) -> str:
    job = info["job_id"] or "none (not in a SLURM job)"
    if info["array_task"]:
        job += f" (array task {info['array_task']})"
    left = info["seconds_left"]
    rows = [
        ("job", job),
        ("restarts", str(info["restart_count"])),
        ("deadline", info["deadline"] or "none"),
        ("seconds left", "-" if left is None else str(math.floor(left))),
        ("source", info["source"]),
    ]
    return "\n".join(f"{k + ':':<14}{v}" for k, v in rows)


if __name__ == "__main__":
    sys.exit(main())
