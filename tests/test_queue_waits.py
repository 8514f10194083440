"""bench/queue_waits.py: the queue waits simulate_cluster.py draws, read from queue_replay.py's
runs (untrusted files: bad ones skipped and counted, nothing usable -> one line), and the
``busy-replay`` preset built from them."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def qw(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    return load_bench("queue_waits")


def _alloc(job: str, eligible: str, start: str) -> str:
    return (
        f"alloc 1.0 {job} JobId={job} SubmitTime=2026-11-28T07:00:00 "
        f"EligibleTime=2026-11-28T{eligible} StartTime=2026-11-28T{start} EndTime=x\n"
    )


# A requeue run, scale 20: submitted, waited 1 s (eligible at once); stopped, requeued and held
# (eligible 10 s after the stop), started 3 s later; stopped again and still waiting 40 s later
# at the window's end. SLURM's queue waits: 1 s, 3 s (wall) -> 20, 60 model s; the wait under
# way: 40 s - the run's stop-to-eligible gap (13 - 3 = 10 s) = 30 s -> 600 model s.
RECORDS: list[dict[str, Any]] = [
    {"job": "9", "start": 1000.0, "wait_s": 1.0, "stop": 1100.0},
    {"job": "9", "start": 1113.0, "wait_s": 13.0, "stop": 1200.0},
    {"job": None, "start": None, "wait_s": 40.0},
]
EVENTS = (
    _alloc("9", "07:00:00", "07:00:01")
    + "stop 1.0 9 requeue\n"
    + _alloc("9", "07:01:50", "07:01:53")
)
WAITS = (20.0, 60.0, 600.0)


def _run(folder: Path, result: Any, events: str | None = EVENTS) -> Path:
    (folder / "state").mkdir(parents=True)
    text = result if isinstance(result, str) else json.dumps(result)
    (folder / "result.json").write_text(text)
    if events is not None:
        (folder / "state" / "events.log").write_text(events)
    return folder


def _good(**over: Any) -> dict[str, Any]:
    return {"policy": "requeue", "scale": 20.0, "allocation_records": RECORDS, **over}


def _recs(*waits: float) -> list[dict[str, Any]]:
    return [{**r, "wait_s": w} for r, w in zip(RECORDS, waits, strict=True)]


# (name, the runs' result.json contents (str: as written), waits left, what was skipped)
CASES = [
    ("one good run", [_good()], WAITS, {}),
    ("another policy's run is not read", [_good(), _good(policy="successor")], WAITS, {}),
    ("successor-early is never read", [_good(), _good(policy="successor-early")], WAITS, {}),
    ("garbage JSON", [_good(), "{not json"], WAITS, {"not JSON": 1}),
    ("JSON, not a result", [_good(), [1, 2]], WAITS, {"not a replay's result": 1}),
    ("a zero scale", [_good(), _good(scale=0)], WAITS, {"not a replay's result": 1}),
    ("NaN scale", [_good(), _good(scale=math.nan)], WAITS, {"not a replay's result": 1}),
    (
        "a negative wait_s",
        [_good(allocation_records=_recs(1.0, 13.0, -5.0))],
        WAITS[:2],
        {"negative, NaN or missing wait_s": 1},
    ),
    (
        "a wait_s under a second below 0 (SLURM's whole-second StartTime) is 0",
        [_good(allocation_records=_recs(-0.3, 13.0, 40.0))],
        WAITS,
        {},
    ),
    (
        "a NaN wait_s",
        [_good(allocation_records=_recs(1.0, math.nan, 40.0))],
        (20.0,),  # no gap measured: the wait under way would be a guess
        {"negative, NaN or missing wait_s": 1, "wait under way, no requeue measured before it": 1},
    ),
    (
        "a record that is no allocation",
        [_good(allocation_records=[*RECORDS, "x", {"start": "soon"}])],
        WAITS,
        {"not an allocation record": 2},
    ),
]


@pytest.mark.parametrize(("name", "results", "waits", "skipped"), CASES, ids=[c[0] for c in CASES])
def test_replay_waits_read_from_a_folder_of_runs(
    qw: ModuleType,
    tmp_path: Path,
    name: str,
    results: list[Any],
    waits: tuple[float, ...],
    skipped: dict[str, int],
) -> None:
    for i, result in enumerate(results):
        _run(tmp_path / f"run{i}", result)
    got = qw.read_replay(tmp_path)
    assert got.waits == pytest.approx(waits)
    assert dict(got.skipped) == skipped
    assert f"n={len(waits)} waits" in got.about()


def test_no_events_log_means_no_slurm_record(qw: ModuleType, tmp_path: Path) -> None:
    _run(tmp_path / "a", _good(), events=None)
    _run(tmp_path / "b", _good())
    got = qw.read_replay(tmp_path)
    assert got.waits == pytest.approx(WAITS)
    assert dict(got.skipped) == {
        "no SLURM record of the allocation": 2,
        "wait under way, no requeue measured before it": 1,
    }


# (name, how the folder is made, words the one line must hold)
EMPTY = [
    ("no such folder", lambda p: p / "missing", ["no such folder"]),
    ("an empty folder", lambda p: p, ["0 result.json read"]),
    ("only garbage", lambda p: _run(p / "r", "]]").parent, ["skipped: 1 not JSON"]),
    ("only successor runs", lambda p: _run(p / "r", _good(policy="successor")).parent, ["none of"]),
]


@pytest.mark.parametrize(("name", "make", "words"), EMPTY, ids=[c[0] for c in EMPTY])
def test_nothing_usable_is_one_line_naming_the_path_and_the_fix(
    qw: ModuleType, tmp_path: Path, name: str, make: Any, words: list[str]
) -> None:
    path = make(tmp_path)
    with pytest.raises(ValueError) as err:
        qw.read_replay(path)
    line = str(err.value)
    assert "\n" not in line and str(path) in line and "bench/results/queue-busy" in line
    assert all(w in line for w in words), line


def test_a_successor_run_is_read_when_asked_for(qw: ModuleType, tmp_path: Path) -> None:
    _run(tmp_path / "requeue", _good(allocation_records=RECORDS[:1]))
    _run(tmp_path / "successor", _good(policy="successor"))
    got = qw.read_replay(tmp_path, policy="successor")
    assert got.waits == pytest.approx(WAITS) and got.policy == "successor"
    assert "successor job" in got.about() and "no requeue hold" in got.about()
    assert qw.read_replay(tmp_path).waits == pytest.approx(WAITS[:1])
    with pytest.raises(ValueError, match="'successor-early': the queue waits of requeue or succ"):
        qw.read_replay(tmp_path, policy="successor-early")


def test_the_committed_replays_give_the_busy_and_idle_waits(qw: ModuleType) -> None:
    busy = qw.read_replay(BENCH / "results" / "queue-busy")
    assert busy.runs >= 5 and not busy.skipped and len(busy.waits) >= 10
    # after the requeue hold: had the 120 model s hold been counted, most waits would exceed it
    assert statistics.median(busy.waits) < 120
    assert qw.read_replay(BENCH / "results" / "queue-idle").mean < 60


@pytest.fixture(scope="module")
def sim(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    """simulate_cluster.py: needs numpy and slurmclock (bench_smoke runs these tests with them;
    the repo session, which has neither, skips them)."""
    pytest.importorskip("numpy")
    pytest.importorskip("slurmclock")
    return load_bench("simulate_cluster")


def test_the_replay_preset_draws_the_waits_computed_by_hand(
    sim: ModuleType, qw: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(tmp_path / "run1", _good())
    _run(tmp_path / "run2", _good(allocation_records=RECORDS[:1]))  # one wait: 1 s
    queue = sim.parse_queue(f"replay:{tmp_path}")
    assert queue.kind == "empirical"
    assert queue.mean == pytest.approx(statistics.fmean([*WAITS, 20.0]))  # 175 model s
    assert "n=4" in queue.about
    with pytest.raises(ValueError, match="replay:/no/such"):
        sim.parse_queue("replay:/no/such")
    with pytest.raises(SystemExit) as stop:  # the command line: exit 2, one line
        sim.parse_args(["--queue", f"replay:{tmp_path / 'none'}"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no such folder" in err and "bench/results/queue-busy" in err
    assert sim.parse_queue("busy-replay").mean == pytest.approx(
        qw.read_replay(BENCH / "results" / "queue-busy").mean
    )


def test_a_successor_meets_its_own_replay_queue_without_the_hold(
    sim: ModuleType, qw: ModuleType
) -> None:
    busy = sim.parse_queue("busy-replay")
    succ = sim.successor_queue(busy)
    assert succ.name == busy.name and "successor job" in succ.about
    want = qw.read_replay(BENCH / "results" / "queue-busy", policy="successor")
    assert succ.mean == pytest.approx(want.mean) and succ.mean != pytest.approx(busy.mean)
    idle = sim.parse_queue("idle")
    assert sim.successor_queue(idle) is idle  # not a replay: only the hold differs
    base = sim.Cluster(queue=idle, failures=sim.FAILURE_PRESETS["llama3"])
    assert base.requeue_delay == pytest.approx(sim.CRED_EXPIRE + 1)
    assert replace(base, handover="successor").requeue_delay == pytest.approx(sim.SUBMIT_S)
    with pytest.raises(ValueError, match="handover 'chain': use one of requeue, successor"):
        replace(base, handover="chain")


def test_the_successor_gains_the_requeue_hold_of_every_allocation(sim: ModuleType) -> None:
    """A fixed queue, no failures: the successor's allocations start the hold (120 s) sooner,
    so its goodput is the requeue's x (cycle) / (cycle - hold), to the simulation's noise."""
    queue = sim.parse_queue("fixed:10m")
    base = sim.Cluster(queue=queue, failures=sim.FAILURE_PRESETS["llama3"])
    job = sim.Job(sim.SCENARIOS[1], 16, sim.HOUR, pool=4, phase_pool=1, seed=0)
    run = {"days": 3.0, "trials": 1, "seed": 0}
    rows = sim.study(base, [queue], [base.failures], [job], **run)
    (plain, failing) = sim.handover_study(base, [queue], base.failures, [job], rows, **run)
    assert plain["failures"] == "none" and failing["failures"] == "llama3"
    per_day = next(r for r in rows if r["policy"] == "no failures")["allocations_per_day"]
    cycle = sim.DAY / per_day
    want = cycle / (cycle - (sim.CRED_EXPIRE + 1 - sim.SUBMIT_S))
    assert plain["successor_vs_requeue"] == pytest.approx(want, rel=0.01)
    assert plain["mean_wait_successor_s"] == plain["mean_wait_requeue_s"] == 600


def test_an_early_successor_hides_a_steady_wait_behind_the_training(sim: ModuleType) -> None:
    """A fixed 10-minute queue: from the second allocation on, slurmclock's plan submits the
    successor 10 min + LEAD_S before the end, so it starts LEAD_S - 1 s before it and the job
    hands over: allocations start every limit - LEAD_S + SUBMIT_S seconds, with no wait."""
    from slurmclock.supervisor.handover import LEAD_S

    queue = sim.parse_queue("fixed:10m")
    base = sim.Cluster(queue=queue, failures=sim.FAILURE_PRESETS["llama3"])
    job = sim.Job(sim.SCENARIOS[1], 16, sim.HOUR, pool=4, phase_pool=1, seed=0)
    pol = sim.POLICIES[0]
    succ = sim.run_job(replace(base, handover="successor"), pol, job, 3.0, (0, 0))
    early = sim.run_job(replace(base, handover="successor-early"), pol, job, 3.0, (0, 0))
    cycle = sim.HOUR - LEAD_S + sim.SUBMIT_S
    first = sim.HOUR / 2 + sim.SUBMIT_S + 600  # no wait measured yet: submitted at half
    assert early.wall == pytest.approx(600 + first + (early.allocations - 1) * cycle)
    assert early.waited == pytest.approx(600)  # the first submission's; then none
    assert succ.waited > 600 * succ.allocations
    assert early.useful / early.wall > 1.1 * succ.useful / succ.wall


# (what stopped the job, from its allocation's start) -> when the next allocation starts and
# what the next run's limit is. The first allocation plans the submission at half of the hour
# (1800 s): the successor starts at 1800 + 1 + 600 = 2401 s.
EARLY_MOMENTS = {
    "failure before the submission": (1000.0, 1000 + 1 + 600, 3600.0, 601.0),
    "failure while the successor waits": (2000.0, 2401.0, 3600.0, 401.0),
    "the successor starts: hand over": (None, 2401.0, None, 0.0),
}


@pytest.mark.parametrize("moment", EARLY_MOMENTS)
def test_an_early_successor_at_each_moment_of_a_stop(
    sim: ModuleType, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    released, next_start, next_limit, waited = EARLY_MOMENTS[moment]
    queue = sim.parse_queue("fixed:10m")
    cl = sim.Cluster(
        queue=queue, failures=sim.FAILURE_PRESETS["llama3"], handover="successor-early"
    )
    job = sim.Job(sim.SCENARIOS[1], 16, sim.HOUR, pool=4, phase_pool=1, seed=0)
    limits: list[float] = []

    def fake(cl: Any, pol: Any, job: Any, rngs: Any, length: float) -> Any:
        limits.append(length)
        end = length if len(limits) > 1 or released is None else released
        return sim.Allocation(useful=1.0, released=end, ended=end, eligible=end)

    monkeypatch.setattr(sim, "allocation", fake)
    tally = sim.run_job(cl, sim.POLICIES[0], job, (600 + next_start + 1) / sim.DAY, (0, 0))
    # the run's limit: the successor's start + a save and exit (asked to hand over then)
    assert limits[0] == pytest.approx(2401 + job.handover_s)
    if next_limit is None:  # the next step waited for this job to be gone
        next_limit = sim.HOUR - job.handover_s
    assert tally.allocations == 2 and limits[1] == pytest.approx(next_limit)
    assert tally.wall == pytest.approx(600 + next_start + sim.HOUR - 660 + 1 + 600)
    assert tally.waited == pytest.approx(600 + waited)


def test_a_lead_at_the_median_is_slurmclocks_own_plan(
    sim: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    queue = sim.parse_queue("lognormal:20m,1")
    base = sim.Cluster(
        queue=queue, failures=sim.FAILURE_PRESETS["llama3"], handover="successor-early"
    )
    job = sim.Job(sim.SCENARIOS[1], 16, sim.HOUR, pool=4, phase_pool=1, seed=0)
    got = [
        sim.run_job(replace(base, early_quantile=q), sim.POLICIES[0], job, 10.0, (0, 0))
        for q in (None, 0.5, 1.0)
    ]
    assert got[1].wall == got[0].wall and got[1].useful == got[0].useful
    assert got[2].allocations > got[0].allocations  # the largest wait as lead: cut more often
    with pytest.raises(SystemExit) as stop:
        sim.parse_args(["--early-quantiles", "0.5,2"])
    assert stop.value.code == 2
    assert "give numbers in 0..1" in capsys.readouterr().err.strip().splitlines()[-1]
