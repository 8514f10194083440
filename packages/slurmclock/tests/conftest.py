"""Fakes for unit tests, and a real single-node SLURM for the integration tests.

The cluster comes from the repository's ``tools/localslurm.py``, loaded by path (it is not a
package). One cluster serves the whole session; tests submit several jobs at once.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from slurmclock import CommandError, EndTime, JobView, Node, Slurm, Step
from slurmclock.slurm import exclude_fields, node_condition, resize_fields

ROOT = Path(__file__).resolve().parents[3]
LOCALSLURM = ROOT / "tools" / "localslurm.py"
REQUIRE_SLURM = os.environ.get("PYRECOVER_REQUIRE_SLURM") == "1"


class FakeClock:
    """Epoch seconds that move only when a test says so."""

    def __init__(self, now: float = 1_900_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


Answer = str | BaseException | Callable[[Sequence[str]], str]


class FakeRunner:
    """Canned output per command name (``squeue``, ``scontrol``); records every call."""

    def __init__(self, **answers: Answer) -> None:
        self.answers = answers
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        self.calls.append(tuple(argv))
        answer = self.answers.get(argv[0])
        if answer is None:
            raise CommandError(argv, "missing", f"{argv[0]} not found on PATH")
        if isinstance(answer, BaseException):
            raise answer
        if callable(answer):
            return answer(argv)
        return answer

    def count(self, name: str) -> int:
        return sum(1 for call in self.calls if call[0] == name)


class FakeScheduler:
    """A :class:`slurmclock.Scheduler` in memory, for unit tests of the logic that asks one:
    ``jobs`` (id -> JobView), ``ends`` (id -> EndTime), ``starts`` (id -> epoch seconds),
    ``partitions`` (name -> Nodes), ``running`` (id -> its Steps), ``dead`` (nodes that do not
    answer a probe), ``cluster``. What it was asked is in ``calls``; a job it does not know is a
    CommandError, as SLURM's "Invalid job id specified". Steps are placed as :class:`Slurm`
    places them (no command runs)."""

    name = "fake"

    def __init__(self, jobs: dict[str, JobView] | None = None, *, cluster: str = "fake") -> None:
        self.cluster = cluster
        self.jobs = dict(jobs or {})
        self.ends: dict[str, EndTime] = {}
        self.starts: dict[str, float] = {}
        self.partitions: dict[str, list[Node]] = {}
        self.running: dict[str, list[Step]] = {}  # job -> its steps
        self.dead: set[str] = set()  # nodes that do not answer a probe
        self.booted: dict[str, str] = {}  # node -> when its daemon started (node_starts)
        self.calls: list[tuple[str, ...]] = []

    def _known(self, what: str, job: str) -> str:
        self.calls.append((what, job))
        if job not in self.jobs and job not in self.ends:
            message = f"{what} {job}: Invalid job id specified"
            raise CommandError([self.name, what, job], "failed", message, returncode=1)
        return job

    def end_time(self, job: str, *, thorough: bool = False, timeout: float = 10.0) -> EndTime:
        return self.ends[self._known("end_time", job)]

    def start_time(self, job: str, *, timeout: float = 10.0) -> float:
        return self.starts[self._known("start_time", job)]

    def show_job(self, job: str, *, timeout: float = 10.0) -> JobView:
        return self.jobs[self._known("show_job", job)]

    def requeue(self, job: str, *, timeout: float = 10.0) -> None:
        view = self.jobs[self._known("requeue", job)]
        self.jobs[job] = replace(view, restarts=(view.restarts or 0) + 1)

    def update_job(self, job: str, *, timeout: float = 10.0, **fields: str) -> None:
        """Not the protocol's: how the intents below are recorded (as ``Slurm.update_job``)."""
        self._known("update_job", job)
        self.calls[-1] += tuple(f"{k}={v}" for k, v in fields.items())
        if "ExcNodeList" in fields:
            self.jobs[job] = replace(self.jobs[job], exc_nodes=fields["ExcNodeList"])
        if "NodeList" in fields:  # a running job gives nodes back
            nodes = fields["NodeList"]
            self.jobs[job] = replace(self.jobs[job], nodes=nodes, num_nodes=len(nodes.split(",")))

    # The intents are recorded as the SLURM updates they are (Slurm's own translation).
    def exclude_nodes(self, job: str, nodes: Sequence[str], *, timeout: float = 10.0) -> None:
        self.update_job(job, timeout=timeout, **exclude_fields(nodes))

    def resize(
        self,
        job: str,
        nodes: int | None = None,
        *,
        tasks_per_node: int | None = None,
        exclude: Sequence[str] | None = None,
        log: Callable[[str], None] | None = None,
        timeout: float = 10.0,
    ) -> Callable[[], None]:
        excluded = None if exclude is None else ",".join(exclude)
        for fields in resize_fields(nodes, tasks_per_node, excluded):  # taken at once, in order
            self.update_job(job, timeout=timeout, **fields)
        return lambda: None

    def release_nodes(self, job: str, keep: Sequence[str], *, timeout: float = 10.0) -> None:
        self.update_job(job, timeout=timeout, NodeList=",".join(keep))

    def signal(
        self, job: str, sig: str = "TERM", *, batch: bool = False, timeout: float = 10.0
    ) -> None:
        self._known("signal", job)
        self.calls[-1] += (sig, "batch" if batch else "steps")

    def hostnames(self, nodelist: str, *, timeout: float = 10.0) -> list[str]:
        self.calls.append(("hostnames", nodelist))
        return [name for name in nodelist.split(",") if name]

    def nodes(self, partition: str, *, timeout: float = 10.0) -> list[Node]:
        """The partition's nodes, each state sorted as SLURM's (``Node.condition``)."""
        self.calls.append(("nodes", partition))
        return [with_condition(n) for n in self.partitions.get(partition, [])]

    def node_starts(self, nodes: Sequence[str], *, timeout: float = 10.0) -> dict[str, str]:
        """The stamps in :attr:`booted` (a test restarts a node by changing its stamp)."""
        self.calls.append(("node_starts", *nodes))
        return {n: self.booted[n] for n in nodes if n in self.booted}

    def cluster_name(self, *, timeout: float = 10.0) -> str:
        self.calls.append(("cluster_name",))
        return self.cluster

    def steps(self, job: str, *, timeout: float = 10.0) -> list[Step]:
        self._known("steps", job)
        return list(self.running.get(job, []))

    def cancel_step(self, step: str, *, timeout: float = 10.0) -> None:
        self.calls.append(("cancel_step", step))
        job = step.partition(".")[0]
        self.running[job] = [s for s in self.running.get(job, []) if s.id != step]

    def step_command(
        self,
        argv: Sequence[str],
        nodes: Sequence[str] | None,
        *,
        tasks_per_node: int | None = None,
        overlap: bool = False,
    ) -> list[str]:
        return Slurm().step_command(argv, nodes, tasks_per_node=tasks_per_node, overlap=overlap)

    def probe_node(self, job: str, node: str, *, timeout: float = 10.0) -> None:
        self.calls.append(("probe_node", job, node))
        if node in self.dead:
            raise CommandError(["srun", node], "timeout", f"node {node} did not answer")

    def helper_command(self, job: str, node: str, argv: Sequence[str], *, name: str) -> list[str]:
        """Recorded; ``true`` by its path (the tests' PATH has no system folder): a command
        that ends at once, where SLURM's would be srun; no launcher runs in a unit test."""
        self.calls.append(("helper_command", job, node, name))
        return [shutil.which("true") or "true"]


