"""The real parts of the end-to-end suite, started and stopped by PID: one single-node SLURM
(tools/localslurm.py, 8 one-CPU job slots), a three-node one when a selected test needs it
(each daemon in network namespaces of its own), one moto_server S3 endpoint (tools/s3server.py),
a generated corpus; and the long SLURM scenarios, started in the background as soon as the
session begins (see e2e_helpers). At the end, a summary table: scenario, result, key figures.

Where slurm-wlm or moto_server is missing the scenarios that need them skip with the reason,
unless PYRECOVER_REQUIRE_SLURM=1 / PYRECOVER_REQUIRE_S3=1 (CI sets both): then they fail.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# e2e_helpers and train_helpers are on sys.path via pytest's pythonpath (root pyproject).
from e2e_helpers import (
    ALLOC_TRAIN_S,
    GOAL_ALLOCATIONS,
    Background,
    Job,
    LongRuns,
    calibrate,
    short_flags,
    start_straight,
    trainer_flags,
)
from train_helpers import (
    child_env,
    environ_without_launchers,
    load_tool,
    make_corpus,
    run_cli,
)

# -- the summary table ---------------------------------------------------------------------------

_ROWS: dict[str, dict[str, Any]] = {}
_T0 = time.monotonic()


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Key figures of a scenario, printed in the summary table (filled by the test)."""
    doc = (request.function.__doc__ or request.node.name).strip().splitlines()[0]
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None:
        doc += f" [{callspec.id}]"
    row: dict[str, Any] = {"scenario": doc, "figures": {}, "result": "?"}
    _ROWS[request.node.nodeid] = row
    figures: dict[str, Any] = row["figures"]
    return figures


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    row = _ROWS.get(item.nodeid)
    decided = report.when == "call" or report.outcome != "passed"
    if row is not None and decided and row["result"] in ("?", "passed"):
        row["result"] = "skipped" if report.skipped else report.outcome
    return report


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _ROWS:
        return
    w = terminalreporter
    w.section(f"e2e summary ({time.monotonic() - _T0:.0f} s)")
    width = max(len(r["scenario"]) for r in _ROWS.values())
    for row in _ROWS.values():
        figs = "; ".join(f"{k} {v}" for k, v in row["figures"].items())
        w.write_line(f"{row['scenario']:<{width}}  {row['result'].upper():<7}  {figs}")


# Set when the first test of a background scenario begins: the foreground (CPU-bound) ones are done.
FOREGROUND_DONE = threading.Event()

# The fixtures through which a test waits for a scenario run in the background. Named, not matched
# by a "long" prefix: the autouse session fixture long_runs is in every test's fixturenames, which
# set FOREGROUND_DONE at the first test and started every background driver beside the foreground.
BACKGROUND_FIXTURES = frozenset({"long", "long_faults", "long_multinode", "long_node_faults"})


