"""Fakes for unit tests, and a real single-node SLURM for the integration tests.

The cluster comes from the repository's ``tools/localslurm.py``, loaded by path (it is not a
package). One cluster serves the whole session; tests submit several jobs at once.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from slurmclock import CommandError

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
