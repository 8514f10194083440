"""One run over many allocations: the links of a chain, read from the job timelines.

A run that outlives one allocation goes on in the next: the same job requeued (``scontrol
requeue``: the same job id, ``SLURM_RESTART_COUNT`` one higher, the same timeline file) or a
successor job (``slurmclock supervise --successor``: a new job id, a new timeline file). Either
way each allocation is one *link* of the run's chain, and ``slurmclock status`` and ``slurmclock
timeline`` show the chain, not the one job asked about.

How a link finds the others (nothing but the timelines, which every link already writes):

- the chain's id is its first job's id; ``slurmclock supervise`` exports it to the step and to the
  successor as ``SLURMCLOCK_CHAIN_ID`` (:data:`CHAIN_ID`), the link's place as
  ``SLURMCLOCK_CHAIN_INDEX`` (:data:`CHAIN_INDEX`), and writes both into the ``start`` event of
  each run (``chain``, ``link``);
- a link that handed over to a successor says so in its ``requeued`` event (``successor``).

So from any job of the chain: its ``start`` names the chain, the chain's first job's timeline is
read, and the ``successor`` pointers lead from job to job (at most :data:`MAX_JOBS` files; a
pointer that is not a job id, or one already seen, ends the walk). Every file is untrusted input:
what cannot be read is skipped, never a reason to fail.

The supervisor of a successor job reads the links before it with :func:`earlier` (walked back
from the newest, at most :data:`EARLIER_LINKS` files or :data:`EARLIER_EVENTS` events): the
failures in a row that stop a crash loop, the newest checkpoint and the measured start-up belong
to the run, not to one job id.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmclock.commands import CommandError
from slurmclock.job import JobFacts, JobState, Scheduler, check_job_id
from slurmclock.timeline import Event, JobTimeline, find_timeline
from slurmclock.untrusted import quote, read_records

__all__ = [
    "CHAIN_ID",
    "CHAIN_INDEX",
    "EARLIER_EVENTS",
    "EARLIER_LINKS",
    "MAX_JOBS",
    "Chain",
    "Earlier",
    "Link",
    "RunRecord",
    "chain_id",
    "chain_index",
    "chain_jobs",
    "earlier",
    "follow",
    "join",
    "links_of",
    "read_run",
]

log = logging.getLogger("slurmclock")
CHAIN_ID = "SLURMCLOCK_CHAIN_ID"
CHAIN_INDEX = "SLURMCLOCK_CHAIN_INDEX"
MAX_JOBS = 1000  # timeline files one walk reads at most: a chain longer than this is cut
EARLIER_LINKS = 16  # earlier jobs' timelines :func:`earlier` reads at most
# ... and no more once it holds this many events (an allocation writes tens; a full 8 MiB
# timeline ~80,000 take a second to read): the walk ends within seconds even at SLURM's SIGTERM
EARLIER_EVENTS = 20_000


def chain_id(env: Mapping[str, str]) -> str | None:
    """The chain this job belongs to (its first job's id), as exported; None when unset or not
    a job id (a variable set by hand is not trusted further than that)."""
    raw = env.get(CHAIN_ID, "").strip()
    try:
        return check_job_id(raw, CHAIN_ID) if raw else None
    except ValueError:
        return None


def chain_index(env: Mapping[str, str]) -> int:
    """This job's place in its chain of successors (0: the first job, or not a chain)."""
    raw = env.get(CHAIN_INDEX, "").strip()
    return int(raw) if raw.isdigit() and len(raw) < 10 else 0


@dataclass(frozen=True, slots=True)
class Link:
    """One allocation of the run: ``job``'s run ``restart``; ``start``/``end`` epoch seconds
    (``end`` None: no end recorded yet -- running, or its node went away); ``verdict``: how it
    ended (``done``, ``requeued``, ``successor JOB``, ``gave up``, ``exited RC``, ``stopped by
    SLURM (KIND)``, ``running``); ``steps``: steps made durable in it (None: no checkpoint)."""

    job: str
    restart: int
    start: float
    end: float | None
    verdict: str
    first_checkpoint: int | None = None
    last_checkpoint: int | None = None
    steps: int | None = None


@dataclass(frozen=True, slots=True)
class Chain:
    """The links of one run, in order; ``id`` the chain's first job (None: a lone job)."""

    id: str | None
    links: list[Link] = field(default_factory=list)
    cut: bool = False  # the walk stopped at MAX_JOBS
    pending: str | None = None  # the job named next that has no timeline (yet): it waits

    @property
    def jobs(self) -> list[str]:
        return list(dict.fromkeys(link.job for link in self.links))

    def waits(self) -> list[float | None]:
        """Seconds from each link's end to the next one's start (None: an end not recorded)."""
        pairs = zip(self.links, self.links[1:], strict=False)
        return [None if a.end is None else max(0.0, b.start - a.end) for a, b in pairs]

    def totals(self) -> dict[str, object]:
        waits = [w for w in self.waits() if w is not None]
        done = [link.steps for link in self.links if link.steps is not None]
        ends = [link.end for link in self.links if link.end is not None]
        last = self.links[-1] if self.links else None
        return {
            "allocations": len(self.links),
            "jobs": len(self.jobs),
            "wait_s": round(sum(waits), 3),
            "waits_measured": len(waits),
            "steps": sum(done) if done else None,
            "last_checkpoint": last.last_checkpoint if last else None,
            "wall_s": round(max(ends) - self.links[0].start, 3) if ends else None,
            "cut": self.cut,
        }

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "links": [
                {
                    "job": k.job,
                    "restart": k.restart,
                    "start": k.start,
                    "end": k.end,
                    "verdict": k.verdict,
                    "first_checkpoint": k.first_checkpoint,
                    "last_checkpoint": k.last_checkpoint,
                    "steps": k.steps,
                }
                for k in self.links
            ],
            "waits_s": [None if w is None else round(w, 3) for w in self.waits()],
            "pending": self.pending,
            "totals": self.totals(),
        }


