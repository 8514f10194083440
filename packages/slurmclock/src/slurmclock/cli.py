"""``slurmclock`` command line: the job's deadline for bash scripts, and self-requeue.

    slurmclock status [--json]      job id, restarts, deadline (ISO-8601), seconds left, source;
                                    the run's chain of jobs (allocations, waits, steps)
    slurmclock seconds-left         an integer, for `$(...)`; exit 1 without a deadline
    slurmclock end-time [--epoch]   the deadline (ISO-8601 or epoch); exit 1 without one
    slurmclock requeue              scontrol requeue $SLURM_JOB_ID; exit 0 only when requeued
                                    (SIGTERM is ignored meanwhile: SLURM sends it at once);
                                    marks `requeued` in the job's timeline
    slurmclock mark EVENT [K=V ...] append EVENT (start, signal, saved, exited, requeued) with
                                    the time to the job's timeline; exit 1 when not written
    slurmclock timeline [--json]    the job's timeline (a run of checkpoints as its first and
                                    last; --all: each) and what each run needed after its
                                    final save (exit, requeue); the run's allocations over
                                    requeues, successor jobs and resubmits (slurmclock.chain)
    slurmclock stop JOBID           ask a running job to save and stop now (SIGTERM to its
                                    batch shell, which forwards it; the trainer saves and exits)
    slurmclock supervise -- CMD...  run the job's step (the end of a batch script: exec it);
                                    start it again in the allocation after a failure or a lost
                                    node (a budget of failures), requeue after a stop, the time
                                    limit and preemption; see slurmclock.supervisor

The job is this process's ($SLURM_JOB_ID), or the one given as JOBID or --job-id (status,
seconds-left, end-time, requeue, timeline): from a login shell, its facts (restarts, array task)
come from `scontrol show job` and its timeline is found by the job id alone.

Exit codes: 0 success, 1 the answer is "no" (no deadline, not requeued, not written), 2 usage
error (bad arguments or a malformed PYRECOVER_END_TIME / SLURM_JOB_END_TIME), 141 quietly when
the reader of stdout left early (``| head -1``), as SIGPIPE gives.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn

from slurmclock import __version__
from slurmclock.chain import MAX_JOBS, Chain
from slurmclock.chain import follow as follow_chain
from slurmclock.commands import CommandError, Runner
from slurmclock.deadline import DeadlineWatcher
from slurmclock.durations import check_seconds, parse_time, parse_time_limit
from slurmclock.job import (
    EVENTS,
    RESERVED_KEYS,
    JobFacts,
    Scheduler,
    check_job_id,
    cluster_name,
    job_facts,
    job_id,
    job_id_problem,
    this_job,
)
from slurmclock.requeue import requeue
from slurmclock.schedulers import default_scheduler
from slurmclock.supervisor import SuperviseConfig, Supervisor
from slurmclock.supervisor.config import contradiction
from slurmclock.timeline import Event, ExitSample, JobTimeline, find_timeline

__all__ = ["main", "status"]


def status(
    *,
    end_time: str | None = None,
    time_limit: str | None = None,
    started_at: float | None = None,
    env: Mapping[str, str] | None = None,
    runner: Runner | None = None,
    timeout: float = 10.0,
    job: str | None = None,
    scheduler: Scheduler | None = None,
) -> dict[str, Any]:
    """What ``slurmclock status --json`` prints, as a dict. ``job``: a job this process does not
    run in: its facts come from the scheduler (``restart_count`` None when it does not say), and
    none of this process's job variables (``SLURM_JOB_END_TIME``, ...) is taken for its own."""
    e = os.environ if env is None else env
    asked = default_scheduler(runner, env=e) if scheduler is None else scheduler
    facts = this_job(e) if job is None else job_facts(job, asked, env=e, timeout=timeout)
    if facts.source != "environment":
        e = _outside_the_job(e, str(facts.job_id))
    watcher = DeadlineWatcher(
        end_time=end_time,
        time_limit=time_limit,
        started_at=started_at,
        env=e,
        scheduler=asked,
        command_timeout=timeout,
        background=False,  # one look: no thread
    )
    deadline = watcher.get()
    left = deadline.seconds_left(watcher.clock())
    return {
        "job_id": facts.job_id,
        "array_task": facts.array_task,
        "restart_count": facts.restart,
        "deadline": deadline.iso(),
        "end_time": deadline.end,
        "seconds_left": None if left is None else round(left, 3),
        "source": deadline.source,
    }


