"""Nodes the job lost: which of the nodes a rank reported are gone, and what the next
allocation may ask for.

A fault record names the node of the rank that died or froze, not whether the node itself is
gone: a rank killed by the out-of-memory killer leaves a healthy node. :meth:`NodeKeeper.lost`
runs a no-op step on each reported node (``Scheduler.probe_node``, all at once): a node that
answers stays, one that does not is lost -- without waiting for SLURM to mark it DOWN. The node
this supervisor runs on answers by being here.

For the next allocation (:meth:`NodeKeeper.before_requeue`): lost nodes go to the job's
``ExcNodeList`` while the partition keeps ``min_nodes`` usable ones without them, and a job
that asks for more nodes than the partition can give asks for fewer, down to ``min_nodes``: a
job pending on nodes that are DOWN waits for ever ("Nodes required for job are DOWN").
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from slurmclock.commands import CommandError
from slurmclock.job import JobView, Scheduler
from slurmclock.supervisor.placement import requeue_size

__all__ = ["FIRST_WAIT_S", "RESEND_S", "STAGGER_S", "NodeKeeper", "RequeuePlan", "requeue_updates"]

STAGGER_S = 0.1  # between the updates of a requeued job, sent at once
FIRST_WAIT_S = 1.5  # for slurmctld's answers to the first round: more is an update it holds
# Between the starts of rounds while slurmctld holds them: a whole number of its 1 s retries,
# so that the rounds retrying there land in the order of a round when the requeue is done.
RESEND_S = 2.0


@dataclass(frozen=True, slots=True)
class RequeuePlan:
    """What the requeued job asks for: ``exclude`` (the whole ExcNodeList; None: unchanged),
    ``nodes`` (NumNodes; None: unchanged), ``give_up`` (why it must not be requeued at all)."""

    exclude: str | None = None
    nodes: int | None = None
    give_up: str | None = None
    said: tuple[str, ...] = ()


class NodeKeeper:
    """The job's lost nodes, through ``scheduler``; ``log`` gets one line per finding."""

    def __init__(
        self,
        scheduler: Scheduler,
        job: str,
        *,
        log: Callable[[str], None],
        timeout: float,
        probe_timeout: float,
        here: str | None = None,
    ) -> None:
        self.scheduler, self.job, self.log = scheduler, job, log
        self.timeout, self.probe_timeout = timeout, probe_timeout
        self.here = _short(here or socket.gethostname())
        self.gone: set[str] = set()  # short names
        self._probes: dict[str, threading.Thread] = {}
        self._answers: dict[str, str | None] = {}  # node -> None (answered) or why not
        self._held: list[dict[str, str]] = []  # requeue updates slurmctld did not take yet

    def probe_soon(self, hosts: Iterable[str]) -> None:
        """Start probing the reported ``hosts`` now (in threads), while the step still ends:
        :meth:`lost` then waits only for what is left of the probes' time."""
        for node in sorted({_short(h) for h in hosts if h} - self.gone - {self.here}):
            if node not in self._probes:
                thread = threading.Thread(target=self._probe, args=(node,), daemon=True)
                self._probes[node] = thread
                thread.start()

    def _probe(self, node: str) -> None:
        try:
            self.scheduler.probe_node(self.job, node, timeout=self.probe_timeout)
            self._answers[node] = None
        except CommandError as e:
            self._answers[node] = str(e)

    def lost(self, hosts: Iterable[str]) -> set[str]:
        """Of the reported ``hosts``, those that do not answer now (added to :attr:`gone`)."""
        suspects = sorted({_short(h) for h in hosts if h} - self.gone - {self.here})
        self.probe_soon(suspects)
        for node in suspects:
            self._probes.pop(node).join()
            answer = self._answers.pop(node, "no answer")
            if answer is None:
                self.log(f"node {node} answers: its rank failed, not the node")
            else:
                self.gone.add(node)
                self.log(f"node {node} does not answer ({answer}): left out of this job")
        return {n for n in suspects if n in self.gone}

    def before_requeue(
        self, view: JobView, min_nodes: int, *, asked: int, keep_out: bool = True
    ) -> RequeuePlan:
        """What the requeued job (``view``: its partition and ExcNodeList) may ask for, given
        the partition's nodes now: ``asked`` nodes (what SLURM gives it back on a requeue: the
        count it was submitted with, whatever it gave back since) or fewer; ``keep_out``: lost
        nodes go to its ExcNodeList (where the partition keeps enough)."""
        listed = self.scheduler.nodes(view.partition, timeout=self.timeout)
        usable = {n.name for n in listed if n.usable}
        before = self.scheduler.hostnames(view.exc_nodes, timeout=self.timeout)
        excluded = {_short(n) for n in before}
        said = []
        bad = {n for n in usable if _short(n) in self.gone}
        exclude = None
        if keep_out and bad and len(usable - bad - excluded) >= min_nodes:
            excluded |= {_short(n) for n in bad}
            exclude = ",".join(sorted(excluded))
            said.append(
                f"the next allocation avoids node(s) {', '.join(sorted(bad))} (ExcNodeList)"
            )
        free = {n for n in usable if _short(n) not in excluded and _short(n) not in self.gone}
        size = requeue_size(len(free), asked, min_nodes=min_nodes)
        if size is None:
            why = (
                f"partition {view.partition} has {len(free)} usable node(s) for this job, fewer "
                f"than its minimum of {min_nodes} (MIN_NODES): a requeued job would wait for a "
                "node that may never come back"
            )
            return RequeuePlan(give_up=why)
        if size < asked:
            said.append(
                f"partition {view.partition} has {len(free)} usable node(s) for this job: the "
                f"next allocation asks for {size} instead of {asked} (NumNodes)"
            )
        nodes = size if size < asked else None
        return RequeuePlan(exclude, nodes, None, tuple(said))

    def apply(self, plan: RequeuePlan, tasks_per_node: int | None) -> None:
        """After ``scontrol requeue``: the plan's updates, said first, sent :data:`STAGGER_S`
        apart in the order SLURM must take them -- the task count, the node count (with
        ExcNodeList), both again, the task count last: a task count that reaches slurmctld
        before the node count may be refused (seen in CI: the job pended with 1 node and the
        old 2 tasks at one per node), one after it holds.

        A job that gave a node back (``NodeList=``, or SLURM removing a DOWN node from a
        ``--no-kill`` job) was resized, and slurmctld takes no update of a resized job until
        accounting gives it a new record (SLURM 22.05 ``_update_job``: "the DB index is being
        set"; each update is retried in slurmctld for 5 s, then refused). Without slurmdbd
        (``accounting_storage/none``) that is only when the requeue is done -- after this
        process is gone. So when the first round is not taken within :data:`FIRST_WAIT_S`,
        rounds go on every :data:`RESEND_S` until one is taken or this process ends: the last
        rounds, retrying in slurmctld, land when the requeue is done, if that is within 5 s of
        the end of the batch script (an Epilog of its own may take longer: the log line says
        how to ask for the size by hand)."""
        for line in plan.said:
            self.log(line)
        updates = requeue_updates(plan, tasks_per_node)
        if not updates:
            return
        first = self._round(updates, quiet=False)
        if first.wait(FIRST_WAIT_S):
            return
        first.quiet = True  # its refusals, after slurmctld's 5 s, are what this line says
        by_hand = [next(u for u in updates if "NumTasks" not in u)]
        by_hand += [updates[-1]] if "NumTasks" in updates[-1] else []
        commands = "; ".join(
            f"scontrol update JobId={self.job} " + " ".join(f"{k}={v}" for k, v in u.items())
            for u in by_hand
        )
        self.log(
            f"slurmctld holds the updates of job {self.job} (a job that gave nodes back takes "
            f"none until its requeue is done): sent again every {RESEND_S:.0f} s until this "
            f"script ends. Should the job pend asking for its old size: {commands}"
        )
        self._held = updates
        keeper = threading.Thread(target=self._resend, args=(updates, first), daemon=True)
        keeper.start()

    def last_round(self) -> None:
        """Updates slurmctld holds: one more round as this process ends, to be retrying there
        for the longest after it (returns once they are sent)."""
        if self._held:
            self._round(self._held, quiet=True)

    def _resend(self, updates: list[dict[str, str]], first: _Round) -> None:
        rounds, k = [first], 0
        while not any(r.taken for r in rounds):
            rounds = [r for r in rounds if r.taken or not r.finished]
            k += 1  # rounds start on the first's beat: slurmctld's retries keep their order
            time.sleep(max(0.0, first.started + k * RESEND_S - time.monotonic()))
            rounds.append(self._round(updates, quiet=True))
        self._held = []

    def _round(self, updates: list[dict[str, str]], *, quiet: bool) -> _Round:
        """Send ``updates`` at once, each in a thread of its own, :data:`STAGGER_S` apart."""
        round_ = _Round(len(updates), quiet=quiet)
        for fields in updates:
            threading.Thread(target=self._update, args=(fields, round_), daemon=True).start()
            time.sleep(STAGGER_S)
        return round_

    def _update(self, fields: dict[str, str], round_: _Round) -> None:
        try:
            self.scheduler.update_job(self.job, timeout=self.timeout, **fields)
            round_.done(True)
        except CommandError as e:
            round_.done(False)
            if not round_.quiet:
                self.log(f"{' '.join(e.argv)}: {e}")


