"""Where an experiment lives and what names are valid there (DESIGN.md, "ckptstore"), step
specs, a root holding several experiments (issue 17), and the save schedule's facts."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import (
    CheckpointStore,
    StepSpec,
    experiment_location,
    register_format,
    validate_experiment_name,
)
from ckptstore.cli import main as cli
from ckptstore.formats import SaveContext
from ckptstore.formats.torchfile import TorchFormat
from ckptstore.layout import split_step_url


@pytest.mark.parametrize("name", ["run1", "team/run-1.b", "A_9", "x" * 128])
def test_valid_experiment_names(name: str) -> None:
    assert validate_experiment_name(name) == name


@pytest.mark.parametrize("name", ["", ".", "../up", "a//b", "/abs", "-x", "a b", "x" * 129])
def test_invalid_experiment_names_say_the_rule(name: str) -> None:
    with pytest.raises(ValueError) as info:
        validate_experiment_name(name)
    msg = str(info.value)
    assert "\n" not in msg and "letters, digits" in msg and repr(name) in msg


def test_experiment_location_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    where = experiment_location("~/ckpt", "exp")
    assert where.url == where.local_path == str(tmp_path / "ckpt" / "exp")
    assert experiment_location("file://~/ckpt").local_path == str(tmp_path / "ckpt")
    with CheckpointStore("~/ckpt", experiment="exp") as store:
        assert store.location == where and store.local_path == str(tmp_path / "ckpt" / "exp")
        store.save(1, {"w": torch.ones(2)})
    assert (tmp_path / "ckpt" / "exp" / "step-00000001" / "manifest.json").exists()
    assert not Path("~").exists()


def test_object_store_locations_have_no_local_folder() -> None:
    where = experiment_location("memory://bucket/runs", "exp")
    assert where.url.startswith("memory://") and where.url.endswith("/bucket/runs/exp")
    assert where.local_path is None
    with pytest.raises(ValueError, match="not a valid name"):
        experiment_location("memory://bucket/runs", "../x")


@pytest.mark.parametrize(
    "spec, step, path",
    [
        ("latest", None, None),
        (42, 42, None),
        ("42", 42, None),
        ("step-00000042", 42, None),
        ("/ckpt/run/step-00000042", None, "/ckpt/run/step-00000042"),
        ("s3://b/run/weights.pt", None, "s3://b/run/weights.pt"),
    ],
)
def test_step_specs_parse_in_one_place(spec: Any, step: int | None, path: str | None) -> None:
    got = StepSpec.parse(spec)
    assert (got.step, got.path, got.latest) == (step, path, step is None and path is None)


@pytest.mark.parametrize("bad", [-1, True, 10**15, 1.5])
def test_bad_steps_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="step must be an integer"):
        StepSpec.parse(bad)


def test_split_step_url() -> None:
    assert split_step_url("s3://b/run/step-00000042/") == ("s3://b/run", 42)
    assert split_step_url("/ckpt/run") == ("/ckpt/run", None)
    assert split_step_url("/step-00000001") == ("/", 1)


@pytest.fixture
def root_of_experiments(tmp_path: Path) -> Path:
    for name in ("alpha", "team/beta"):
        with CheckpointStore(str(tmp_path), experiment=name) as store:
            store.save(5, {"w": torch.ones(2)})
    (tmp_path / "notes").mkdir()  # not an experiment
    return tmp_path


def test_a_root_lists_its_experiments(root_of_experiments: Path, capsys: Any) -> None:
    with CheckpointStore(str(root_of_experiments)) as store:
        assert store.experiments() == ["alpha", "team/beta"]
    assert cli(["list", str(root_of_experiments)]) == 0
    out = capsys.readouterr().out
    assert "holds 2 experiment(s)" in out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines()[2:]}
    assert rows["alpha"][1:3] == ["5", "1"] and rows["team/beta"][1:3] == ["5", "1"]


@pytest.mark.parametrize("argv", [["verify"], ["prune", "--keep-last", "1"], ["inspect"]])
def test_other_commands_on_a_root_point_at_the_experiments(
    root_of_experiments: Path, capsys: Any, argv: list[str]
) -> None:
    assert cli([argv[0], str(root_of_experiments), *argv[1:]]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "alpha, team/beta" in err


GATE = threading.Event()


class Gated(TorchFormat):
    def persist(self, staged: Any, ctx: SaveContext) -> None:
        assert GATE.wait(60)
        super().persist(staged, ctx)


register_format("layout-gated", Gated, clobber=True)


def test_save_schedule_facts(tmp_path: Path) -> None:
    GATE.clear()
    with CheckpointStore(str(tmp_path), format="layout-gated") as store:
        assert not store.save_in_flight and store.save_timings.count == 0
        assert store.save_timings.median_s is None
        handle = store.save(1, {"w": torch.ones(1000)}, blocking=False)
        assert store.save_in_flight  # a new save would wait for this one
        GATE.set()
        handle.result()
        store.wait()
        assert not store.save_in_flight
        store.save(2, {"w": torch.ones(1000)})
        store.saves_completed()  # draining the stats does not reset the timings
        t = store.save_timings
        assert t.count == 2 and len(t.total_s) == 2 and t.last_s == t.total_s[-1]
        assert t.median_s == sum(t.total_s) / 2 and t.max_s == max(t.total_s)
        pairs = zip(t.total_s, t.blocking_s, strict=True)
        assert all(total >= blocking for total, blocking in pairs)


def _save(store: CheckpointStore, step: int) -> None:
    store.save(step, {"w": torch.full((2,), float(step))})


def test_latest_is_the_newest_commit_when_the_pointer_is_one_save_behind(tmp_path: Path) -> None:
    """A kill between step 60's manifest and its `latest` pointer: step 60 is committed (the
    manifest is the commit), so it is what `latest` loads, not the step the pointer names."""
    root = tmp_path / "ckpt"
    with CheckpointStore(str(root)) as store:
        for step in (50, 55, 60):
            _save(store, step)
    (root / "latest").write_text("step-00000055\n")  # what the kill left
    with CheckpointStore(str(root)) as store:
        scan = store.scan()
        assert scan.pointer == 55 and scan.head == 60 and scan.problems() == []
        assert store.latest_step() == 60 and store.manifest("latest").step == 60
        state: dict[str, Any] = {"w": torch.zeros(2)}
        assert store.load(state).step == 60 and float(state["w"][0]) == 60.0
        _save(store, 65)  # and the next save follows it
    assert cli(["list", str(root)]) == 0


def test_a_rewound_run_keeps_its_head_even_when_its_clock_is_behind(tmp_path: Path) -> None:
    """Resumed from step 40 while steps 50 and 60 exist (an abandoned timeline), on a host whose
    clock is an hour behind: its new step 50 is the newest commit, also before its pointer."""
    root = tmp_path / "ckpt"
    with CheckpointStore(str(root)) as store:
        for step in (40, 50, 60):
            _save(store, step)
    with CheckpointStore(str(root), wall_clock=lambda: time.time() - 3600) as store:
        assert store.latest_step() == 60
        store.load({"w": torch.zeros(2)}, 40)
        _save(store, 50)
        assert store.latest_step() == 50
    (root / "latest").write_text("step-00000060\n")  # as if killed before the pointer moved
    with CheckpointStore(str(root)) as store:
        assert store.latest_step() == 50
        state: dict[str, Any] = {"w": torch.zeros(2)}
        assert store.load(state).step == 50