def links_of(job: str, events: Sequence[Event], before: int | None = None) -> list[Link]:
    """The links (runs) in one job's timeline, in order. ``before``: the newest checkpoint step
    before the first of them (the previous job's), to count the steps of the first."""
    runs: dict[int, list[Event]] = {}
    for ev in events:
        runs.setdefault(ev.restart, []).append(ev)
    links = []
    for restart in sorted(runs):
        link = _link(job, restart, runs[restart], before)
        links.append(link)
        if link.last_checkpoint is not None:
            before = link.last_checkpoint
    return links


def _link(job: str, restart: int, events: list[Event], before: int | None) -> Link:
    start = next((ev.time for ev in events if ev.name == "start"), events[0].time)
    marks = [ev.info.get("step") for ev in events if ev.name == "checkpoint"]
    steps_seen = [s for s in marks if isinstance(s, int) and not isinstance(s, bool)]
    first, last = (steps_seen[0], steps_seen[-1]) if steps_seen else (None, None)
    if last is None:
        done = None
    elif before is not None:
        done = max(0, last - before)
    else:  # the chain's first checkpoint: counted from the step the run resumed at
        begun = next((ev.info.get("step") for ev in events if ev.name == "first_step"), None)
        done = max(0, last - begun + 1) if isinstance(begun, int) and begun <= last else last
    verdict, end = _verdict(events)
    return Link(job, restart, start, end, verdict, first, last, done)


def _verdict(events: list[Event]) -> tuple[str, float | None]:
    """How a run ended and when: the last hand-over or give-up, else its exit (SLURM's stop
    named when SIGTERM said so), else ``running``."""
    verdict, end, stopped = "running", None, ""
    for ev in events:
        if ev.name == "gave_up":
            verdict, end = "gave up", ev.time
        elif ev.name == "requeued":
            nxt = ev.info.get("successor")
            verdict = f"successor {nxt}" if isinstance(nxt, str) and nxt else "requeued"
            end = ev.time
        elif ev.name == "exited" and not verdict.startswith(("successor", "requeued", "gave")):
            rc = ev.info.get("rc")
            verdict, end = ("done" if rc == 0 else f"exited {rc}{stopped}"), ev.time
        elif ev.name == "signal" and ev.info.get("kind") in _SLURM_STOPS:
            stopped = f" (stopped by SLURM: {ev.info['kind']})"
    if verdict == "running" and stopped:
        verdict = f"no end recorded{stopped}"
    return verdict, end


