"""The job's nodes as SLURM shows them now: what an administrator or SLURM changed mid-run.

A node set DOWN (``scontrol update nodename=X state=down``) is taken out of a ``--no-kill``
job by SLURM, and the step that ran on it is killed whole (srun: "Node failure on X", exit
137), before any rank can report it; a relaunch on the allocation's first node list is refused
by srun at once ("Requested node configuration is not available"). So before every relaunch,
and every :data:`LOOK_S` while the step runs, the supervisor reads the job's node list and the
states of its nodes from SLURM (never a list it kept) and sorts each node that changed:

- **gone**: SLURM took it out of the job (DOWN, a reboot, ...), or it is FAIL/FAILING, in
  maintenance, powering down or rebooting: the next launch leaves it out (a hot spare, if one
  is left, takes its place; else the step goes on with the nodes left down to ``min_nodes``);
- **drained** (DRAIN, DRAINING): it finishes this allocation -- the running step goes on, a
  relaunch may use it -- and SLURM gives it to no new allocation, so a requeue does not count
  it among the partition's usable nodes;
- **restarted**: in service, but its daemon started again since it was first read (a reboot
  shorter than ``SlurmdTimeout``, a crashed slurmd): the step's tasks there are gone while
  SLURM still counts the step as running, and srun would wait for them until the time limit.
  The supervisor ends the step and launches it again, the node included.

Each change is one line in the job log (state and reason quoted) and a ``node`` event in the
job's timeline; a hot spare that changed is named as one and no longer counted as a spare.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from slurmclock.commands import CommandError, Runner, SubprocessRunner
from slurmclock.job import Node, Scheduler
from slurmclock.untrusted import quote

__all__ = ["LOOK_S", "NodeChange", "NodeStates", "changes", "no_resize_scripts"]

LOOK_S = 10.0  # how often the job's nodes are read from SLURM while the step runs
_MAX_QUOTED = 120  # characters of a value SLURM prints, in a log line


@dataclass(frozen=True, slots=True)
class NodeChange:
    """One node of the job in a new state: ``kind`` gone or drained; ``state`` and ``reason``
    as SLURM prints them; ``in_job``: still in the job's node list; ``spare``: a hot spare."""

    node: str
    kind: str
    state: str
    reason: str = ""
    in_job: bool = True
    spare: bool = False
    in_service: bool = False  # its state is in service (resumed since it left the job)
    since: str = ""  # restarted: when its daemon started again, as the scheduler says

    def line(self) -> str:
        what = "hot spare" if self.spare else "node"
        if self.kind == "restarted":
            return (
                f"{what} {self.node} restarted (its daemon started {quote(self.since, _MAX_QUOTED)}"
                "): what ran there is gone; the step is ended and launched again"
            )
        why = f", reason {quote(self.reason, _MAX_QUOTED)}" if self.reason else ""
        where = "" if self.in_job else "; SLURM took it out of the job"
        if not self.in_job and self.in_service:  # back in service since (resumed)
            where = "; SLURM took it out of the job (it may since have been resumed)"
        if self.kind == "drained":
            then = "it finishes this allocation; no later allocation is given it"
        elif self.spare:
            then = "no longer counted as a spare"
        else:
            then = "the next launch leaves it out"
        state = quote(self.state, _MAX_QUOTED)
        return f"{what} {self.node} is {state} in SLURM{why}{where}: {then}"


def changes(
    hosts: Sequence[str],
    in_job: Sequence[str],
    states: Mapping[str, Node],
    *,
    spares: Sequence[str] = (),
) -> list[NodeChange]:
    """The nodes of ``hosts`` (the allocation's, as it started) that left the job's node list
    ``in_job`` or whose state in ``states`` (short name -> Node) is gone or drained."""
    now = {_short(h) for h in in_job}
    spare = {_short(h) for h in spares}
    found = []
    for host in hosts:
        name = _short(host)
        node = states.get(name)
        state, reason = (node.state, node.reason) if node is not None else ("", "")
        condition = node.condition if node is not None else ""
        kind = condition
        if name not in now:
            kind = "gone"
            state = state or "not in the job"
        if kind:
            in_service = not condition
            change = NodeChange(name, kind, state, reason, name in now, name in spare, in_service)
            found.append(change)
    return found