def with_condition(node: Node) -> Node:
    """``node`` as Slurm.nodes gives it: its printed state sorted (``Node.condition``)."""
    return replace(node, condition=node.condition or node_condition(node.state))


def local_iso(epoch: float) -> str:
    """What squeue/scontrol print: local time, no offset."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch))


@pytest.fixture(autouse=True)
def _timelines_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Job timelines of every test go to its tmp_path, never to ~/.cache/slurmclock."""
    where = tmp_path / "timelines"
    monkeypatch.setenv("SLURMCLOCK_DIR", str(where))
    return where


@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    """Environment values are named once per process; each test is a process of its own."""
    from slurmclock import job

    job._warned.clear()
    yield
    job._warned.clear()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def fakes() -> Any:
    """The fake classes and helpers, for tests that build several."""

    class Fakes:
        Clock = FakeClock
        Runner = FakeRunner
        Scheduler = FakeScheduler
        iso = staticmethod(local_iso)

    return Fakes


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_localslurm() -> ModuleType:
    return _load(LOCALSLURM, "localslurm")


@pytest.fixture(scope="session")
def time_table_tool() -> ModuleType:
    """tests/slurm_time_table.py: asks a SLURM how it reads --time strings."""
    return _load(Path(__file__).with_name("slurm_time_table.py"), "slurm_time_table")


@pytest.fixture(scope="session")
def localslurm() -> ModuleType:
    if not LOCALSLURM.is_file():
        pytest.fail(f"{LOCALSLURM} is missing: run the tests from the repository checkout")
    return _load_localslurm()


@pytest.fixture(scope="session")
def cluster(localslurm: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A running single-node SLURM (8 CPUs), shared by the session; stopped even on failure."""
    reason = localslurm.unavailable_reason()
    if reason is not None:
        if REQUIRE_SLURM:
            pytest.fail(f"PYRECOVER_REQUIRE_SLURM=1 but no SLURM here: {reason}")
        pytest.skip(reason)
    c = localslurm.LocalCluster(tmp_path_factory.mktemp("slurm"), cpus=8)
    c.start()
    try:
        yield c
    finally:
        c.stop()