_SLURM_STOPS = ("limit", "preempted", "cancelled")


def _newest_job(events: Sequence[Event], event: str, key: str) -> str | None:
    """The job id the newest ``event`` that names one gives as ``key`` (untrusted: checked to
    be a job id, else None)."""
    for ev in reversed(events):
        named = ev.info.get(key) if ev.name == event else None
        if isinstance(named, str):
            try:
                return check_job_id(named, key)
            except ValueError:
                return None
    return None


def _successor(events: Sequence[Event]) -> str | None:
    """The job the last hand-over named."""
    return _newest_job(events, "requeued", "successor")


def _named_chain(events: Sequence[Event]) -> str | None:
    """The chain a job's runs say they belong to (the newest ``start`` that names one)."""
    return _newest_job(events, "start", "chain")


def _own_link(events: Sequence[Event], index: int) -> tuple[str | None, int]:
    """The chain and link an earlier run of this job joined (its newest ``start``)."""
    head = _named_chain(events)
    starts = [ev for ev in events if ev.name == "start" and ev.info.get("chain") == head]
    link = starts[-1].info.get("link") if starts and head is not None else None
    if isinstance(link, int) and not isinstance(link, bool) and 0 <= link < 10**9:
        return head, link
    return None, index


Opener = Callable[[str], JobTimeline]


def follow(
    timeline: JobTimeline,
    *,
    env: Mapping[str, str] | None = None,
    opener: Opener | None = None,
    max_jobs: int = MAX_JOBS,
) -> Chain:
    """The chain ``timeline``'s job belongs to, from its first job to its newest link.
    ``opener``: a job id -> its timeline (default: :func:`find_timeline` in ``timeline``'s folder,
    ``timeline``'s cluster)."""
    e = os.environ if env is None else env
    job = str(timeline.job_id) if timeline.job_id is not None else None
    if job is None:
        return Chain(None)
    events = timeline.events()
    head = _named_chain(events)
    open_ = opener or _opener(timeline, e)
    order = chain_jobs(timeline, head) if head is not None else []
    first = timeline if head is None or head == job else _open(open_, head)
    for older in order[: order.index(job) if job in order else 0]:
        if first is not None:
            break
        first = _open(open_, older)  # the first job's timeline is gone: the oldest one left
    chain = _walk(first or timeline, head, open_, max_jobs, {job: events}, order)
    if job in chain.jobs:
        return chain
    # Not reached from the first job (its list damaged, a pointer lost): from this job on.
    return _walk(timeline, head, open_, max_jobs, {job: events}, order)


def _walk(
    first: JobTimeline,
    head: str | None,
    open_: Opener,
    max_jobs: int,
    known: dict[str, list[Event]],
    order: list[str],
) -> Chain:
    """From ``first``, job to job: the successor a job named, else the next in the chain's list
    (``order``: a job resubmitted to go on names no successor of the one before it)."""
    links: list[Link] = []
    seen: set[str] = set()
    current: JobTimeline | None = first
    cut, pending = False, None
    while current is not None and current.job_id is not None:
        job = str(current.job_id)
        if job in seen or len(seen) >= max_jobs:
            cut = len(seen) >= max_jobs
            break
        seen.add(job)
        events = known[job] if job in known else current.events()
        before = links[-1].last_checkpoint if links else None
        links.extend(links_of(job, events, before))
        nxt = _successor(events) or _after(order, job)
        current = None if nxt is None else _open(open_, nxt)
        pending = nxt if current is None else None
    named = head if head is not None or len(links) > 1 else None
    return Chain(named, links, cut, pending)


def _after(order: list[str], job: str) -> str | None:
    at = order.index(job) + 1 if job in order else len(order)
    return order[at] if at < len(order) else None


def _opener(timeline: JobTimeline, env: Mapping[str, str]) -> Opener:
    cluster = timeline.cluster

    def open_(job: str) -> JobTimeline:
        facts = JobFacts(job_id=job, restart=None, cluster=cluster, source="none")
        return find_timeline(facts, directory=timeline.directory, env=env)

    return open_


def _open(open_: Opener, job: str) -> JobTimeline | None:
    """``job``'s timeline when it has one (a missing file: None; a walk does not fail)."""
    try:
        found = open_(job)
    except (ValueError, OSError) as e:
        log.debug("chain: no timeline of job %s: %s", job, e)
        return None
    path = found.path
    return found if path is not None and path.is_file() else None


