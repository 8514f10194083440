"""Nodes the job lost: which of the nodes a rank reported are gone, and what the next
allocation may ask for.

A fault record names the node of the rank that died or froze, not whether the node itself is
gone: a rank killed by the out-of-memory killer leaves a healthy node. :meth:`NodeKeeper.lost`
runs a no-op step on each reported node (``Scheduler.probe_node``, all at once): a node that
answers stays, one that does not is lost -- without waiting for SLURM to mark it DOWN. The node
this supervisor runs on answers by being here.

For the next allocation (:meth:`NodeKeeper.before_requeue`): lost nodes are kept out of the
job's allocations (SLURM's ``ExcNodeList``) while the partition keeps ``min_nodes`` usable ones
without them, and a job that asks for more nodes than the partition can give asks for fewer,
down to ``min_nodes``: a job pending on nodes that are DOWN waits for ever ("Nodes required
for job are DOWN").
:meth:`NodeKeeper.apply` asks the scheduler for that (``Scheduler.resize``); how the scheduler
is told -- SLURM's fields, slurmctld 22.05 holding the updates of a resized job -- is
``slurmclock.slurm``'s.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from slurmclock.commands import CommandError
from slurmclock.job import JobView, Scheduler
from slurmclock.supervisor.placement import requeue_size

__all__ = ["NodeKeeper", "RequeuePlan"]


@dataclass(frozen=True, slots=True)
class RequeuePlan:
    """What the requeued job asks for: ``exclude`` (every node kept out of its allocations,
    sorted; None: unchanged), ``nodes`` (its node count; None: unchanged), ``give_up`` (why it
    must not be requeued at all); ``said``: the lines that tell it."""

    exclude: tuple[str, ...] | None = None
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
        self._last_round: Callable[[], None] = lambda: None  # what the scheduler still holds

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
        exclude: tuple[str, ...] | None = None
        if keep_out and bad and len(usable - bad - excluded) >= min_nodes:
            excluded |= {_short(n) for n in bad}
            exclude = tuple(sorted(excluded))
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
        """After the requeue: the plan's lines, then its size and excluded nodes through
        ``Scheduler.resize`` (how they reach the scheduler, and any holding back of the
        updates of a resized job, is the scheduler's: ``Slurm.resize``)."""
        for line in plan.said:
            self.log(line)
        if plan.nodes is None and plan.exclude is None:
            return
        self._last_round = self.scheduler.resize(
            self.job,
            plan.nodes,
            tasks_per_node=tasks_per_node,
            exclude=plan.exclude,
            log=self.log,
            timeout=self.timeout,
        )

    def last_round(self) -> None:
        """As this process ends: one more try of the updates the scheduler still holds."""
        self._last_round()


def _short(host: str) -> str:
    return host.split(".")[0]