def in_background(item: pytest.Item) -> bool:
    return not BACKGROUND_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if in_background(item):
        FOREGROUND_DONE.set()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long SLURM scenarios run in the background from the session's start; their tests only
    wait and assert. Last, so the CPU-bound scenarios run in the foreground meanwhile."""
    items.sort(key=in_background)


# -- real parts ----------------------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def timelines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """slurmclock's job timelines (every pyrecover-train under SLURM marks its job's) go to the
    session's temp folder: never the user's ~/.cache/slurmclock, nor tempguard's catch-all.
    Session-wide, as a requeued job's allocations read its timeline, and set before the SLURM
    cluster starts: it copies this environment, and so do the jobs."""
    where = tmp_path_factory.mktemp("timelines")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURMCLOCK_DIR", str(where))
        yield where


def _unavailable(what: str, why: str, require: str) -> None:
    if os.environ.get(require) == "1":
        pytest.fail(f"{require}=1 but {what} is not available: {why}")
    pytest.skip(f"no {what}: {why}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory, timelines: Path) -> Iterator[Any]:
    """A running local SLURM, or None (with the reason in ``.why``)."""
    localslurm = load_tool("localslurm")
    why = localslurm.unavailable_reason()
    if why is not None:
        yield _Missing(why)
        return
    with localslurm.LocalCluster(tmp_path_factory.mktemp("slurm"), cpus=8) as cluster:
        # Variables of an enclosing launcher must not leak into the jobs.
        cluster.env = {**environ_without_launchers(), "SLURM_CONF": str(cluster.conf_path)}
        cluster.env["PATH"] = cluster.env.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
        yield cluster


@pytest.fixture(scope="session")
def multinode_slurm(tmp_path_factory: pytest.TempPathFactory, timelines: Path) -> Iterator[Any]:
    """A running SLURM of a controller and three nodes (2 one-CPU job slots each), each in
    network namespaces of its own, with SLURM's default SlurmdTimeout; or None (the reason in
    ``.why``). Started only when a selected test needs it."""
    localslurm = load_tool("localslurm")
    why = localslurm.multinode_unavailable_reason()
    if why is not None:
        yield _Missing(why)
        return
    workdir = tmp_path_factory.mktemp("slurm-nodes")
    with localslurm.MultiNodeCluster(workdir, nodes=3, cpus=2) as cluster:
        # Variables of an enclosing launcher must not leak into the jobs.
        cluster.env = localslurm.client_env(cluster.conf_path, environ_without_launchers())
        yield cluster


@dataclass
class _Missing:
    why: str


@pytest.fixture
def cluster(slurm_cluster: Any) -> Any:
    if isinstance(slurm_cluster, _Missing):
        _unavailable("local SLURM", slurm_cluster.why, "PYRECOVER_REQUIRE_SLURM")
    return slurm_cluster


@pytest.fixture
def multinode_cluster(multinode_slurm: Any) -> Any:
    if isinstance(multinode_slurm, _Missing):
        _unavailable("multi-node local SLURM", multinode_slurm.why, "PYRECOVER_REQUIRE_SLURM")
    return multinode_slurm


@pytest.fixture(scope="session")
def s3server_module() -> Any:
    return load_tool("s3server")


@pytest.fixture
def moto(s3server_module: Any) -> Iterator[Any]:
    """A fresh moto_server behind a TCP proxy this process can cut and restore."""
    why = s3server_module.unavailable_reason()
    if why is not None:
        _unavailable("S3 endpoint (moto_server)", why, "PYRECOVER_REQUIRE_S3")
    with s3server_module.MotoServer(proxy=True) as server:
        server.make_bucket("ckpt")
        yield server


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "corpus.parquet", docs=400)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


# -- the long scenarios, started at once ---------------------------------------------------------


def long_flags(corpus: Path, cache: Path, ckpt: Path, steps: int) -> list[str]:
    return trainer_flags(corpus, cache, ckpt, steps, 500, "--log-every", "50")


@pytest.fixture(scope="session", autouse=True)
def long_runs(
    request: pytest.FixtureRequest,
    corpus: Path,
    cache_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[LongRuns | None]:
    """Submits the time-limit, preemption and distributed jobs before the first test runs and
    starts the uninterrupted reference run they are compared with."""
    # Only when a selected test needs them (`-k crash` does not).
    if not any("long" in getattr(i, "fixturenames", ()) for i in request.session.items):
        yield None
        return
    slurm_cluster = request.getfixturevalue("slurm_cluster")
    if isinstance(slurm_cluster, _Missing):
        yield None
        return
    from scenarios import drive_distributed, drive_preemption, drive_time_limit, preempt_flags

    work = tmp_path_factory.mktemp("long")
    wanted = {
        name
        for item in request.session.items
        for name in ("time_limit", "preemption", "distributed")
        if f"test_slurm_{name}" in item.nodeid
    }
    # Enough steps for >= 3 three-minute allocations: sized with the CPU time of a step, before
    # anything else starts (a busier machine later means more allocations, never fewer).
    quiet, steps = None, 2000
    if "time_limit" in wanted:
        quiet = calibrate(corpus, cache_dir, work / "calibrate")
        goal = (GOAL_ALLOCATIONS - 0.7) * ALLOC_TRAIN_S
        steps = max(2000, min(60000, int(round(goal / quiet.step_s, -2))))
    ref_ckpt, preempt_ref = work / "reference", work / "preempt-reference"
    bg = Background()
    runs_ = LongRuns(
        steps, quiet, long_flags(corpus, cache_dir, Path("ckpt"), steps), ref_ckpt, bg, work
    )
    runs_.preempt_reference = preempt_ref
    straight: list[Any] = []  # the uninterrupted reference runs, killed at the end if still on
    if "time_limit" in wanted:
        straight.append(start_straight(long_flags(corpus, cache_dir, ref_ckpt, steps), child_env()))
        bg.start("reference", lambda proc=straight[-1]: _finish_reference(proc))
        timelimit = Job(slurm_cluster, work, "timelimit")
        bg.start("time_limit", lambda: drive_time_limit(timelimit, runs_.flags))
    if "preemption" in wanted:
        straight.append(start_straight(preempt_flags(corpus, cache_dir, preempt_ref), child_env()))
        bg.start("preempt_reference", lambda proc=straight[-1]: _finish_reference(proc))
        flags = preempt_flags(corpus, cache_dir, Path("ckpt"))
        bg.start("preemption", lambda: drive_preemption(Job(slurm_cluster, work, "preempt"), flags))
    if "distributed" in wanted:
        bg.start(
            "distributed",
            lambda: drive_distributed(Job(slurm_cluster, work, "dist"), corpus, cache_dir),
        )
    try:
        yield runs_
    finally:
        for proc in straight:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        for job in list(slurm_cluster.jobs()):
            slurm_cluster.run(["scancel", job], check=False)
        bg.join_all(timeout=60)


def _finish_reference(proc: Any) -> str:
    out, _ = proc.communicate(timeout=2400)
    assert proc.returncode == 0, out
    return str(out)


@pytest.fixture
def long(long_runs: LongRuns | None, cluster: Any) -> LongRuns:
    assert long_runs is not None, "the long scenarios were not started"
    return long_runs


@pytest.fixture(scope="session", autouse=True)
def multinode_runs(
    request: pytest.FixtureRequest,
    corpus: Path,
    cache_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    long_runs: LongRuns | None,
) -> Iterator[Background | None]:
    """Starts the two-node scenario (test_slurm_multinode.py) in the background, when selected,
    sized with the long runs' calibration (its own when they have none)."""
    if not any("long_multinode" in getattr(i, "fixturenames", ()) for i in request.session.items):
        yield None
        return
    cluster = request.getfixturevalue("multinode_slurm")
    if isinstance(cluster, _Missing):
        yield None
        return
    from multinode import drive_two_nodes

    work = tmp_path_factory.mktemp("nodes")
    quiet = long_runs.quiet if long_runs is not None else None
    quiet = quiet or calibrate(corpus, cache_dir, work / "calibrate")
    bg = Background()
    bg.start("two_nodes", lambda: drive_two_nodes(cluster, work, corpus, cache_dir, quiet))
    try:
        yield bg
    finally:
        for job in list(cluster.jobs()):
            cluster.run(["scancel", job], check=False)
        bg.join_all(timeout=60)


