"""The chain's identity across the package boundary: ``SLURMCLOCK_CHAIN_ID`` and
``SLURMCLOCK_CHAIN_INDEX``, written by slurmclock (``supervise`` joins the job to its chain and
exports both to the step and to the successor job it submits), read by ckptstore's writer lock
(who holds it; a successor takes its predecessor's lock over at once, another run is refused).

First as data (what slurmclock exports, as SLURM hands it to the successor), then on a real
SLURM: a chain of two jobs whose step takes the experiment's lock, the first leaving it behind
as a job killed at its limit does; the second takes it over, and ``slurmclock timeline`` from a
login shell shows both allocations as one run."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from ckptstore import CheckpointStore, LockedError
from ckptstore.lock import LOCK_NAME, whoami
from slurmclock.chain import chain_id, chain_index, join
from slurmclock.supervisor.successor import successor_argv

ROOT = Path(__file__).resolve().parents[2]


def exported(argv: Sequence[str]) -> dict[str, str]:
    """The variables ``sbatch --export=ALL,K=V,...`` sets in the job, as SLURM sets them."""
    spec = next(a for a in argv if a.startswith("--export="))
    pairs = spec.removeprefix("--export=").split(",")[1:]
    return dict(p.split("=", 1) for p in pairs)


def test_a_successor_takes_over_its_predecessors_lock_another_run_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    first: dict[str, str] = {"SLURM_JOB_ID": "41"}
    join(first, "41")  # the supervisor of the chain's first job
    argv = successor_argv("41", ["job.sh"], index=chain_index(first), time_min=None)
    second = {**exported(argv), "SLURM_JOB_ID": "52"}  # what SLURM gives the successor
    assert join(second, "52") == {"chain": "41", "link": 1} and chain_id(second) == "41"
    # The first job held the lock on another node and was killed at its limit: its lock stays,
    # renewed a moment ago (its lease has 60 s to run).
    held = dataclasses.replace(whoami(time.time(), 60.0, first), host="node-other", token="x")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / LOCK_NAME).write_bytes(held.to_json())
    for key, value in second.items():
        monkeypatch.setenv(key, value)
    with CheckpointStore(str(tmp_path / "ckpt")) as store:
        info = store.acquire()
        assert info is not None and (info.chain, info.link, info.job_id) == ("41", 1, "52")
        assert "link 0 (SLURM job 41) of this run's chain 41" in caplog.text
        # A job of another chain while the successor writes: refused, one line naming it.
        other: dict[str, str] = {"SLURM_JOB_ID": "63", "SLURMCLOCK_CHAIN_INDEX": "3"}
        join(other, "63")
        for key, value in other.items():
            monkeypatch.setenv(key, value)
        with pytest.raises(LockedError) as refused:
            CheckpointStore(str(tmp_path / "ckpt")).acquire()
        line = str(refused.value)
        assert "\n" not in line and "SLURM job 52" in line and "link 1 of chain 41" in line


# -- on a real SLURM -------------------------------------------------------------------------

# The step: takes the experiment's lock; the first link ends as if killed (the lock stays
# behind, exit 75: steps left), the second finishes (0). Each appends what the lock said.
STEP = """
import json, logging, os, sys
logging.basicConfig(filename=sys.argv[2] + "." + os.environ["SLURM_JOB_ID"] + ".log")
from ckptstore import CheckpointStore, LockedError
store = CheckpointStore(sys.argv[1])
try:
    info = store.acquire()
except LockedError as e:
    print(e, file=sys.stderr)
    sys.exit(2)
rec = {"job": os.environ["SLURM_JOB_ID"], "chain": info.chain, "link": info.link}
with open(sys.argv[2], "a") as f:
    f.write(json.dumps(rec) + "\\n")
if info.link == 0:
    os._exit(75)
store.close()
"""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    spec = importlib.util.spec_from_file_location("localslurm", ROOT / "tools" / "localslurm.py")
    assert spec is not None and spec.loader is not None
    localslurm: ModuleType = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("localslurm", localslurm)
    spec.loader.exec_module(localslurm)
    if (why := localslurm.unavailable_reason()) is not None:
        if os.environ.get("PYRECOVER_REQUIRE_SLURM") == "1":
            pytest.fail(f"PYRECOVER_REQUIRE_SLURM=1 but no SLURM here: {why}")
        pytest.skip(why)
    with localslurm.LocalCluster(tmp_path_factory.mktemp("chain"), cpus=2) as c:
        yield c


def test_a_chain_of_jobs_is_one_run_and_one_writer(slurm: Any, tmp_path: Path) -> None:
    c, log, step = slurm, tmp_path / "steps.jsonl", tmp_path / "step.py"
    step.write_text(STEP)
    script, timelines = tmp_path / "job.sh", tmp_path / "timelines"
    succ = f"-o {tmp_path}/out-%j.txt -t 3 {script}"
    script.write_text(
        "#!/bin/bash\n"
        f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH\n"
        f"export SLURMCLOCK_DIR={shlex.quote(str(timelines))}\n"
        f'exec slurmclock supervise --name t --successor {shlex.quote(succ)} --run "$RUN" '
        "${CONT:+--continue-run} -- "
        f"{shlex.quote(sys.executable)} {step} {tmp_path / 'ckpt'} {log}\n"
    )
    job = (str(script), "-o", f"{tmp_path}/out-%j.txt", "-t", "3")
    first = c.sbatch(*job, env={"RUN": "r"})
    deadline = time.monotonic() + 90
    while len(_lines(log)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    recs = _lines(log)
    assert [(r["chain"], r["link"]) for r in recs] == [(first, 0), (first, 1)], _outs(tmp_path)
    second = recs[1]["job"]
    assert c.wait_for(second, {"COMPLETED"}, timeout=60)["JobState"] == "COMPLETED"
    took = Path(f"{log}.{second}.log").read_text()
    assert f"link 0 (SLURM job {first}) of this run's chain {first}" in took, took
    # The stopped run submitted again to go on (--continue): the chain's next link.
    third = c.sbatch(*job, env={"RUN": "r", "CONT": "1"})
    assert c.wait_for(third, {"COMPLETED", "FAILED"}, timeout=60)["JobState"] == "COMPLETED"
    assert _lines(log)[2] == {"job": third, "chain": first, "link": 2}, _outs(tmp_path)
    # From a login shell: either job's timeline shows the run's two allocations.
    env = {**os.environ, "SLURMCLOCK_DIR": str(timelines)}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    out = subprocess.run(
        ["slurmclock", "timeline", first, "--json"], env=env, capture_output=True, text=True
    )
    chain = json.loads(out.stdout)["chain"]
    assert chain["id"] == first and [k["job"] for k in chain["links"]] == [first, second, third]
    assert [k["verdict"] for k in chain["links"]] == [f"successor {second}", "done", "done"]
    assert chain["totals"]["allocations"] == 3 and None not in chain["waits_s"]
    # Another run (not of this chain) while someone writes the experiment: refused, exit 2.
    logging.getLogger("ckptstore").setLevel(logging.ERROR)
    with CheckpointStore(str(tmp_path / "ckpt")) as holder:
        holder.acquire()
        other = c.sbatch(*job, env={"RUN": "another", "CONT": "1"})
        info = c.wait_for(other, {"COMPLETED", "FAILED"}, timeout=60)
    said = (tmp_path / f"out-{other}.txt").read_text()
    assert info["ExitCode"].startswith("2:") and "is being written by another run" in said, said
    assert not list(c.jobs())


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _outs(folder: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(folder.glob("out-*.txt")))
