"""The contract every format keeps on every storage: one suite, format x storage. The storages
are every built-in backend (local and file:// -> LocalStorage, memory:// -> the generic fsspec
one, s3:// on moto_server -> S3Storage) and a third-party one found through its entry point."""

from __future__ import annotations

from typing import Any

import fsspec
import pytest
import torch
from ckpt_helpers import (
    FORMATS,
    STORAGES,
    assert_same_state,
    blank_state,
    corrupt,
    fs_for,
    make_state,
)
from ckpt_plugin import FolderStorage

from ckptstore import (
    CheckpointStore,
    CheckpointWarning,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    NoCheckpointError,
)

pytestmark = [
    pytest.mark.parametrize("fmt", FORMATS),
    pytest.mark.parametrize("storage", STORAGES, indirect=True),
]


def open_store(storage: tuple[str, dict[str, Any]], fmt: str, **kw: Any) -> CheckpointStore:
    url, opts = storage
    return CheckpointStore(url, format=fmt, storage_options=opts, **kw)


def test_round_trip_is_bitwise_and_in_place(storage: Any, fmt: str) -> None:
    with open_store(storage, fmt) as store:
        saved = make_state(7)
        stats = store.save(7, saved, metadata={"val_loss": 0.25}).result()
        assert stats.step == 7 and stats.bytes > 0 and stats.url.endswith("step-00000007")
        loaded = blank_state()
        model, buf = loaded["model"], loaded["buf"]
        manifest = store.load(loaded)
        assert manifest.step == 7 and manifest.metadata == {"val_loss": 0.25}
        assert manifest.format == fmt and manifest.world_size == 1
        assert loaded["model"] is model and loaded["buf"] is buf  # restored in place
        assert loaded["step"] == 7  # plain values are replaced in the dict
        assert_same_state(saved, loaded)
        assert loaded["model"].head.weight.data_ptr() == loaded["model"].emb.weight.data_ptr()
        assert [s.step for s in store.saves_completed()] == [7]
        assert store.saves_completed() == []


def test_steps_sort_numerically_and_latest_is_the_newest(storage: Any, fmt: str) -> None:
    with open_store(storage, fmt) as store:
        for step in (9000, 10000, 10):
            store.save(step, {"step": step, "w": torch.full((3,), float(step))})
        # the pointer follows the last save: 10 (a resume from an older checkpoint)
        assert store.latest_step() == 10
        store.save(10000, {"step": 10000, "w": torch.full((3,), 10000.0)})
        assert [c.step for c in store.list()] == [10, 9000, 10000]
        assert store.latest_step() == 10000
        state: dict[str, Any] = {"step": None, "w": torch.zeros(3)}
        assert store.load(state).step == 10000 and state["step"] == 10000
        assert store.load(state, step=9000).step == 9000 and float(state["w"][0]) == 9000.0
        assert store.load(state, step="step-00000010").step == 10


def test_async_save_snapshots_before_returning(storage: Any, fmt: str) -> None:
    with open_store(storage, fmt) as store:
        state = make_state(3)
        expected = make_state(3)
        handle = store.save(3, state, blocking=False)
        with torch.no_grad():  # the caller keeps training right away
            for p in state["model"].parameters():
                p.add_(1000.0)
            state["buf"].fill_(-1)
        state["step"] = 99
        stats = handle.result()
        assert handle.done() and stats.step == 3 and stats.total_s >= handle.blocking_s
        loaded = blank_state()
        store.load(loaded)
        assert_same_state(expected, loaded)


def test_verify_and_load_detect_corruption_and_fall_back(storage: Any, fmt: str) -> None:
    url, opts = storage
    with open_store(storage, fmt) as store:
        store.save(1, make_state(1))
        store.save(2, make_state(2))
        assert store.verify().ok and store.verify(1).ok
        bad = corrupt(f"{url}/step-00000002", opts, "flip")
        report = store.verify(2)
        assert not report.ok and bad in report.summary() and "checksum mismatch" in report.summary()
        loaded = blank_state()
        with pytest.warns(CheckpointWarning, match=r"step-00000002.*checksum mismatch"):
            manifest = store.load(loaded)
        assert manifest.step == 1
        assert_same_state(make_state(1), loaded)
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            store.load(blank_state(), step=2)  # an explicit step does not fall back


def test_truncated_and_missing_files_are_detected(storage: Any, fmt: str) -> None:
    url, opts = storage
    with open_store(storage, fmt) as store:
        store.save(1, make_state(1))
        store.save(2, make_state(2))
        store.save(3, make_state(3))
        corrupt(f"{url}/step-00000003", opts, "truncate")
        corrupt(f"{url}/step-00000002", opts, "delete")
        assert "truncated" in store.verify(3).summary()
        assert "missing" in store.verify(2).summary()
        with pytest.warns(CheckpointWarning) as rec:
            assert store.load(blank_state()).step == 1
        text = " ".join(str(w.message) for w in rec)
        assert "truncated" in text and "missing" in text


def test_nothing_loadable_raises(storage: Any, fmt: str) -> None:
    url, opts = storage
    with open_store(storage, fmt) as store:
        with pytest.raises(NoCheckpointError, match="no checkpoint"):
            store.load(blank_state())
        assert store.latest_step() is None and store.list() == []
        store.save(1, make_state(1))
        corrupt(f"{url}/step-00000001", opts, "flip")
        with pytest.warns(CheckpointWarning), pytest.raises(NoCheckpointError, match="mismatch"):
            store.load(blank_state())
        with pytest.raises(NoCheckpointError, match="step 5"):
            store.load(blank_state(), step=5)