@dataclass(frozen=True, slots=True)
class Earlier:
    """What the chain's jobs before this one left: their ``events`` (oldest job first, each
    job's in file order), the ``jobs`` read, and those named before this one whose timeline
    could not be read (``unread``: missing, not a file, nothing readable in it) -- skipped."""

    events: list[Event] = field(default_factory=list)
    jobs: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)


def earlier(
    timeline: JobTimeline,
    *,
    env: Mapping[str, str] | None = None,
    opener: Opener | None = None,
    links: int = EARLIER_LINKS,
    enough: Callable[[Sequence[Event]], bool] | None = None,
) -> Earlier:
    """The events of the jobs before ``timeline``'s in its chain (``env``'s
    :data:`CHAIN_ID`, as :func:`join` exported it): a successor job's timeline starts empty, and
    what the supervisor derives from the run's past (failures in a row, the newest checkpoint,
    the start-up) must see the links before it. Walked back from the newest, at most ``links``
    timelines or :data:`EARLIER_EVENTS` events, and no further once ``enough(events so far)``
    says nothing older can count. A job that is its chain's first (a lone job, or a requeued
    one: its own timeline holds every run) reads nothing."""
    job = str(timeline.job_id) if timeline.job_id is not None else None
    head = chain_id(os.environ if env is None else env)
    if job is None or head is None or head == job:
        return Earlier()
    open_ = opener or _opener(timeline, os.environ if env is None else env)
    found = Earlier()
    jobs = _before(timeline, head, job, open_)
    for older in reversed(jobs[max(0, len(jobs) - links) :]):
        events = _readable(open_, older)
        if events is None:
            found.unread.insert(0, older)
            continue
        found.jobs.insert(0, older)
        found.events[:0] = events
        if len(found.events) >= EARLIER_EVENTS or (enough is not None and enough(found.events)):
            break
    return found


def _before(timeline: JobTimeline, head: str, job: str, open_: Opener) -> list[str]:
    """The jobs of chain ``head`` before ``job``, in order: from the chain's list (one file);
    when that does not start with the chain's first job or lacks ``job`` (lost, damaged), from
    the successor pointers (:func:`follow`, at most :data:`MAX_JOBS` files)."""
    order = chain_jobs(timeline, head)
    if not order or order[0] != head or job not in order:
        order = follow(timeline, opener=open_).jobs
    return order[: order.index(job)] if job in order else []


def _readable(open_: Opener, job: str) -> list[Event] | None:
    """``job``'s events; None when its timeline is missing or holds none that read."""
    found = _open(open_, job)
    if found is None:
        return None
    events = found.events()
    return events if events else None


def join(
    env: dict[str, str],
    job: str | None,
    timeline: JobTimeline | None = None,
    *,
    run: str = "",
    resume: bool = False,
    scheduler: Scheduler | None = None,
    timeout: float = 10.0,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Make this job a link of its chain: ``env`` (the step's and the successor's) gets the
    chain's id and the link's index; returns the details of the run's ``start`` event (``chain``,
    ``link``, ``previous``) that lead the next reader to the chain.

    The chain is the one exported to this job (a successor), else -- ``resume`` (the job was
    submitted to go on: ``--continue``) and the run ``run`` has a recorded chain whose newest job
    has ended -- that chain, as its next link; else a new one, this job its first. With a
    ``timeline`` the link is recorded beside it: in the chain's list of jobs and as the run's
    newest link."""
    if job is None:
        return {}
    head, index, previous = chain_id(env), chain_index(env), None
    if head is None and timeline is not None:  # requeued: SLURM's copy of the job lacks them
        head, index = _own_link(timeline.events(), index)
    if head is None and resume and run and timeline is not None:
        found = _resumed(timeline, run, job, scheduler, timeout, log or _log)
        if found is not None:
            head, index, previous = found.chain, found.link + 1, found.job
    head = head or job
    env[CHAIN_ID], env[CHAIN_INDEX] = head, str(index)
    if timeline is not None:
        _record(timeline, head, index, job, run)
    return {"chain": head, "link": index, **({"previous": previous} if previous else {})}


@dataclass(frozen=True, slots=True)
class RunRecord:
    """The newest link of a named run: its chain, its index, its job."""

    chain: str
    link: int
    job: str


def run_path(timeline: JobTimeline, run: str) -> Path:
    """Where the run ``run``'s newest link is recorded: beside the timelines, one file per run
    name (a name with other characters than letters, digits, ``._-`` gets a hash of it)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run)[:80]
    if safe != run:
        safe += "-" + hashlib.sha256(run.encode()).hexdigest()[:10]
    return timeline.directory / f"{timeline.cluster or 'job'}.run-{safe}.json"