def _outside_the_job(env: Mapping[str, str], job: str) -> dict[str, str]:
    """``env`` as a process that is not in a job sees it, asking about ``job``."""
    return {**{k: v for k, v in env.items() if not k.startswith("SLURM_")}, "SLURM_JOB_ID": job}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the usage block and then this
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    common, which, deadline = _shared_options()
    parser = _Parser(
        prog="slurmclock",
        description="How much time this SLURM job has left, and self-requeue.",
        epilog="Exit codes: 0 success, 1 no deadline / not requeued, 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"slurmclock {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    asked = [which, common, deadline]
    p = sub.add_parser("status", parents=asked, help="job, deadline, time left")
    p.add_argument("--json", action="store_true", help="one JSON object (for jq)")
    sub.add_parser(
        "seconds-left",
        parents=asked,
        help="whole seconds left (rounded down); exit 1 without a deadline",
    )
    p = sub.add_parser("end-time", parents=asked, help="the deadline; exit 1 without one")
    p.add_argument("--epoch", action="store_true", help="epoch seconds instead of ISO-8601")
    _job_parsers(sub, common, which)
    _supervise_parser(sub, common)
    return parser


def _shared_options() -> tuple[_Parser, _Parser, _Parser]:
    """The options several commands share: the job and SLURM's timeout, the job as a word,
    the deadline's overrides."""
    common = _Parser(add_help=False)
    common.add_argument("--job-id", help="job to ask SLURM about (default: $SLURM_JOB_ID)")
    common.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for squeue/scontrol"
    )
    which = _Parser(add_help=False)
    which.add_argument(
        "job", nargs="?", metavar="JOBID", help="the job (as --job-id; default: $SLURM_JOB_ID)"
    )
    deadline = _Parser(add_help=False)
    deadline.add_argument("--end-time", help="override: the deadline as epoch seconds or ISO-8601")
    deadline.add_argument(
        "--time-limit",
        help="override: a limit counted from now, as sbatch --time reads it (90 = 90 min, "
        "1:30:00, 2-12:00; 0 or UNLIMITED: none) or with a unit (30s, 1h30m)",
    )
    return common, which, deadline


def _job_parsers(sub: Any, common: argparse.ArgumentParser, which: argparse.ArgumentParser) -> None:
    sub.add_parser(
        "requeue", parents=[which, common], help="scontrol requeue the job; 0 when requeued"
    )
    p = sub.add_parser(
        "mark", parents=[common], help="append an event with the time to the job's timeline"
    )
    p.add_argument("event", choices=EVENTS)
    p.add_argument("info", nargs="*", metavar="KEY=VALUE", help="details to record (rc=75)")
    p = sub.add_parser(
        "timeline", parents=[which, common], help="the job's timeline and its measured exit times"
    )
    p.add_argument("--json", action="store_true", help="one JSON object (for jq)")
    p.add_argument(
        "--all", action="store_true", help="every checkpoint, not a run's first and last"
    )
    p = sub.add_parser(
        "stop",
        parents=[common],
        help="ask a running job to save and stop now (scancel --batch --signal=TERM JOBID)",
    )
    p.add_argument("stop_job", metavar="JOBID", help="the job to stop")


def _supervise_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "supervise",
        parents=[common],
        help="run the job's step; bring it back after anything but done or a user's stop",
    )
    p.add_argument("--name", default="slurmclock", help="prefix of the log lines")
    p.add_argument(
        "--max-failures",
        type=int,
        default=3,
        metavar="N",
        help="stop the chain at N failures in a row at one checkpoint step (3)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=50,
        metavar="N",
        help="no requeue once the job was restarted N times (50)",
    )
    _restart_options(p)
    _next_job_options(p)
    p.add_argument(
        "--no-retry",
        default="2",
        metavar="CODES",
        help="exit statuses not worth a retry, comma-separated (2: usage error)",
    )
    p.add_argument(
        "--resume-hint",
        default=None,
        metavar="TEXT",
        help="how to resume, said when the chain stops ({job}: the job id)",
    )
    p.add_argument(
        "--keep-failed-nodes",
        action="store_true",
        help="do not exclude a node ddpkit reported dead/frozen from the next run",
    )
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")


