"""One writer per experiment (issue 14, wrong #3): a second writer is refused with one line
naming the holder; a lock that a killed job left never blocks the next one. Real processes
race for the lock on a local disk and on a real S3 endpoint (moto_server)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import TESTS

from ckptstore import CheckpointStore, LockedError, LockInfo
from ckptstore.cli import main as cli
from ckptstore.lock import LOCK_NAME, takeover_reason, whoami

CHILD = TESTS / "ckpt_lock_child.py"
HOST = socket.gethostname()


# -- the rules, as pure logic ----------------------------------------------------------------
def holder(**kw: Any) -> LockInfo:
    base: dict[str, Any] = {"token": "t", "host": "node-a", "pid": 100, "lease_s": 60.0}
    return LockInfo(**{**base, "since": 1000.0, "renewed": 1000.0, **kw})


LINK0: dict[str, Any] = {"job_id": "7", "chain": "7", "link": 0}
LINK1: dict[str, Any] = {"job_id": "8", "chain": "7", "link": 1}


@pytest.mark.parametrize(
    "held, me, now, alive, expect",
    [
        ({}, {"host": "node-b"}, 1030.0, True, None),  # another host, lease running
        ({}, {"host": "node-b"}, 1061.0, True, "lease expired"),
        ({"job_id": "7"}, {"host": "node-b", "job_id": "7"}, 1001.0, True, "same SLURM job 7"),
        ({"job_id": "7"}, {"host": "node-b", "job_id": "8"}, 1001.0, True, None),
        ({}, {"host": "node-a"}, 1001.0, False, "process 100 on this host is gone"),
        ({}, {"host": "node-a"}, 5000.0, True, None),  # alive here: never, lease or not
        ({"job_id": "7"}, {"host": "node-a", "job_id": "7"}, 1001.0, True, None),
        ({"boot_id": "b1"}, {"host": "node-a", "boot_id": "b2"}, 1001.0, True, "rebooted"),
        # slurmclock's successor jobs: an earlier link of the chain ended before this one began
        (LINK0, {"host": "node-b", **LINK1}, 1001.0, True, "link 0 (SLURM job 7) of this run's"),
        (LINK0, {"host": "node-a", **LINK1}, 1001.0, False, "link 0 (SLURM job 7)"),
        (LINK0, {"host": "node-a", **LINK1}, 1001.0, True, None),  # alive here: never
        (LINK0, {"host": "node-b", **LINK1, "chain": "9"}, 1001.0, True, None),  # another chain
        ({**LINK1, "link": 2}, {"host": "node-b", **LINK1, "job_id": "9"}, 1001.0, True, None),
        ({"job_id": "7"}, {"host": "node-b", **LINK1}, 1001.0, True, None),  # not of a chain
        ({**LINK0, "job_id": ""}, {"host": "node-b", **LINK1}, 1001.0, True, None),
    ],
)
def test_takeover_rules(
    held: dict[str, Any], me: dict[str, Any], now: float, alive: bool, expect: str | None
) -> None:
    me_info = holder(token="me", pid=200, **me)
    reason = takeover_reason(holder(**held), me_info, now, lambda h: alive)
    assert reason is None if expect is None else expect in (reason or "")


# -- real processes ------------------------------------------------------------------------
def start(mode: str, url: str, tmp: Path, name: str, hold: float, opts: Any = None, **env: str):
    args = [sys.executable, str(CHILD), mode, url, str(tmp / "go"), str(tmp / name), str(hold)]
    return subprocess.Popen(
        args + ([json.dumps(opts)] if opts else []),
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


HOLD_CAP = 240.0  # a winner holds until race() releases it; this only bounds a lost test


def race(
    tmp: Path, procs: dict[str, subprocess.Popen[str]], holders: tuple[str, ...] = ()
) -> dict[str, dict[str, Any]]:
    """Start them together (once all are ready), wait until each one but ``holders`` (trainers
    that report when they stop) has its result, release the winner, return every result. No
    step depends on how fast the machine is: a winner holds until the others have tried."""
    (tmp / "release").unlink(missing_ok=True)
    deadline = time.monotonic() + HOLD_CAP
    while not all((tmp / n).exists() for n in procs if n not in holders):
        for name, p in procs.items():
            if p.poll() is not None and not (tmp / name).exists():
                raise AssertionError(f"racer {name} died (exit {p.returncode}):\n{p.stdout.read()}")
        assert time.monotonic() < deadline, f"racers had no result in {HOLD_CAP:.0f} s"
        if all((tmp / f"{n}.ready").exists() for n in procs):
            (tmp / "go").touch()
        time.sleep(0.02)
    (tmp / "release").touch()
    out = {}
    for name, p in procs.items():
        output, _ = p.communicate(timeout=240)
        assert (tmp / name).exists(), f"{name} wrote no result (exit {p.returncode}):\n{output}"
        out[name] = json.loads((tmp / name).read_text())
    return out


def one_winner(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    winners = [r for r in results.values() if r["ok"]]
    assert len(winners) == 1, results
    for r in results.values():
        if not r["ok"]:
            assert "\n" not in r["error"] and f"pid {winners[0]['pid']}" in r["error"], r
            assert f"host {HOST}" in r["error"] and "ckptstore lock" in r["error"], r
    return winners[0]


@pytest.mark.slow
def test_racing_writers_on_local_disk(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    procs = {f"r{i}": start("acquire", url, tmp_path, f"r{i}", HOLD_CAP) for i in range(4)}
    one_winner(race(tmp_path, procs))
    assert not (tmp_path / "ckpt" / LOCK_NAME).exists()  # released on close


@pytest.mark.slow
@pytest.mark.s3
def test_racing_writers_on_s3(moto: Any, tmp_path: Path) -> None:
    url, opts = f"s3://ckpt/lock-{uuid.uuid4().hex[:8]}", moto.storage_options()
    procs = {f"r{i}": start("acquire", url, tmp_path, f"r{i}", HOLD_CAP, opts) for i in range(4)}
    one_winner(race(tmp_path, procs))
    with CheckpointStore(url, storage_options=opts) as store:
        assert not store.primary.storage.exists(store.primary.path(LOCK_NAME))


@pytest.mark.slow
def test_a_killed_writers_lock_is_taken_over_by_exactly_one(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    dead = race(tmp_path, {"dead": start("acquire-and-die", url, tmp_path, "dead", 0)})["dead"]
    assert dead["ok"] and (tmp_path / "ckpt" / LOCK_NAME).exists()
    (tmp_path / "go").unlink()
    procs = {f"r{i}": start("acquire", url, tmp_path, f"r{i}", HOLD_CAP) for i in range(3)}
    results = race(tmp_path, procs)
    winner = one_winner(results)
    assert winner["pid"] != dead["pid"]


@pytest.mark.slow
def test_a_second_trainer_is_refused_and_the_first_loses_nothing(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    procs = {"a": start("train", url, tmp_path, "a", HOLD_CAP)}
    (tmp_path / "go").touch()  # a starts writing once it is ready
    while not (tmp_path / "ckpt" / "latest").exists():
        assert procs["a"].poll() is None
        time.sleep(0.02)
    b = start("train", url, tmp_path, "b", HOLD_CAP)  # however long its start-up takes, a
    results = race(tmp_path, {**procs, "b": b}, holders=("a",))  # trains until b has tried
    assert results["a"]["ok"] and not results["b"]["ok"]
    assert f"pid {results['a']['pid']}" in results["b"]["error"]
    with CheckpointStore(url) as store:
        assert store.steps() == results["a"]["saved"]
        assert all(store.verify(s).ok for s in store.steps())
        store.save(1000, {"w": torch.ones(2)})  # a is gone: the experiment is free again


def crafted(root: Path, **kw: Any) -> None:
    now = time.time()
    info = holder(token="x", host="node-other", pid=4321, since=now - 3600, renewed=now, **kw)
    root.mkdir(parents=True, exist_ok=True)
    (root / LOCK_NAME).write_bytes(info.to_json())


@pytest.mark.slow
def test_a_requeued_job_takes_over_another_job_is_refused(tmp_path: Path) -> None:
    """A lock from another node (shared filesystem), renewed just now: only the same SLURM
    job (a requeue) may take it; any other run is refused with the holder's name."""
    url = str(tmp_path / "ckpt")
    crafted(tmp_path / "ckpt", job_id="4242", job_step="0")
    other = start("acquire", url, tmp_path, "other", 0, SLURM_JOB_ID="1")
    results = race(tmp_path, {"other": other})
    err = results["other"]["error"]
    assert "host node-other pid 4321, SLURM job 4242 step 0" in err and "\n" not in err
    (tmp_path / "go").unlink()
    again = start("acquire", url, tmp_path, "again", 0, SLURM_JOB_ID="4242")
    assert race(tmp_path, {"again": again})["again"]["ok"]


