"""SIGKILL a saving process anywhere: the next load returns the previous or the new checkpoint,
bitwise, never an error or a partial state."""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from ckpt_crash_child import POINTS
from ckpt_helpers import FORMATS, assert_same_state, blank_state, make_state

from ckptstore import CheckpointStore

BIG = 3_000_000  # 12 MB: the child writes it in 4 MiB pieces, so a kill lands mid-file


@pytest.fixture(scope="module")
def forkserver() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "ckptstore",
            "ckptstore.formats.torchfile",
            "ckptstore.formats.dcp",
            "ckpt_helpers",
            "ckpt_crash_child",
        ]
    )
    return ctx


def run_and_kill(
    ctx: Any,
    url: str,
    fmt: str,
    signal_dir: Path,
    *,
    pause_at: str = "",
    blocking: bool = True,
    delay: float | None = None,
    opts: dict[str, Any] | None = None,
) -> None:
    import ckpt_crash_child

    signal_dir.mkdir()
    args = (url, fmt, pause_at, blocking, BIG, str(signal_dir), opts or {}, delay is not None)
    proc = ctx.Process(target=ckpt_crash_child.saver, args=args, daemon=True)
    proc.start()
    try:
        wanted = signal_dir / (pause_at or "saved-1")
        deadline = time.monotonic() + 120
        while not wanted.exists():
            assert proc.is_alive(), f"child died (exit {proc.exitcode}) before {wanted.name}"
            assert not (signal_dir / "finished").exists(), f"child never reached {pause_at}"
            assert time.monotonic() < deadline, f"child did not reach {wanted.name} in 120 s"
            time.sleep(0.01)
        if delay:
            time.sleep(delay)
    finally:
        proc.kill()
        proc.join(30)
    assert proc.exitcode == -9


def check_recovers(url: str, fmt: str, opts: dict[str, Any] | None = None) -> int:
    with CheckpointStore(url, format=fmt, storage_options=opts or {}) as store:
        committed = [c.step for c in store.list()]
        for s in committed:
            assert store.verify(s).ok, f"committed step {s} does not verify"
        loaded = blank_state(big=BIG)
        manifest = store.load(loaded)
        assert manifest.step in committed
        assert_same_state(make_state(manifest.step, big=BIG), loaded)
        # and the store keeps working in that directory: a new save of the same step commits
        store.save(manifest.step + 1, make_state(manifest.step + 1))
        again = blank_state()
        assert store.load(again).step == manifest.step + 1
        assert_same_state(make_state(manifest.step + 1), again)
    if "://" not in url:  # and that commit cleaned up what the killed save left
        assert leftovers(Path(url)) == []
    return manifest.step


def leftovers(root: Path) -> list[str]:
    """Temp files, and step folders without a manifest."""
    out = [str(p.relative_to(root)) for p in root.rglob("*.tmp-*")]
    return out + [p.name for p in root.glob("step-*") if not (p / "manifest.json").exists()]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("point", POINTS)
def test_kill_at_each_point_of_the_commit_protocol(
    forkserver: Any, tmp_path: Path, fmt: str, point: str
) -> None:
    url = str(tmp_path / "ckpt")
    run_and_kill(forkserver, url, fmt, tmp_path / "sig", pause_at=point)
    step = check_recovers(url, fmt)
    # Before the manifest is committed only step 1 exists. After, step 2 is committed, also
    # when the kill came before the `latest` pointer moved: the manifest is the commit.
    assert step == (1 if POINTS.index(point) < POINTS.index("manifest-written") else 2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("blocking", [True, False], ids=["sync", "async"])
def test_kill_at_random_times(forkserver: Any, tmp_path: Path, fmt: str, blocking: bool) -> None:
    rnd = random.Random(f"{fmt}{blocking}{os.getpid()}")
    for i in range(1):
        url = str(tmp_path / f"ckpt{i}")
        run_and_kill(
            forkserver,
            url,
            fmt,
            tmp_path / f"sig{i}",
            blocking=blocking,
            delay=rnd.uniform(0.0, 0.8),
        )
        check_recovers(url, fmt)


@pytest.mark.s3
@pytest.mark.parametrize("point", ["payload-partial", "payload-written", "manifest-written"])
def test_kill_during_an_s3_save(forkserver: Any, moto: Any, tmp_path: Path, point: str) -> None:
    url = f"s3://ckpt/crash-{point}-{os.getpid()}"
    opts = moto.storage_options()
    run_and_kill(forkserver, url, "torch", tmp_path / "sig", pause_at=point, opts=opts)
    step = check_recovers(url, "torch", opts)
    assert step == (1 if point != "manifest-written" else step)


def test_a_commit_sweeps_what_interrupted_saves_and_prunes_left(tmp_path: Path) -> None:
    """A kill inside a prune (manifest gone, payload not) or inside a save leaves folders that
    are not checkpoints; the next commit removes our files there, never a foreign one, and never
    a newer folder (a save that may still be running)."""
    root = tmp_path / "ckpt"
    with CheckpointStore(str(root)) as store:
        for step in (1, 2, 3):
            store.save(step, make_state(step))
    half_pruned = root / "step-00000001"
    (half_pruned / "manifest.json").unlink()
    half_saved = root / "step-00000000"
    half_saved.mkdir()
    (half_saved / "state.0123abcd00001.ckpt.tmp-0a1b2c3d4e5f").write_bytes(b"partial")
    foreign = root / "step-00000002b"  # not a name the store writes: not ours, not a step
    foreign.mkdir()
    with_foreign = root / "step-00000001x"
    newer = root / "step-00000009"
    newer.mkdir()
    (newer / "state.0123abcd00002.ckpt.tmp-0a1b2c3d4e5f").write_bytes(b"partial")
    users = tmp_path / "users"
    users.mkdir()

    with CheckpointStore(str(root)) as store:
        assert [c.step for c in store.list()] == [2, 3]
        store.save(4, make_state(4))
        assert [c.step for c in store.list()] == [2, 3, 4]
        assert store.verify(2).ok and store.verify(3).ok
    assert not half_pruned.exists() and not half_saved.exists()
    assert foreign.exists() and not with_foreign.exists()
    assert len(list(newer.iterdir())) == 1


def test_the_sweep_keeps_a_foreign_file_and_its_folder(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with CheckpointStore(str(root)) as store:
        store.save(2, make_state(2))
        d = root / "step-00000001"
        d.mkdir()
        (d / "state.0123abcd00001.ckpt").write_bytes(b"ours, half written")
        (d / "notes.txt").write_text("the user's")
        store.save(3, make_state(3))
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]