def _next_job_options(p: argparse.ArgumentParser) -> None:
    """supervise's options for what resumes an unfinished run: no requeue, another job, a
    successor job instead of a requeue (supervisor/successor)."""
    p.add_argument(
        "--no-requeue",
        action="store_true",
        help="never requeue: an unfinished run ends with its status and says how to resume",
    )
    p.add_argument(
        "--next-job-resumes",
        action="store_true",
        help="never requeue: the next array task or chained job resumes (an unfinished run ends 0)",
    )
    p.add_argument(
        "--successor",
        default="",
        metavar="TEXT",
        help="instead of scontrol requeue, submit a job with these sbatch options, script and "
        "arguments after this one (--dependency=afterany): no requeue hold",
    )
    p.add_argument(
        "--time-min",
        type=int,
        default=None,
        metavar="MIN",
        help="the successor's --time-min, raised to the measured start-up + a save + steps",
    )
    p.add_argument(
        "--successor-early",
        action="store_true",
        help="submit the successor while this job trains (planned from the chain's waits in "
        "the queue); when it starts, this job saves and hands over (supervisor/handover)",
    )
    p.add_argument(
        "--run",
        default="",
        metavar="NAME",
        help="the run's name (the experiment): its chain of jobs is recorded under it",
    )
    p.add_argument(
        "--continue-run",
        action="store_true",
        help="with --run: a job that is not a successor goes on as the next link of the run's "
        "chain once its newest job has ended (a resubmit with --continue)",
    )


def _restart_options(p: argparse.ArgumentParser) -> None:
    """supervise's options for a step started again in the allocation, and its nodes."""
    p.add_argument(
        "--no-restart-here",
        action="store_true",
        help="after a failure, requeue instead of starting the step again in the allocation",
    )
    p.add_argument(
        "--relaunch-args",
        default="",
        metavar="TEXT",
        help="words appended to the step when it starts again in the allocation (its resume flag)",
    )
    for flag, default, what in (
        ("--spare-nodes", 0, "nodes of the allocation kept idle to replace a lost one (0)"),
        ("--min-nodes", 1, "the fewest nodes the step goes on with after a node loss (1)"),
        ("--step-nodes", None, "the most nodes the step trains on (the allocation's, less spares)"),
        ("--tasks-per-node", None, "the step's tasks per node (the job's)"),
    ):
        p.add_argument(flag, type=int, default=default, metavar="N", help=what)


def _no_retry(text: str) -> frozenset[int] | None:
    """``--no-retry``'s exit statuses; None (said in one line) when they are not numbers."""
    items = [c.strip() for c in text.split(",") if c.strip()]
    if not all(c.isdigit() for c in items):
        print(
            f"slurmclock: error: --no-retry {text!r}: give exit statuses separated "
            "by commas, e.g. --no-retry 2,3 (or --no-retry '' for none)",
            file=sys.stderr,
        )
        return None
    return frozenset(int(c) for c in items)