def test_an_expired_lease_is_taken_over_a_live_one_is_not(tmp_path: Path) -> None:
    crafted(tmp_path / "a", lease_s=60.0)
    with pytest.raises(LockedError, match="node-other.*in [56][0-9] s"):
        CheckpointStore(str(tmp_path / "a")).acquire()
    crafted(tmp_path / "b", lease_s=1.0)
    old = json.loads((tmp_path / "b" / LOCK_NAME).read_text())
    (tmp_path / "b" / LOCK_NAME).write_text(json.dumps({**old, "renewed": time.time() - 5}))
    with CheckpointStore(str(tmp_path / "b")) as store:
        assert store.acquire() is not None and store.writer is not None
        assert store.writer.pid == os.getpid()


def test_two_stores_in_one_process(tmp_path: Path) -> None:
    first = CheckpointStore(str(tmp_path))
    first.save(1, {"w": torch.ones(2)})
    second = CheckpointStore(str(tmp_path))
    with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
        second.save(2, {"w": torch.ones(2)})
    assert second.latest_step() == 1  # reading needs no lock
    first.close()
    second.save(2, {"w": torch.ones(2)})
    third = CheckpointStore(str(tmp_path))
    del second  # dropped without close(): its lock goes with it
    gc.collect()
    third.save(3, {"w": torch.ones(2)})
    third.close()