def chain_path(timeline: JobTimeline, head: str) -> Path:
    """The chain's list of jobs (one line per link as it starts)."""
    return timeline.directory / f"{timeline.cluster or 'job'}-{head}.chain.jsonl"


def read_run(timeline: JobTimeline, run: str) -> RunRecord | None:
    """The run's newest link as recorded (untrusted: None when it does not read as one)."""
    found = read_records(run_path(timeline, run))
    for record in reversed(found.records):
        try:
            chain, job = check_job_id(record["chain"]), check_job_id(record["job"])
            link = record["link"]
        except (KeyError, ValueError):
            continue
        if isinstance(link, int) and not isinstance(link, bool) and 0 <= link < 10**9:
            return RunRecord(chain, link, job)
    return None


def _resumed(
    timeline: JobTimeline,
    run: str,
    job: str,
    scheduler: Scheduler | None,
    timeout: float,
    say: Callable[[str], None],
) -> RunRecord | None:
    """The run's recorded chain when this job may go on as its next link: its newest job has
    ended (a job that still runs or waits keeps its chain; this one starts its own)."""
    found = read_run(timeline, run)
    if found is None or found.job == job:
        return None
    why = None if scheduler is None else _still_there(scheduler, found.job, timeout)
    if why is not None:
        say(f"not joining run {quote(run)}'s chain {found.chain}: {why}; a chain of its own")
        return None
    say(f"run {quote(run)} goes on: link {found.link + 1} of chain {found.chain}")
    return found


def _still_there(scheduler: Scheduler, job: str, timeout: float) -> str | None:
    """Why ``job`` may still write (it runs, waits or ends), or None when it has ended."""
    try:
        state = scheduler.show_job(job, timeout=timeout).state
    except CommandError as e:
        said = f"{e.stderr} {e}"
        if "Invalid job id" in said:  # SLURM forgot it: it ended MinJobAge ago
            return None
        return f"cannot tell whether job {job} ended ({e})"
    if state in (JobState.ACTIVE, JobState.QUEUED, JobState.ENDING):
        return f"its job {job} is still {state.value}"
    return None


def _record(timeline: JobTimeline, head: str, index: int, job: str, run: str) -> None:
    """The link in the chain's list, and as the run's newest (atomic); never raises, never
    blocks (a FIFO or a device at either path is not written): a record is a measurement, as
    the timeline is."""
    line = {"job": job, "link": index, "time": round(time.time(), 3)}
    try:
        timeline.directory.mkdir(parents=True, exist_ok=True)
        _write(chain_path(timeline, head), json.dumps(line), os.O_APPEND)
        if run:
            path = run_path(timeline, run)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            _write(tmp, json.dumps({"chain": head, "link": index, "job": job}), os.O_TRUNC)
            os.replace(tmp, path)
    except OSError as e:
        log.warning(
            "cannot record link %d of chain %s in %s: %s; going on without it",
            index,
            head,
            timeline.directory,
            e.strerror or e,
        )


def _write(path: Path, text: str, mode: int) -> None:
    """One line into a regular file (created), in one write."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | mode
    fd = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.write(fd, (text + "\n").encode())
    finally:
        os.close(fd)


def chain_jobs(timeline: JobTimeline, head: str) -> list[str]:
    """The jobs of chain ``head`` in the order they started (its list; untrusted, bounded)."""
    found = read_records(chain_path(timeline, head))
    jobs: list[str] = []
    for record in found.records:
        try:
            job = check_job_id(record.get("job"))
        except ValueError:
            continue
        if job not in jobs:
            jobs.append(job)
    return jobs


def _log(message: str) -> None:
    log.warning("%s", message)