def test_a_directory_without_manifest_is_not_a_checkpoint(storage: Any, fmt: str) -> None:
    url, opts = storage
    with open_store(storage, fmt) as store:
        store.save(1, make_state(1))
        store.save(2, make_state(2))
        fs, path = fs_for(url, opts)
        fs.rm_file(f"{path}/step-00000002/manifest.json")
        assert [c.step for c in store.list()] == [1]
        assert store.load(blank_state()).step == 1


def test_strict_keys_and_shapes(storage: Any, fmt: str) -> None:
    with open_store(storage, fmt) as store:
        store.save(1, {"model": torch.nn.Linear(3, 2), "step": 1})
        with pytest.raises(IncompatibleCheckpointError, match="optim"):
            store.load({"model": torch.nn.Linear(3, 2), "optim": {}})
        partial: dict[str, Any] = {"model": torch.nn.Linear(3, 2), "optim": "untouched"}
        with pytest.warns(CheckpointWarning, match="optim"):
            store.load(partial, strict=False)
        assert partial["optim"] == "untouched"
        only_model = {"model": torch.nn.Linear(3, 2)}
        assert store.load(only_model).step == 1  # extra checkpoint keys are fine
        with pytest.raises(IncompatibleCheckpointError, match="size mismatch"):
            store.load({"model": torch.nn.Linear(4, 2)})


def test_retention_keeps_newest_and_foreign_files(storage: Any, fmt: str) -> None:
    url, opts = storage
    fs, path = fs_for(url, opts)
    fs.makedirs(f"{path}/notes", exist_ok=True)
    fs.pipe_file(f"{path}/notes/README", b"mine")
    fs.pipe_file(f"{path}/step-notanumber", b"also mine")
    with open_store(storage, fmt, keep_last=2, keep_every=4) as store:
        for step in range(1, 8):
            store.save(step, {"w": torch.full((2,), float(step))})
        assert [c.step for c in store.list()] == [4, 6, 7]
    assert fs.cat_file(f"{path}/notes/README") == b"mine"
    assert fs.cat_file(f"{path}/step-notanumber") == b"also mine"


def test_experiment_subdirectory_and_names_cannot_escape(storage: Any, fmt: str) -> None:
    url, opts = storage
    with open_store(storage, fmt, experiment="runA") as store:
        store.save(3, {"x": torch.ones(2)})
        assert store.url.endswith("runA")
    fs, path = fs_for(url, opts)
    assert fs.exists(f"{path}/runA/step-00000003/manifest.json")
    for bad in ("../escape", "a/../../b", "/abs", "", "."):
        with pytest.raises(ValueError, match="experiment"):
            open_store(storage, fmt, experiment=bad)
    with open_store(storage, fmt) as store, pytest.raises(ValueError, match="step"):
        store.save(-1, {"x": torch.ones(1)})


def test_inspect_describes_tensors(storage: Any, fmt: str) -> None:
    with open_store(storage, fmt) as store:
        store.save(5, make_state(5), metadata={"args": {"lr": 0.1}})
        info = store.inspect()
        assert info["step"] == 5 and info["metadata"] == {"args": {"lr": 0.1}}
        shapes = {t["key"]: (t["dtype"], list(t["shape"])) for t in info["tensors"]}
        assert shapes["model.body.weight"] == ("float32", [16, 16])
        assert shapes["model.norm.num_batches_tracked"] == ("int64", [])
        assert "model.head.weight" not in shapes  # tied to emb.weight: stored once
        assert info["types"]["model"].endswith("TinyNet")


def test_memory_storage_really_is_used(storage: Any, fmt: str) -> None:
    url, opts = storage
    with open_store(storage, fmt) as store:
        store.save(1, {"x": torch.ones(4)})
    fs, path = fs_for(url, opts)
    names = fs.ls(f"{path}/step-00000001", detail=False)
    assert any(n.endswith("manifest.json") for n in names)
    if url.startswith("memory://"):
        assert fsspec.filesystem("memory").exists(f"{path}/latest")
    if url.startswith("folder://"):  # the third-party backend, found through its entry point
        assert FolderStorage.opened and all(u.startswith("folder://") for u in FolderStorage.opened)


def test_plain_tensors_come_back_usable(storage: Any, fmt: str) -> None:
    """Loaded RNG states feed torch.set_rng_state (which ignores a view's storage offset)."""
    with open_store(storage, fmt) as store:
        torch.manual_seed(5)
        store.save(1, {"pad": torch.ones(1000), "rng": {"torch": torch.get_rng_state()}})
        expected = torch.rand(3)
        state: dict[str, Any] = {"pad": torch.zeros(1000), "rng": None}
        store.load(state)
        torch.set_rng_state(state["rng"]["torch"])
        assert torch.equal(torch.rand(3), expected)


def test_load_from_the_path_of_a_checkpoint_directory(storage: Any, fmt: str) -> None:
    """``step=`` a path/URL of a step directory (another run, a copied checkpoint): verified
    like any other; a corrupt one raises instead of silently falling back elsewhere."""
    url, opts = storage
    with open_store(storage, fmt) as source:
        source.save(1, make_state(1))
        source.save(2, make_state(2))
    with open_store(storage, fmt, experiment="other") as store:
        loaded = blank_state()
        assert store.load(loaded, step=f"{url}/step-00000001").step == 1
        assert_same_state(make_state(1), loaded)
        corrupt(f"{url}/step-00000002", opts, "flip")
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            store.load(blank_state(), step=f"{url}/step-00000002")
        with pytest.raises(NoCheckpointError, match="no such checkpoint"):
            store.load(blank_state(), step=f"{url}/step-00000009")
        assert store.list() == []  # nothing was written to this store
