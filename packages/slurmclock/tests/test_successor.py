"""A successor job instead of a requeue (``slurmclock supervise --successor``): the sbatch it
runs, its --time-min floor, the chain's bound (a fake runner); and on a real SLURM at its default
``cred_expire`` (120 s: a requeue is held 121 s), the next allocation starting within seconds of
the previous one's end."""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from slurmclock import CommandError
from slurmclock.supervisor.history import RestartCost
from slurmclock.supervisor.successor import (
    CHAIN_INDEX,
    FLOOR_STEPS,
    chain_index,
    submit_successor,
    successor_argv,
    time_min_floor,
)


class Runner:
    def __init__(self, answer: str | BaseException) -> None:
        self.answer, self.calls = answer, []  # type: list[Sequence[str]]

    def __call__(self, argv: Sequence[str], timeout: float) -> str:
        self.calls.append(list(argv))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def test_argv_depends_on_the_job_and_counts_the_chain() -> None:
    argv = successor_argv("41", ["--time=60", "job.sh", "--continue"], index=2, time_min=30)
    assert argv[:5] == [
        "sbatch",
        "--parsable",
        "--dependency=afterany:41",
        "--kill-on-invalid-dep=yes",
        f"--export=ALL,{CHAIN_INDEX}=3,SLURMCLOCK_CHAIN_ID=41",  # slurmclock.chain
    ]
    assert argv[5:] == ["--time-min=30", "--time=60", "job.sh", "--continue"]
    assert "--time-min" not in " ".join(successor_argv("41", ["j.sh"], index=0, time_min=None))


@pytest.mark.parametrize(
    ("cost", "minutes"),
    [
        (RestartCost(), 1),  # the 60 s guess, no step or save measured
        (RestartCost(startup=50.0, step=4.0, save=90.0), 4),  # 50 + 80 + 90 = 220 s
        (RestartCost(startup=600.0, step=1.0, save=30.0), 11),
    ],
)
def test_floor_holds_startup_a_save_and_steps(cost: RestartCost, minutes: int) -> None:
    assert time_min_floor(cost, guess=60.0) == minutes
    assert cost.seconds(guess=60.0, steps=FLOOR_STEPS) <= minutes * 60


def test_submit_raises_a_too_small_time_min_and_says_so() -> None:
    run = Runner("77\n")
    got = submit_successor(
        "41", ["j.sh"], env={CHAIN_INDEX: "1"}, max_chain=5, time_min=2, floor=4, runner=run
    )
    assert got.ok and got.job_id == "77"
    assert "raised to 4 min" in got.message and "job 77" in got.message
    assert (
        "--time-min=4" in run.calls[0]
        and f"--export=ALL,{CHAIN_INDEX}=2,SLURMCLOCK_CHAIN_ID=41" in run.calls[0]
    )


@pytest.mark.parametrize(
    ("answer", "env", "said"),
    [
        (CommandError(["sbatch"], "failed", "x", returncode=1, stderr="sbatch: error: bad\n"),
         {}, "sbatch failed: sbatch: error: bad"),
        ("Submitted batch job\n", {}, "not a job id"),
        ("9\n", {CHAIN_INDEX: "5"}, "6 allocations (max restarts)"),
    ],
)  # fmt: skip
def test_no_successor_is_one_line(answer: Any, env: dict[str, str], said: str) -> None:
    got = submit_successor("41", ["j.sh"], env=env, max_chain=5, runner=Runner(answer))
    assert not got.ok and said in got.message and "\n" not in got.message


def test_chain_index_reads_only_whole_numbers() -> None:
    assert chain_index({}) == 0 and chain_index({CHAIN_INDEX: "3"}) == 3
    assert chain_index({CHAIN_INDEX: "-1"}) == 0 and chain_index({CHAIN_INDEX: "x"}) == 0