def _supervise(
    args: argparse.Namespace, env: Mapping[str, str] | None, runner: Runner | None
) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        print(
            "slurmclock: error: give the step to run after --, e.g. slurmclock supervise -- "
            "srun python train.py",
            file=sys.stderr,
        )
        return 2
    codes = _no_retry(args.no_retry)
    if codes is None:
        return 2
    try:
        extra: dict[str, Any] = {"run": args.run, "continue_run": args.continue_run}
        extra |= {} if args.resume_hint is None else {"resume_hint": args.resume_hint}
        config = SuperviseConfig(
            name=args.name,
            max_failures=args.max_failures,
            max_restarts=args.max_restarts,
            requeue=not (args.no_requeue or args.next_job_resumes),
            next_job_resumes=args.next_job_resumes,
            no_retry=codes,
            exclude_failed_nodes=not args.keep_failed_nodes,
            command_timeout=args.timeout,
            restart_here=not args.no_restart_here,
            spare_nodes=args.spare_nodes,
            min_nodes=args.min_nodes,
            step_nodes=args.step_nodes,
            tasks_per_node=args.tasks_per_node,
            relaunch_args=tuple(shlex.split(args.relaunch_args)),
            successor=tuple(shlex.split(args.successor)),
            successor_time_min=args.time_min,
            successor_early=args.successor_early,
            **extra,
        )
    except ValueError as e:
        print(f"slurmclock: error: supervise: {e}", file=sys.stderr)
        return 2
    problem = contradiction(config, env)
    if problem is not None:  # before anything runs: one line, exit 2
        print(f"slurmclock: error: supervise: {problem}", file=sys.stderr)
        return 2
    return Supervisor(config, env=env, runner=runner).run(argv)


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
        code = _run(args, env, runner)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except BrokenPipeError:  # `slurmclock ... | head -1`: the reader is done; so are we
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        print("slurmclock: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        logger.removeHandler(handler)


def _run(args: argparse.Namespace, env: Mapping[str, str] | None, runner: Runner | None) -> int:
    problem = _bad_input(args, os.environ if env is None else env)
    if problem:
        print(f"slurmclock: error: {problem}", file=sys.stderr)
        return 2
    args.target = _target(args, os.environ if env is None else env)
    if args.command == "supervise" and args.target is not None:
        env = {**(os.environ if env is None else env), "SLURM_JOB_ID": args.target}
    command = _COMMANDS.get(args.command)
    if command is not None:
        return command(args, env, runner)
    try:
        info = status(
            end_time=args.end_time,
            time_limit=args.time_limit,
            started_at=time.time(),  # the CLI's --time-limit counts from now
            env=env,
            runner=runner,
            timeout=args.timeout,
            job=args.target,
        )
    except ValueError as e:
        print(f"slurmclock: error: {e}", file=sys.stderr)
        return 2
    _warn_if_past(info)
    if args.command == "status":
        chain = _chain_of(args, env, runner)
        if args.json:
            print(json.dumps({**info, "chain": None if chain is None else chain.to_json()}))
        else:
            print("\n".join([_human(info), *_chain_status(chain)]))
        return 0
    if info["end_time"] is None:
        print(f"slurmclock: no deadline (source: {info['source']})", file=sys.stderr)
        return 1
    if args.command == "seconds-left":
        print(math.floor(info["seconds_left"]))
    else:
        print(math.floor(info["end_time"]) if args.epoch else info["deadline"])
    return 0


def _bad_input(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """One line naming what is wrong and how to fix it, or None."""
    given = getattr(args, "job", None)
    try:
        check_seconds("--timeout", args.timeout, positive=True)
        flag = None if args.job_id is None else check_job_id(args.job_id, "--job-id")
        word = None if given is None else check_job_id(given, "JOBID")
    except ValueError as e:
        return str(e)
    if flag is not None and word is not None and flag != word:
        return f"JOBID {given!r} and --job-id {args.job_id!r} name two jobs; give one of them"
    if args.timeout > MAX_TIMEOUT:
        return f"--timeout {args.timeout:g} is more than {MAX_TIMEOUT:.0f} s; give fewer seconds"
    if flag is None and word is None and args.command != "stop":
        problem = job_id_problem(env)
        if problem:
            return f"{problem}; unset it, or pass --job-id"
    if args.command not in ("status", "seconds-left", "end-time"):
        return None
    if args.end_time is not None and args.time_limit is not None:
        return (
            f"--end-time {args.end_time!r} and --time-limit {args.time_limit!r} both set the "
            "deadline; give one of them"
        )
    for flag, value, reader in (
        ("--end-time", args.end_time, parse_time),
        ("--time-limit", args.time_limit, parse_time_limit),
    ):
        if value is not None:
            try:
                reader(value)
            except ValueError as e:
                return f"{flag}: {e}"
    # Training skips a malformed variable with a warning; here the user asked about it.
    for name in ("PYRECOVER_END_TIME", "SLURM_JOB_END_TIME"):
        raw = env.get(name, "").strip()
        if raw:
            try:
                parse_time(raw)
            except ValueError as e:
                return f"{name}: {e}; unset it or give epoch seconds / ISO-8601"
    return None


def _target(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """The job asked about when it is not this process's own (checked by _bad_input)."""
    given = args.job_id if args.job_id is not None else getattr(args, "job", None)
    if given is None:
        return None
    job = check_job_id(given)
    return None if job_id_problem(env) is None and job == job_id(env) else job


def _timeline_of(
    args: argparse.Namespace, env: Mapping[str, str] | None, runner: Runner | None, *, facts: bool
) -> JobTimeline:
    """The timeline of the job asked about; ``facts``: ask SLURM for its restart count (to
    write in it). ValueError when the job's file cannot be told apart from another's."""
    e = os.environ if env is None else env
    if args.target is None:
        return JobTimeline(env=e)
    scheduler = default_scheduler(runner, env=e)
    if facts:
        job = job_facts(args.target, scheduler, env=e, timeout=args.timeout)
    else:
        job = JobFacts(job_id=args.target, restart=None, cluster=cluster_name(e), source="none")
    return find_timeline(job, env=e, scheduler=scheduler)


def _requeue(args: argparse.Namespace, env: Mapping[str, str] | None, runner: Runner | None) -> int:
    # An accepted requeue makes SLURM send SIGTERM to every process of this run at once:
    # ignored here (and so in scontrol, which inherits it), the answer is still printed and
    # the exit status is still 0 -- SIGKILL comes only KillWait seconds later.
    with _sigterm_ignored():
        try:
            timeline = _timeline_of(args, env, runner, facts=True)
        except ValueError as e:
            print(f"slurmclock: error: {e}", file=sys.stderr)
            return 2
        result = requeue(
            args.target, env=env, runner=runner, timeout=args.timeout, timeline=timeline
        )
        print(result.message, file=sys.stdout if result.ok else sys.stderr, flush=True)
    return 0 if result.ok else 1


def _mark(args: argparse.Namespace, env: Mapping[str, str] | None, runner: Runner | None) -> int:
    info: dict[str, Any] = {}
    for item in args.info:
        problem = _bad_detail(item)
        if problem:
            print(f"slurmclock: error: {problem}", file=sys.stderr)
            return 2
        key, _, value = item.partition("=")
        info[key] = int(value) if re.fullmatch(r"-?[0-9]{1,18}", value) else value
    try:
        timeline = _timeline_of(args, env, runner, facts=True)
    except ValueError as e:
        print(f"slurmclock: error: {e}", file=sys.stderr)
        return 2
    if timeline.path is None:
        print("slurmclock: not marked: not in a SLURM job (SLURM_JOB_ID is unset)", file=sys.stderr)
        return 1
    return 0 if timeline.mark(args.event, **info) else 1


def _bad_detail(item: str) -> str | None:
    """Why ``KEY=VALUE`` cannot be a detail of a timeline line (one line), or None."""
    key, sep, value = item.partition("=")
    if not sep or not key.isidentifier():
        return f"{item[:60]!r} is not KEY=VALUE (e.g. rc=75)"
    if key in RESERVED_KEYS:
        return (
            f"{key!r} is reserved: every timeline line has {', '.join(RESERVED_KEYS)}; name the "
            "detail otherwise (e.g. why=...)"
        )
    if len(item) > MAX_INFO:  # the next allocation reads every line back
        return f"{key}=... is {len(item)} characters; a timeline detail takes at most {MAX_INFO}"
    if _CONTROL.search(value):
        return (
            f"{key}=... holds a line break or another control character: a timeline detail is "
            "one line of text"
        )
    return None


def _timeline(
    args: argparse.Namespace, env: Mapping[str, str] | None, runner: Runner | None
) -> int:
    try:
        timeline = _timeline_of(args, env, runner, facts=False)
    except ValueError as e:
        print(f"slurmclock: error: {e}", file=sys.stderr)
        return 2
    if timeline.path is None:
        print("slurmclock: no timeline: not in a SLURM job; pass --job-id", file=sys.stderr)
        return 1
    events = timeline.events()
    exits = timeline.exit_samples()
    if args.json:
        print(
            json.dumps(
                {
                    "job_id": timeline.job_id,
                    "path": str(timeline.path),
                    "events": [
                        {"event": e.name, "time": e.time, "restart": e.restart, **e.info}
                        for e in events
                    ],
                    "exits": [
                        {"restart": x.restart, "seconds": x.seconds, "exit_s": x.exit_s}
                        for x in exits
                    ],
                    "unreadable_lines": timeline.unreadable,
                    "read_error": timeline.read_error,
                    "chain": follow_chain(timeline, env=env).to_json(),
                }
            )
        )
        return 0
    _print_timeline(timeline, events, exits, show_all=args.all)
    for line in _chain_lines(follow_chain(timeline, env=env)):
        print(line)
    return 0


def _chain_of(
    args: argparse.Namespace, env: Mapping[str, str] | None, runner: Runner | None
) -> Chain | None:
    """The chain the job asked about is a link of (None: no timeline to read it from)."""
    try:
        timeline = _timeline_of(args, env, runner, facts=False)
    except ValueError as e:  # several clusters' files: status still answers the rest
        logging.getLogger("slurmclock").warning("%s", e)
        return None
    if timeline.path is None:
        return None
    return follow_chain(timeline, env=env)


def _chain_status(chain: Chain | None) -> list[str]:
    """``status``'s rows about the run's chain (none for a lone allocation)."""
    if chain is None or (len(chain.links) < 2 and chain.pending is None):
        return []
    t, last = chain.totals(), chain.links[-1]
    rows = [
        ("chain", f"{chain.id or last.job}: {t['allocations']} allocations, {t['jobs']} jobs"),
        ("newest link", f"job {last.job} run {last.restart}: {last.verdict}"),
        ("waited", f"{t['wait_s']:.0f} s between allocations ({t['waits_measured']} measured)"),
        ("steps", "-" if t["steps"] is None else str(t["steps"])),
    ]
    if chain.pending is not None:
        rows.append(("next job", f"{chain.pending} (no timeline yet: waiting in the queue?)"))
    return [f"{k + ':':<14}{v}" for k, v in rows]


def _chain_lines(chain: Chain) -> Iterator[str]:
    """``timeline``'s chain section: one line per link, then the totals; nothing for a lone
    allocation."""
    if len(chain.links) < 2 and chain.pending is None:
        return
    yield f"chain {chain.id or chain.links[0].job}: the run's allocations, oldest first"
    waits: list[float | None] = [None, *chain.waits()]
    for n, (link, wait) in enumerate(zip(chain.links, waits, strict=True)):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(link.start))
        took = "" if link.end is None else f", {link.end - link.start:.0f} s"
        queued = "" if wait is None else f", {wait:.0f} s after the one before"
        steps = "" if link.steps is None else f", {link.steps} steps to {link.last_checkpoint}"
        yield (
            f"  link {n}: job {link.job} run {link.restart}  {when}{took}{queued}{steps}: "
            f"{_text(link.verdict)}"
        )
    t = chain.totals()
    steps = "no checkpoint" if t["steps"] is None else f"{t['steps']} steps"
    wall = "" if t["wall_s"] is None else f", {t['wall_s']:.0f} s wall clock"
    yield (
        f"  total: {t['allocations']} allocations in {t['jobs']} jobs, {steps}, "
        f"{t['wait_s']:.0f} s between allocations{wall}"
    )
    if chain.pending is not None:
        yield f"  next: job {chain.pending} (no timeline yet: it waits in the queue, or it is gone)"
    if chain.cut:
        yield f"  (cut at {MAX_JOBS} jobs)"


def _print_timeline(
    timeline: JobTimeline, events: list[Event], exits: list[ExitSample], *, show_all: bool
) -> None:
    print(f"timeline of job {timeline.job_id}: {timeline.path}")
    if timeline.read_error is not None:
        print(f"  (cannot read it: {timeline.read_error})")
    elif not events and not timeline.unreadable:
        print("  (no events yet)")
    for line in _event_lines(events, show_all):
        print(line)
    for x in exits:
        part = "" if x.exit_s is None else f" (exit {x.exit_s:.2f} s)"
        print(f"  run {x.restart}: {x.seconds:.2f} s from the final save to the end{part}")
    # A successor job (supervise --successor) carries the run on under its own id.
    after = [e.info["successor"] for e in events if e.name == "requeued" and "successor" in e.info]
    if after:
        nxt = _text(after[-1])
        print(f"  the run goes on in job {nxt} (its successor): slurmclock timeline {nxt}")
    if timeline.unreadable:
        n, shown = len(timeline.unreadable), ", ".join(map(str, timeline.unreadable[:10]))
        more = ", ..." if n > 10 else ""
        print(f"  ({n} unreadable line{'s' if n > 1 else ''} skipped: line {shown}{more})")


def _event_lines(events: list[Event], show_all: bool) -> Iterator[str]:
    """One line per event; a run of checkpoints (one a save, for hours) as its first and last
    and one line between that counts them."""
    i = 0
    while i < len(events):
        end = i
        while end < len(events) and _same_run_of_checkpoints(events[i], events[end]):
            end += 1
        if show_all or end - i <= CHECKPOINTS_SHOWN:
            yield _event_line(events[i])
            i += 1
            continue
        inner = events[i + 1 : end - 1]
        steps = [ev.info.get("step") for ev in inner]
        span = f", steps {_text(steps[0])} to {_text(steps[-1])}" if steps else ""
        yield _event_line(events[i])
        yield f"  {'':19}  ... {len(inner)} more checkpoints{span} (--all shows each)"
        yield _event_line(events[end - 1])
        i = end


def _same_run_of_checkpoints(first: Event, other: Event) -> bool:
    return first.name == other.name == "checkpoint" and first.restart == other.restart


def _event_line(e: Event) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time))
    extra = " ".join(
        f"{_text(k)}={_text(v)}" for k, v in e.info.items() if k not in ("host", "pid")
    )
    return f"  {when}  run {e.restart}  {_text(e.name):<9} {extra}".rstrip()