@pytest.fixture
def long_multinode(multinode_runs: Background | None, multinode_cluster: Any) -> Background:
    assert multinode_runs is not None, "the two-node scenario was not started"
    return multinode_runs


def _selected(request: pytest.FixtureRequest, module: str) -> list[str]:
    """The ``name`` parameters of the selected tests of ``module``, each once, in order."""
    names = (
        item.callspec.params["name"]
        for item in request.session.items
        if module in item.nodeid and hasattr(item, "callspec")
    )
    return list(dict.fromkeys(names))


@pytest.fixture(scope="session", autouse=True)
def node_fault_runs(
    request: pytest.FixtureRequest,
    corpus: Path,
    cache_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    long_runs: LongRuns | None,
) -> Iterator[Background | None]:
    """Starts the selected cases of scenario 11 (test_slurm_node_faults.py: nodes lost
    mid-run), each on a multi-node cluster of its own, in the background once the foreground
    scenarios are done (they mostly wait for SLURM and the supervisor)."""
    wanted = _selected(request, "test_slurm_node_faults")
    localslurm = load_tool("localslurm")
    if not wanted or localslurm.multinode_unavailable_reason() is not None:
        yield None
        return
    from node_faults import BY_NAME, drive_node_faults

    work = tmp_path_factory.mktemp("node-faults")
    quiet = long_runs.quiet if long_runs is not None else None
    if quiet is None and any(BY_NAME[n].limited for n in wanted):
        quiet = calibrate(corpus, cache_dir, work / "calibrate")
    clusters: list[Any] = []
    bg = Background()

    def start() -> None:
        FOREGROUND_DONE.wait(timeout=3600)
        env = environ_without_launchers()
        drive_node_faults(bg, localslurm, env, work, corpus, cache_dir, quiet, wanted, clusters)

    bg.start("start", start)
    try:
        yield bg
    finally:
        for cluster in clusters:
            for job in list(cluster.jobs()):
                cluster.run(["scancel", job], check=False)
        bg.join_all(timeout=60)
        for cluster in clusters:
            cluster.stop()