def requeue_updates(plan: RequeuePlan, tasks_per_node: int | None) -> list[dict[str, str]]:
    """The ``scontrol update`` fields of a requeued job, in the order they are sent."""
    exclude = {} if plan.exclude is None else {"ExcNodeList": plan.exclude}
    if plan.nodes is None:
        return [exclude] if exclude else []
    n = plan.nodes
    counts = {"NumNodes": f"{n}-{n}"}
    tasks = [] if tasks_per_node is None else [{"NumTasks": str(n * tasks_per_node)}]
    return [*tasks, {**counts, **exclude}, *tasks, counts, *tasks]


class _Round:
    """The answers to one round of updates: ``taken`` when slurmctld took every one;
    ``quiet``: its refusals are not logged."""

    def __init__(self, size: int, *, quiet: bool) -> None:
        self.started, self.quiet = time.monotonic(), quiet
        self._left, self._ok = size, True
        self._all = threading.Event()
        self._lock = threading.Lock()

    def done(self, ok: bool) -> None:
        with self._lock:
            self._left -= 1
            self._ok = self._ok and ok
            if self._left == 0:
                self._all.set()

    @property
    def finished(self) -> bool:
        return self._all.is_set()

    @property
    def taken(self) -> bool:
        return self._all.is_set() and self._ok

    def wait(self, timeout: float) -> bool:
        """Were all answered within ``timeout`` seconds (taken or refused)?"""
        return self._all.wait(timeout)


def _short(host: str) -> str:
    return host.split(".")[0]