def _text(value: object) -> str:
    """``value`` for a line of the listing: text with a line break or a control character (a
    timeline written by hand, or by a program) quoted and escaped, so it cannot fake a line."""
    text = str(value)
    return json.dumps(text) if _CONTROL.search(text) else text


def _stop(args: argparse.Namespace, env: Mapping[str, str] | None, runner: Runner | None) -> int:
    try:
        job = check_job_id(args.stop_job, "JOBID")
    except ValueError as e:
        print(f"slurmclock: error: {e}", file=sys.stderr)
        return 2
    try:
        default_scheduler(runner, env=env).signal(job, "TERM", batch=True, timeout=args.timeout)
    except CommandError as e:
        print(f"slurmclock: not stopped: {e}", file=sys.stderr)
        return 1
    print(
        f"asked job {job} to save and stop: SIGTERM sent to its batch shell, which forwards it "
        "to the training step (the trainer saves, exits, and the job is not requeued)"
    )
    print(f"if job {job} is one of a chain (submit-chain.sh, --dependency) or an array: {_REST}")
    return 0


_REST = (
    "the jobs after it still start and resume from its checkpoint; to stop them too, scancel "
    "them (squeue --me -o '%i %E' lists the jobs that wait on it; scancel ARRAY_ID ends an array)"
)

