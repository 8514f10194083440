"""The small files another process writes -- a step's manifest, the writer lock, the
``latest`` pointer -- read as untrusted input (issue 34): every fault at every file is a
classified error or a named problem, never a hang (a FIFO), never gigabytes read (/dev/zero, a
huge sparse file). Generated from the table: a new fault or a new file is one row."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore, LockedError
from ckptstore.lock import LOCK_NAME, break_lock
from ckptstore.smallfile import MAX_SMALL_BYTES, UnreadableFileError, read_small_file

FILES = {
    "manifest": "step-00000002/manifest.json",
    "lock": LOCK_NAME,
    "latest": "latest",
}


def _replace(path: Path, make: Callable[[Path], None]) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    make(path)


def _sparse(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(MAX_SMALL_BYTES + 3 * 1024**3)  # a few GB that take no disk


def _truncated(path: Path) -> None:
    text = path.read_bytes() if path.exists() else b'{"token": "t", "host": "h", "pid": 1}'
    _replace(path, lambda p: p.write_bytes(text[: max(1, len(text) // 2)]))


# fault -> how the file is damaged (a FIFO is refused before open, so no writer is needed)
FAULTS: dict[str, Callable[[Path], None]] = {
    "fifo": lambda p: _replace(p, lambda q: os.mkfifo(q)),
    "dev-zero": lambda p: _replace(p, lambda q: q.symlink_to("/dev/zero")),
    "huge-sparse": lambda p: _replace(p, _sparse),
    "garbage": lambda p: _replace(p, lambda q: q.write_bytes(b"\xff\xfe\x00garbage\x1b[31m\n" * 9)),
    "truncated-json": _truncated,
    "deep-nesting": lambda p: _replace(p, lambda q: q.write_bytes(b"[" * 200_000 + b"]" * 200_000)),
}


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    """Steps 1 and 2 saved; ``latest`` names step 2; a writer lock as a live writer leaves."""
    root = tmp_path / "ckpt"
    with CheckpointStore(str(root), lock=False) as store:
        for step in (1, 2):
            store.save(step, {"w": torch.full((4,), float(step))})
    (root / LOCK_NAME).write_bytes(b'{"token": "t", "host": "h", "pid": 1}')
    return root


def _expect_manifest(root: Path, fault: str) -> None:
    with CheckpointStore(str(root), lock=False) as store:
        scan = store.scan()
        assert list(scan.broken) == [2] and scan.head == 1, (fault, scan)
        assert "manifest" in scan.broken[2] or "not read" in scan.broken[2]
        got = store.load({"w": torch.zeros(4)})  # falls back to the step that stands
    assert got.step == 1


def _expect_lock(root: Path, fault: str) -> None:
    bad_lock = pytest.raises(LockedError, match=f"{LOCK_NAME} is not a valid writer lock")
    with CheckpointStore(str(root)) as store, bad_lock:
        store.acquire()


def _expect_latest(root: Path, fault: str) -> None:
    with CheckpointStore(str(root), lock=False) as store:
        scan = store.scan()
        assert scan.pointer is None and scan.pointer_problem, (fault, scan)
        assert "latest" in scan.pointer_problem and store.latest_step() == 2


EXPECT = {"manifest": _expect_manifest, "lock": _expect_lock, "latest": _expect_latest}


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:ckptstore. skipped")  # the fallback past a broken manifest
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("which", FILES)
def test_every_fault_at_every_file(store_root: Path, which: str, fault: str) -> None:
    FAULTS[fault](store_root / FILES[which])
    EXPECT[which](store_root, fault)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: os.mkfifo(p), "is a FIFO"),
        (lambda p: p.symlink_to("/dev/zero"), "is a device"),
        (_sparse, "bytes, more than"),
    ],
)
def test_the_reader_names_what_it_refused(
    tmp_path: Path, make: Callable[[Path], None], words: str
) -> None:
    path = tmp_path / "f"
    make(path)
    with pytest.raises(UnreadableFileError, match=words):
        read_small_file(str(path))
    with pytest.raises(FileNotFoundError):
        read_small_file(str(tmp_path / "absent"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError):  # as open() says it: callers word a folder
        read_small_file(str(tmp_path / "folder"))
    assert read_small_file(__file__) == Path(__file__).read_bytes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", FAULTS)
def test_break_removes_a_lock_whatever_it_is(store_root: Path, fault: str) -> None:
    FAULTS[fault](store_root / LOCK_NAME)
    with CheckpointStore(str(store_root), lock=False) as store:
        assert break_lock(store.primary.storage, store.primary.root)
    assert not os.path.lexists(store_root / LOCK_NAME)


def test_an_object_store_refuses_a_huge_small_file_before_downloading_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On an object store the size is asked first: an object of gigabytes at a manifest's,
    the lock's or ``latest``'s key is refused by its size, never read (here: a lowered limit
    on fsspec's in-memory filesystem, the same code path as s3fs)."""
    from ckptstore.storage.remote import FsspecStorage

    storage = FsspecStorage.from_url("memory://huge-small/run", {})
    assert isinstance(storage, FsspecStorage)
    monkeypatch.setattr(FsspecStorage, "small_limit", 1000)
    fetched: list[str] = []
    storage.fs.pipe_file("/huge-small/run/latest", b"x" * 1001)
    storage.fs.pipe_file("/huge-small/run/ok", b"y" * 1000)
    real_cat = storage.fs.cat_file
    monkeypatch.setattr(storage.fs, "cat_file", lambda p, **kw: fetched.append(p) or real_cat(p))
    with pytest.raises(UnreadableFileError, match="1001 bytes, more than the 1000"):
        storage.read_small("/huge-small/run/latest")
    assert fetched == []  # refused by its size, not downloaded
    assert storage.read_small("/huge-small/run/ok") == b"y" * 1000
    with pytest.raises(FileNotFoundError):
        storage.read_small("/huge-small/run/absent")