@pytest.fixture
def long_node_faults(node_fault_runs: Background | None) -> Background:
    why = load_tool("localslurm").multinode_unavailable_reason()
    if why is not None:
        _unavailable("multi-node local SLURM", why, "PYRECOVER_REQUIRE_SLURM")
    assert node_fault_runs is not None, "scenario 11 was not started"
    node_fault_runs.result("start", timeout=3600)  # the cases were started
    return node_fault_runs


# -- the short scenarios' configuration and reference ---------------------------------------------


@pytest.fixture(scope="session")
def short_reference(
    corpus: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The short configuration run straight through: what every interrupted run must equal."""
    ckpt = tmp_path_factory.mktemp("short-reference")
    r = run_cli(short_flags(corpus, cache_dir, ckpt))
    assert r.returncode == 0, r.stdout + r.stderr
    return ckpt


# -- the fault matrix (test_slurm_faults.py), started at once -------------------------------------


@dataclass
class FaultMatrix:
    background: Background
    clusters: dict[str, Any]
    workdir: Path


@pytest.fixture(scope="session", autouse=True)
def fault_matrix(
    request: pytest.FixtureRequest,
    corpus: Path,
    cache_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    long_runs: LongRuns | None,
) -> Iterator[FaultMatrix | None]:
    """Starts the matrix's clusters at once and its drivers (only those of the selected cases)
    in the background once the foreground scenarios are done: they are CPU-bound, the matrix
    mostly waits for SLURM, and the time-limit scenario, which measures its start-ups and
    goodput, runs on meanwhile (a CI session is as long as that scenario)."""
    from faults import BY_NAME, PREEMPT_CONF, PREEMPT_PARTITIONS, SLURM_DEFAULTS, TWO_RANK_REFERENCE

    wanted = _selected(request, "test_slurm_faults")
    localslurm = load_tool("localslurm")
    if not wanted or localslurm.unavailable_reason() is not None:
        yield None
        return
    if any(BY_NAME[n].reference == "two-ranks" for n in wanted):
        wanted.append(TWO_RANK_REFERENCE.name)
    work = tmp_path_factory.mktemp("faults")
    # A task SIGKILLed on a loaded machine may take a while to go: not a reason to drain the node.
    slow = {"UnkillableStepTimeout": "180"}
    slow.update(SLURM_DEFAULTS)  # PYRECOVER_E2E_SLURM_DEFAULTS=1: the figures at SLURM's own
    specs: dict[str, dict[str, Any]] = {
        "faults": {"cpus": 16, "extra_conf": {"KillWait": "5", **slow}},
        "kw30": {"cpus": 2, "extra_conf": {"KillWait": "30", **slow}},
        "preempt": {
            "cpus": 2,
            "extra_conf": {**PREEMPT_CONF, **slow},
            "partitions": PREEMPT_PARTITIONS,
        },
    }
    clusters: dict[str, Any] = {}
    bg = Background()
    try:
        for key in sorted({BY_NAME[n].cluster for n in wanted}):
            cluster = localslurm.LocalCluster(work / f"slurm-{key}", **specs[key])
            clusters[key] = cluster.start()
            cluster.env = {**environ_without_launchers(), "SLURM_CONF": str(cluster.conf_path)}
            cluster.env["PATH"] = cluster.env.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
        bg.start("faults", lambda: _start_faults(bg, clusters, work, wanted, corpus, cache_dir,
                                                 long_runs))  # fmt: skip
        yield FaultMatrix(bg, clusters, work)
    finally:
        for cluster in clusters.values():
            for job in list(cluster.jobs()):
                cluster.run(["scancel", job], check=False)
        bg.join_all(timeout=60)
        for cluster in clusters.values():
            cluster.stop()


def _start_faults(
    bg: Background,
    clusters: dict[str, Any],
    work: Path,
    wanted: list[str],
    corpus: Path,
    cache: Path,
    long_runs: LongRuns | None,
) -> None:
    from faults import BY_NAME, drive, drive_preemption

    free_port = load_tool("localslurm").free_port
    FOREGROUND_DONE.wait(timeout=3600)
    for name in wanted:
        case = BY_NAME[name]
        if case.cluster == "preempt":
            continue
        job = Job(clusters[case.cluster], work, name)
        port = free_port()
        bg.start(name, lambda c=case, j=job, p=port: drive(c, j, corpus, cache, master_port=p))
    if any(BY_NAME[n].cluster == "preempt" for n in wanted):
        bg.start("preemption", lambda: drive_preemption(clusters["preempt"], work, corpus, cache))
