"""Mirror: every committed checkpoint is copied (verified) to a second URL in the background,
with its own commit marker; load restores from it when the primary is missing or corrupt."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import assert_same_state, blank_state, corrupt, fs_for, make_state

from ckptstore import CheckpointStore, CheckpointWarning, MirrorError, check_mirror


@pytest.fixture(params=["memory", "s3"])
def mirror(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    tag = uuid.uuid4().hex[:8]
    if request.param == "memory":
        return f"memory://mirror-{tag}", {}
    server = request.getfixturevalue("moto")
    return f"s3://ckpt/mirror-{tag}", server.storage_options()


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_mirror_receives_each_commit_and_restores(
    tmp_path: Path, mirror: tuple[str, dict[str, Any]], fmt: str
) -> None:
    murl, mopts = mirror
    primary = str(tmp_path / "primary")
    store = CheckpointStore(
        primary, format=fmt, mirror=murl, mirror_storage_options=mopts, keep_last=2
    )
    for step in (1, 2, 3):
        store.save(step, make_state(step), blocking=step != 2)
    store.wait_mirror()
    stats = store.saves_completed()
    assert {(s.step, s.target) for s in stats} >= {(1, "primary"), (3, "primary"), (3, "mirror")}
    assert all(s.url.startswith(("s3://", "memory://")) for s in stats if s.target == "mirror")
    mfs, mpath = fs_for(murl, mopts)
    assert mfs.cat_file(f"{mpath}/latest").strip() == b"step-00000003"
    with CheckpointStore(murl, format=fmt, storage_options=mopts) as m:
        assert m.steps()[-1] == 3 and len(m.steps()) <= 2  # retention applies there too
        assert m.verify(3).ok

    # primary copy corrupt: the same step comes from the mirror
    corrupt(f"{primary}/step-00000003", {}, "flip")
    loaded = blank_state()
    with pytest.warns(CheckpointWarning, match="checksum mismatch.*mirror"):
        assert store.load(loaded).step == 3
    assert_same_state(make_state(3), loaded)
    store.close()

    # primary gone altogether (node-local disk wiped): the mirror still restores
    shutil.rmtree(primary)
    with CheckpointStore(primary, format=fmt, mirror=murl, mirror_storage_options=mopts) as again:
        loaded = blank_state()
        assert again.load(loaded).step == 3
        assert_same_state(make_state(3), loaded)


def test_mirror_failure_is_reported_not_fatal(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    store = CheckpointStore(str(tmp_path / "p"), mirror=str(blocker / "m"))
    blocker.write_text("a file where the mirror root should be")  # after the start's checks
    with pytest.warns(CheckpointWarning, match="mirroring step 1"):
        store.save(1, make_state(1))
        with pytest.raises(MirrorError, match="primary copy is fine"):
            store.wait_mirror()
    assert store.verify(1).ok
    loaded = blank_state()
    assert store.load(loaded).step == 1
    with pytest.warns(CheckpointWarning), pytest.raises(MirrorError):
        store.save(2, make_state(2))
        store.close()  # close() reports the mirror failure too


def mirror_steps(murl: str, mopts: dict[str, Any]) -> list[str]:
    mfs, mpath = fs_for(murl, mopts)
    mfs.invalidate_cache(mpath)
    return sorted(p.rsplit("/", 1)[-1] for p in mfs.ls(mpath, detail=False) if "step-" in p)


def test_resume_from_the_mirror_when_the_primary_is_gone(
    tmp_path: Path, mirror: tuple[str, dict[str, Any]]
) -> None:
    """latest / latest_step() / manifest("latest") / load("latest") find the mirror's newest
    checkpoint, and the resumed run's new steps never overwrite the mirror's."""
    murl, mopts = mirror
    primary = str(tmp_path / "primary")
    with CheckpointStore(primary, mirror=murl, mirror_storage_options=mopts) as store:
        for step in (1, 2, 3):
            store.save(step, make_state(step))
            store.wait_mirror()  # each one (a mirror that falls behind copies the newest only)
    mfs, mpath = fs_for(murl, mopts)
    committed_3 = mfs.cat_file(f"{mpath}/step-00000003/manifest.json")
    shutil.rmtree(primary)  # the node-local disk is gone
    with CheckpointStore(primary, mirror=murl, mirror_storage_options=mopts) as store:
        assert store.latest_step() == 3 and store.manifest("latest").step == 3
        loaded = blank_state()
        assert store.load(loaded).step == 3
        assert_same_state(make_state(3), loaded)
        store.save(4, make_state(4))
        store.wait_mirror()
        assert store.latest_step() == 4 and store.steps() == [4]
    assert mirror_steps(murl, mopts) == [f"step-{s:08d}" for s in (1, 2, 3, 4)]
    assert mfs.cat_file(f"{mpath}/step-00000003/manifest.json") == committed_3


def test_the_newest_commit_wins_across_primary_and_mirror(
    tmp_path: Path, mirror: tuple[str, dict[str, Any]]
) -> None:
    murl, mopts = mirror
    primary = tmp_path / "primary"
    with CheckpointStore(str(primary), mirror=murl, mirror_storage_options=mopts) as store:
        for step in (1, 2, 3):
            store.save(step, make_state(step))
            store.wait_mirror()
    shutil.rmtree(primary / "step-00000003")  # the primary lost its newest checkpoint only
    (primary / "latest").write_text("step-00000002\n")
    with CheckpointStore(str(primary), mirror=murl, mirror_storage_options=mopts) as store:
        assert store.latest_step() == 3
        loaded = blank_state()
        assert store.load(loaded).step == 3
        assert_same_state(make_state(3), loaded)
        corrupt(f"{murl}/step-00000003", mopts, "flip")  # and a corrupt newest falls back
        with pytest.warns(CheckpointWarning, match="checksum mismatch.*trying step 2"):
            assert store.load(blank_state()).step == 2


@pytest.mark.s3
def test_an_unreachable_mirror_does_not_stop_a_resume(tmp_path: Path, moto: Any) -> None:
    dead = {
        **moto.storage_options(),
        "endpoint_url": "http://127.0.0.1:9",  # nothing listens there
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
    }
    with CheckpointStore(str(tmp_path / "p")) as store:
        store.save(1, make_state(1))
    with CheckpointStore(
        str(tmp_path / "p"), mirror="s3://ckpt/dead", mirror_storage_options=dead
    ) as store:
        with pytest.warns(CheckpointWarning, match="mirror s3://ckpt/dead unreachable"):
            assert store.latest_step() == 1
        with pytest.warns(CheckpointWarning, match="unreachable, using the primary alone"):
            assert store.load(blank_state()).step == 1


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("p", "is the checkpoint location itself: give a second location"),
        ("p/m", "is inside the experiment's own folder"),
        (".", "is around the experiment's own folder"),
        ("link", "is the checkpoint location itself"),  # the same folder through a link
    ],
)
def test_a_mirror_in_the_same_failure_domain_is_refused(
    tmp_path: Path, where: str, said: str
) -> None:
    """Issue 30: a mirror inside the primary experiment was accepted; what loses one copy
    loses both. Refused before anything is written."""
    (tmp_path / "link").symlink_to(tmp_path / "p")
    mirror = str(tmp_path / where)
    with pytest.raises(ValueError, match=said):
        check_mirror(str(tmp_path / "p"), mirror)
    with pytest.raises(ValueError, match=said):
        CheckpointStore(str(tmp_path / "p"), mirror=mirror)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]


def test_a_mirror_that_cannot_be_written_is_refused_at_start(tmp_path: Path, moto: Any) -> None:
    """It was accepted, and the run ended exit 0 with nothing ever mirrored."""
    (tmp_path / "afile").write_text("x")
    for mirror, said in (
        (tmp_path / "afile" / "m", "is a file, not a folder"),
        (Path("/proc/1/m"), "/proc/1 cannot be written by this user"),
    ):
        with pytest.raises(ValueError, match=said):
            CheckpointStore(str(tmp_path / "p"), mirror=str(mirror))
    opts = moto.storage_options()
    store = CheckpointStore(
        str(tmp_path / "p"), mirror="s3://nosuchbucket/m", mirror_storage_options=opts
    )
    with pytest.raises(
        MirrorError,
        match=r"the mirror s3://nosuchbucket/m cannot be written .*"
        r"does not exist: create it first.*: fix it, or drop the mirror",
    ):
        store.acquire()
    store.close()
    assert not (tmp_path / "p").exists()  # nothing was written