def test_a_writer_that_lost_its_lock_commits_nothing_more(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), lease_s=0.2)
    store.save(1, {"w": torch.ones(2)})
    crafted(tmp_path)  # as if another node took it over while we were suspended
    time.sleep(1.0)  # the next renewal (every lease/4 = 50 ms) notices
    with pytest.raises(LockedError, match="lost its writer lock.*node-other"):
        store.save(2, {"w": torch.ones(2)})
    assert store.latest_step() == 1
    store.close()
    assert "node-other" in (tmp_path / LOCK_NAME).read_text()  # not ours to remove


def test_the_lock_is_renewed(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path), lease_s=0.2) as store:
        info = store.acquire()
        assert info is not None
        time.sleep(0.5)
        now = LockInfo.from_json((tmp_path / LOCK_NAME).read_bytes())
        assert now.token == info.token and now.renewed > info.renewed


def test_cli_shows_and_breaks_the_lock(tmp_path: Path, capsys: Any) -> None:
    crafted(tmp_path / "ckpt", job_id="77")
    assert cli(["lock", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "node-other pid 4321, SLURM job 77" in out and "held by a live writer" in out
    assert cli(["prune", str(tmp_path / "ckpt"), "--keep-last", "1"]) == 1  # nothing to prune
    assert cli(["lock", str(tmp_path / "ckpt"), "--break"]) == 0
    assert "removed" in capsys.readouterr().out and not (tmp_path / "ckpt" / LOCK_NAME).exists()
    assert cli(["lock", str(tmp_path / "ckpt")]) == 0 and "not locked" in capsys.readouterr().out


def test_cli_lock_of_what_is_no_experiment_says_so(tmp_path: Path, capsys: Any) -> None:
    """A missing path, a file, a root of experiments: one line naming it and exit 1, never
    "not locked" (which reads as "safe to start")."""
    (tmp_path / "file").write_text("x")
    with CheckpointStore(str(tmp_path / "root"), experiment="run1") as store:
        store.save(1, {"w": torch.ones(1)})
    for url, said in [
        (tmp_path / "missing", "does not exist: no experiment there, nothing to lock"),
        (tmp_path / "file", "is a file, not an experiment folder"),
        (tmp_path / "root", f"name one, e.g. ckptstore lock {tmp_path / 'root' / 'run1'}"),
    ]:
        for extra in ([], ["--break"]):
            assert cli(["lock", str(url), *extra]) == 1
            out, err = capsys.readouterr()
            assert out == "" and said in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "missing").exists()
    assert cli(["lock", str(tmp_path / "root" / "run1")]) == 0
    assert "not locked" in capsys.readouterr().out


def test_cli_prune_is_refused_while_a_trainer_writes(tmp_path: Path, capsys: Any) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        for step in (1, 2, 3):
            store.save(step, {"w": torch.ones(2)})
        assert cli(["prune", str(tmp_path), "--keep-last", "1"]) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"pid {os.getpid()}" in err
        assert store.steps() == [1, 2, 3]
    assert cli(["prune", str(tmp_path), "--keep-last", "1"]) == 0


def test_a_successor_takes_over_its_chain_a_live_other_chain_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A lock from another node renewed just now (its job was killed at the limit): the next
    link of its chain takes it at once; a job of another chain is refused in one line."""
    crafted(tmp_path / "a", **LINK0)
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURMCLOCK_CHAIN_ID", "9")
    monkeypatch.setenv("SLURMCLOCK_CHAIN_INDEX", "1")
    with pytest.raises(LockedError, match="SLURM job 7 .link 0 of chain 7.") as refused:
        CheckpointStore(str(tmp_path / "a")).acquire()
    assert "\n" not in str(refused.value)
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    monkeypatch.setenv("SLURMCLOCK_CHAIN_ID", "7")
    with CheckpointStore(str(tmp_path / "a")) as store:
        assert store.acquire() is not None and store.writer is not None
        assert (store.writer.chain, store.writer.link) == ("7", 1)
    assert "link 0 (SLURM job 7) of this run's chain 7" in caplog.text


def test_whoami_names_the_slurm_job() -> None:
    me = whoami(5.0, 60.0, {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "3"})
    assert (me.job_id, me.job_step, me.host, me.pid) == ("12", "3", HOST, os.getpid())
    assert "SLURM job 12 step 3" in me.describe(5.0)
    env = {"SLURM_JOB_ID": "12", "SLURMCLOCK_CHAIN_ID": "10", "SLURMCLOCK_CHAIN_INDEX": "2"}
    assert (whoami(5.0, 60.0, env).chain, whoami(5.0, 60.0, env).link) == ("10", 2)
    assert whoami(5.0, 60.0, {**env, "SLURMCLOCK_CHAIN_INDEX": "x"}).link == 0


@pytest.mark.s3
@pytest.mark.slow
def test_close_is_not_held_up_by_a_hanging_endpoint(moto: Any) -> None:
    from ckpt_helpers import s3server

    from ckptstore.lock import RELEASE_TIMEOUT_S

    with s3server.MotoServer() as server:
        server.make_bucket("hang")
        store = CheckpointStore("s3://hang/run", storage_options=server.storage_options())
        store.acquire()
        server.pause()  # SIGSTOP: connections hang, nothing answers
        try:
            t0 = time.monotonic()
            store.close()
            took = time.monotonic() - t0
        finally:
            server.resume()
    assert took < 2 * RELEASE_TIMEOUT_S + 5, took


def test_a_lock_removed_under_a_live_writer_is_created_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cleanup script removes the experiment folder (lock included) between two saves: the
    writer is still the only one, so it re-creates the lock and goes on saving."""
    with CheckpointStore(str(tmp_path / "exp")) as store:
        info = store.acquire()
        store.save(1, {"w": torch.ones(2)})
        shutil.rmtree(tmp_path / "exp")
        with caplog.at_level("WARNING", logger="ckptstore"):
            store.save(2, {"w": torch.ones(2)})
        assert "was removed while this run held it" in caplog.text
        assert store.steps() == [2]
        now = LockInfo.from_json((tmp_path / "exp" / LOCK_NAME).read_bytes())
        assert info is not None and now.token == info.token
        # and another run is refused, as before
        with pytest.raises(LockedError, match="being written by another run"):
            CheckpointStore(str(tmp_path / "exp")).acquire()
    assert not (tmp_path / "exp" / LOCK_NAME).exists()  # released at close


def test_a_lock_taken_by_another_run_after_removal_stops_this_one(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), lease_s=3600)  # no renewal in between: the save checks
    store.save(1, {"w": torch.ones(2)})
    (tmp_path / LOCK_NAME).unlink()
    crafted(tmp_path)  # another node's run started meanwhile
    with pytest.raises(LockedError, match="lost its writer lock.*node-other"):
        store.save(2, {"w": torch.ones(2)})
    store.close()
    assert store.steps() == [1]