_COMMANDS = {
    "requeue": _requeue,
    "mark": _mark,
    "timeline": _timeline,
    "stop": _stop,
    "supervise": _supervise,
}
MAX_TIMEOUT = 3600.0  # seconds to wait for squeue/scontrol: beyond it, nobody is waiting
MAX_INFO = 1000  # characters of one KEY=VALUE of `slurmclock mark`
CHECKPOINTS_SHOWN = 3  # a longer run of checkpoint lines shows its first and last
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: what breaks a line or
# drives a terminal.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _warn_if_past(info: Mapping[str, Any]) -> None:
    left = info["seconds_left"]
    if left is not None and left < 0:
        print(
            f"slurmclock: warning: the deadline {info['deadline']} (from {info['source']}) "
            f"passed {-left:.0f} s ago",
            file=sys.stderr,
        )


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


def _restarts(count: int | None) -> str:
    return "unknown (SLURM does not say)" if count is None else str(count)


def _human(info: Mapping[str, Any]) -> str:
    job = info["job_id"] or "none (not in a SLURM job)"
    if info["array_task"]:
        job += f" (array task {info['array_task']})"
    left = info["seconds_left"]
    rows = [
        ("job", job),
        ("restarts", _restarts(info["restart_count"])),
        ("deadline", info["deadline"] or "none"),
        ("seconds left", "-" if left is None else str(math.floor(left))),
        ("source", info["source"]),
    ]
    return "\n".join(f"{k + ':':<14}{v}" for k, v in rows)


if __name__ == "__main__":
    sys.exit(main())