def test_timeline_points_at_the_successor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from slurmclock.cli import main

    lines = [
        {"event": "start", "time": 1.9e9, "restart": 0},
        {"event": "requeued", "time": 1.9e9 + 60, "restart": 0, "successor": "77"},
    ]
    (tmp_path / "job-41.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["timeline", "41"], env={"SLURMCLOCK_DIR": str(tmp_path)}) == 0
    out = capsys.readouterr().out
    assert "successor=77" in out
    assert "the run goes on in job 77 (its successor): slurmclock timeline 77" in out


# -- on a real SLURM -------------------------------------------------------------------------

# The step: the first job's stops early (exit 75: steps left), its successor's finishes (0).
STEP = """
import json, os, sys, time
t = time.time()
rec = {"job": os.environ["SLURM_JOB_ID"], "index": os.environ.get("SLURMCLOCK_CHAIN_INDEX", "0"),
       "first_step": t}
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(rec) + "\\n")
sys.exit(75 if rec["index"] == "0" else 0)
"""


@pytest.fixture(scope="module")
def default_cluster(
    localslurm: ModuleType, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """SLURM at its default cred_expire (120 s): a requeued job would be held 121 s."""
    if (why := localslurm.unavailable_reason()) is not None:
        pytest.skip(why)
    with localslurm.LocalCluster(
        tmp_path_factory.mktemp("succ"), cpus=2, extra_conf={"AuthInfo": "cred_expire=120"}
    ) as c:
        yield c


def test_successor_starts_within_seconds_not_after_the_requeue_hold(
    default_cluster: Any, tmp_path: Path
) -> None:
    c = default_cluster
    log, step = tmp_path / "steps.jsonl", tmp_path / "step.py"
    step.write_text(STEP)
    script = tmp_path / "job.sh"
    bindir = Path(sys.executable).parent
    succ = f"-o {tmp_path}/out-%j.txt -t 3 {script}"
    script.write_text(
        "#!/bin/bash\n"
        f"export PATH={shlex.quote(str(bindir))}:$PATH\n"
        f"export SLURMCLOCK_DIR={shlex.quote(str(tmp_path / 'timelines'))}\n"
        f"exec slurmclock supervise --name t --time-min 1 --successor {shlex.quote(succ)} -- "
        f"{shlex.quote(sys.executable)} {step} {log}\n"
    )
    first = c.sbatch(str(script), "-o", f"{tmp_path}/out-%j.txt", "-t", "3", "--time-min=1")
    info1 = c.wait_for(first, {"COMPLETED", "FAILED"}, timeout=60)
    assert info1["JobState"] == "COMPLETED", (tmp_path / f"out-{first}.txt").read_text()
    deadline = time.monotonic() + 60
    while len(log.read_text().splitlines()) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["index"] for r in recs] == ["0", "1"], recs
    second = recs[1]["job"]
    info2 = c.wait_for(second, {"COMPLETED"}, timeout=60)
    assert info2["Dependency"] == "(null)" and info2.get("TimeMin") not in (None, "N/A")
    ended = time.mktime(time.strptime(info1["EndTime"], "%Y-%m-%dT%H:%M:%S"))
    started = time.mktime(time.strptime(info2["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    out = (tmp_path / f"out-{first}.txt").read_text()
    assert f"submitted job {second} to resume after job {first}" in out
    # The target: the next allocation's first step <= 10 s + start-up after the end
    # (SLURM's times are whole seconds: +1).
    assert started - ended <= 10 + 1, (info1["EndTime"], info2["StartTime"])
    assert recs[1]["first_step"] - ended <= 10 + (recs[1]["first_step"] - started) + 1
    # The first job's timeline names its successor (its `requeued` event).
    first_timeline = "".join(
        f.read_text() for f in (tmp_path / "timelines").glob(f"*{first}.jsonl")
    )
    assert f'"successor": "{second}"' in first_timeline, first_timeline
    # The finished chain submits nothing more.
    assert not list(c.jobs())


# -- a successor already waiting (--successor-early), on a real SLURM ------------------------

# The step (under srun: "save and stop now" reaches it through SLURM): resumes from the step
# count in CKPT, counts steps until SIGTERM (then saves and exits 75) or, by MODE, finishes at
# once (``finish``) or once the early successor was submitted (``finish-after-submit``).
EARLY_STEP = """
import json, os, signal, sys, time
log, ckpt, out, mode = sys.argv[1:5]
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
job, t = os.environ["SLURM_JOB_ID"], time.time()
resumed = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
def say(**rec):
    with open(log, "a") as f:
        f.write(json.dumps({"job": job, **rec}) + "\\n")
say(first_step=t, resumed=resumed, index=os.environ.get("SLURMCLOCK_CHAIN_INDEX", "0"))
def submitted():
    return os.path.exists(out) and "now: it waits in the queue" in open(out).read()
step, end = resumed, t + 45
while not stop and time.time() < end:
    if mode == "finish" or (mode == "finish-after-submit" and submitted()):
        break
    step += 1
    time.sleep(0.02)
with open(ckpt + ".tmp", "w") as f:
    f.write(str(step))
os.replace(ckpt + ".tmp", ckpt)
say(saved=step, at=time.time())
sys.exit(75 if stop else 0)
"""


def _early_script(tmp_path: Path, name: str, first_mode: str) -> Path:
    """A batch script: ``supervise --successor-early`` of ``srun`` the step; the chain's first
    job (index 0) runs ``first_mode``, its successor finishes at once."""
    step, script = tmp_path / "early_step.py", tmp_path / f"{name}.sh"
    step.write_text(EARLY_STEP)
    bindir = Path(sys.executable).parent
    succ = f"-o {tmp_path}/out-%j.txt -t 2 {script}"
    files = f"{tmp_path}/{name}.jsonl {tmp_path}/{name}.ckpt {tmp_path}/out-$SLURM_JOB_ID.txt"
    script.write_text(
        "#!/bin/bash\n"
        f"export PATH={shlex.quote(str(bindir))}:$PATH\n"
        f"export SLURMCLOCK_DIR={shlex.quote(str(tmp_path / 'timelines'))}\n"
        f'mode=finish; [ "${{SLURMCLOCK_CHAIN_INDEX:-0}}" = 0 ] && mode={first_mode}\n'
        f"exec slurmclock supervise --name t --successor {shlex.quote(succ)} --successor-early "
        f"-- srun -n1 {shlex.quote(sys.executable)} {step} {files} $mode\n"
    )
    return script


def _early_job(c: Any, tmp_path: Path, first: str) -> str:
    """The early successor's id, once the first job's log says it submitted it."""
    out, deadline = tmp_path / f"out-{first}.txt", time.monotonic() + 30
    while time.monotonic() < deadline:
        text = out.read_text() if out.exists() else ""
        for line in text.splitlines():
            if "now: it waits in the queue" in line:
                return line.split("submitted job ")[1].split()[0]
        time.sleep(0.2)
    raise AssertionError(f"no early successor submitted by job {first}:\n{text}")


def _state(c: Any, job: str) -> str:
    return str(c.job(job).get("JobState", ""))


def test_early_successor_waits_takes_over_and_is_cancelled_when_done(
    default_cluster: Any, tmp_path: Path
) -> None:
    c = default_cluster
    # The node's other CPU is taken: an early successor pends while its predecessor runs.
    blocker = c.sbatch("#!/bin/bash\nsleep 120\n", "-o", "/dev/null", "-t", "3")
    long_waits = "--export=ALL,SLURMCLOCK_CHAIN_WAITS=100000"  # the chain waited long: at once
    try:
        c.wait_for(blocker, {"RUNNING"}, timeout=30)
        # 1. The run finishes while its successor waits: the successor is cancelled.
        done = _early_script(tmp_path, "done", "finish-after-submit")
        a = c.sbatch(str(done), "-o", f"{tmp_path}/out-%j.txt", "-t", "2", long_waits)
        b = _early_job(c, tmp_path, a)
        c.wait_for(a, {"COMPLETED"}, timeout=30)
        assert c.wait_for(b, {"CANCELLED"}, timeout=15)["JobState"] == "CANCELLED"
        assert (
            f"cancelled job {b}, the successor submitted early"
            in (tmp_path / f"out-{a}.txt").read_text()
        )
        # 2. The successor starts while the first job trains: it saves and hands over.
        train = _early_script(tmp_path, "train", "train")
        first = c.sbatch(str(train), "-o", f"{tmp_path}/out-%j.txt", "-t", "2", long_waits)
        second = _early_job(c, tmp_path, first)
        assert _state(c, second) == "PENDING" and _state(c, first) == "RUNNING"
        c.run(["scancel", blocker])  # a CPU frees: the successor starts
        info2 = c.wait_for(second, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=40)
    finally:
        c.run(["scancel", blocker], check=False)
    info1 = c.wait_for(first, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=30)
    out1, out2 = ((tmp_path / f"out-{j}.txt").read_text() for j in (first, second))
    assert info1["JobState"] == "COMPLETED" and info2["JobState"] == "COMPLETED", out1 + out2
    assert f"job {second}, the successor, started: saving and handing over" in out1, out1
    assert f"handed over to job {second}" in out1 and "asked it to save and hand over" in out2
    started = time.mktime(time.strptime(info2["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    ended = time.mktime(time.strptime(info1["EndTime"], "%Y-%m-%dT%H:%M:%S"))
    assert ended - started <= 5 + 1, (info1["EndTime"], info2["StartTime"])  # a hand-over
    recs = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    saved = next(r for r in recs if r["job"] == first and "saved" in r)
    resumed = next(r for r in recs if r["job"] == second and "resumed" in r)
    assert saved["saved"] > 0 and resumed["resumed"] == saved["saved"], recs
    assert resumed["first_step"] >= saved["at"], recs  # after the predecessor's save
    assert not list(c.jobs())