class NodeStates:
    """The job's nodes read from ``scheduler``: :meth:`look` names each change once through
    ``log`` and ``mark`` (the timeline's ``node`` event) and keeps :attr:`gone` and
    :attr:`drained` (short names). ``timeout``: seconds each SLURM command may take, or a
    callable asked at each look (the supervisor's bound, derived from the time left)."""

    def __init__(
        self,
        scheduler: Scheduler,
        job: str,
        timeout: float | Callable[[], float],
        log: Callable[[str], None],
        mark: Callable[..., object],
    ) -> None:
        self.scheduler, self.job, self.timeout = scheduler, job, timeout
        self.log, self.mark = log, mark
        self.gone: set[str] = set()
        self.drained: set[str] = set()
        self.said: dict[str, str] = {}  # node -> the state last named
        self.booted: dict[str, str] = {}  # node -> its daemon's start as first read
        self._thread: threading.Thread | None = None
        self._found: list[NodeChange] = []
        self._looked = 0.0
        self._lock = threading.Lock()

    def read(self, hosts: Sequence[str], spares: Sequence[str] = ()) -> list[NodeChange]:
        """The changes SLURM shows now (CommandError when it cannot say)."""
        bound = self.timeout() if callable(self.timeout) else self.timeout
        view = self.scheduler.show_job(self.job, timeout=bound)
        in_job = self.scheduler.hostnames(view.nodes, timeout=bound) if view.nodes else []
        listed = self.scheduler.nodes(view.partition, timeout=bound) if view.partition else []
        states = {_short(n.name): n for n in listed}
        found = changes(hosts, in_job or hosts, states, spares=spares)
        changed = {c.node for c in found}
        return found + self._restarted(in_job or hosts, states, spares, changed, bound)

    def _restarted(
        self,
        hosts: Sequence[str],
        states: Mapping[str, Node],
        spares: Sequence[str],
        changed: set[str],
        bound: float,
    ) -> list[NodeChange]:
        """The nodes in service whose daemon started again since first read. Unknown when
        the scheduler cannot say (no line: the states above are what matters then)."""
        try:
            starts = self.scheduler.node_starts(list(hosts), timeout=bound)
        except CommandError:
            return []
        spare = {_short(h) for h in spares}
        found = []
        for host, stamp in starts.items():
            name = _short(host)
            first = self.booted.setdefault(name, stamp)
            if stamp != first and name not in changed:
                node = states.get(name)
                state, reason = (node.state, node.reason) if node is not None else ("", "")
                found.append(
                    NodeChange(name, "restarted", state, reason, spare=name in spare, since=stamp)
                )
            self.booted[name] = stamp
        return found

    def look(self, hosts: Sequence[str], spares: Sequence[str] = ()) -> list[NodeChange]:
        """Read SLURM now and name what is new; the new changes (none when SLURM did not
        answer: said in one line)."""
        try:
            found = self.read(hosts, spares)
        except CommandError as e:
            self.log(f"could not read the job's nodes from SLURM ({e}): the nodes known stand")
            return []
        return self.name(found)

    def look_soon(self, hosts: Sequence[str], spares: Sequence[str] = ()) -> None:
        """While the step runs: read SLURM in a thread, at most every :data:`LOOK_S`; what it
        found is named by the next :meth:`collect`."""
        now = time.monotonic()
        if now - self._looked < LOOK_S or (self._thread and self._thread.is_alive()):
            return
        self._looked = now

        def read() -> None:
            try:
                found = self.read(hosts, spares)
            except CommandError:
                return  # said at the next relaunch, when it matters
            with self._lock:
                self._found.extend(found)

        self._thread = threading.Thread(target=read, daemon=True)
        self._thread.start()

    def collect(self) -> list[NodeChange]:
        """Name what the last :meth:`look_soon` found."""
        with self._lock:
            found, self._found = self._found, []
        return self.name(found)

    def name(self, found: Sequence[NodeChange]) -> list[NodeChange]:
        new = [c for c in found if self.said.get(c.node) != f"{c.state} {c.since}"]
        for change in new:
            self.said[change.node] = f"{change.state} {change.since}"
            if change.kind != "restarted":  # back in service: the next launch may use it
                (self.gone if change.kind == "gone" else self.drained).add(change.node)
            self.log(change.line())
            self.mark(
                "node",
                node=change.node,
                state=change.state,
                reason=change.reason,
                kind=change.kind,
                in_job=int(change.in_job),
                spare=int(change.spare),
            )
        return new


def no_resize_scripts(env: Mapping[str, str] | None = None) -> Runner:
    """The runner of the supervisor's SLURM commands: ``env`` (default this process's) without
    ``SLURM_JOBID``. After an update of a job's size (``NodeList=``, ``NumNodes=``) scontrol
    writes ``slurm_job_N_resize.sh`` and ``.csh`` into its working directory -- the job's submit
    directory, the user's repository -- whenever it finds ``SLURM_JOBID`` (SLURM 22.05,
    ``scontrol/update_job.c``: ``_update_job_size``). The commands name the job themselves."""
    base = os.environ if env is None else env
    return SubprocessRunner({k: v for k, v in base.items() if k != "SLURM_JOBID"})


def _short(host: str) -> str:
    return host.split(".")[0]
