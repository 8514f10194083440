"""A newcomer's foot-guns (issue 36), each as they met it: a dry run next to a run's checkpoints,
a resume from a checkpoint ``ckptstore import`` wrote (weights only) or one that lacks a run's
entries, a ``latest`` whose folder is gone, and a finished run trained further (its LR schedule)."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from train_helpers import tiny_flags

import ckptstore
from pyrecover_train.cli import main
from pyrecover_train.config import TrainConfig
from pyrecover_train.resume import schedule_changes


def checksums(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def finished(corpus: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run (checkpoints at 2 and 4): copied by each test that changes it."""
    ckpt = tmp_path_factory.mktemp("finished")
    argv = tiny_flags(
        corpus, cache_dir, ckpt, "--training-steps", "4", "--checkpoint-frequency", "2"
    )
    assert main(argv) == 0
    return ckpt


@pytest.fixture
def ckpt(finished: Path, tmp_path: Path) -> Path:
    """A copy of the finished run's checkpoint folder, for a test that changes it."""
    copied = tmp_path / "ckpt"
    shutil.copytree(finished, copied)
    return copied


@pytest.fixture
def flags(corpus: Path, cache_dir: Path, ckpt: Path) -> Callable[..., list[str]]:
    """``tiny_flags`` on the copy, with the test's own flags after them."""
    return lambda *extra: tiny_flags(corpus, cache_dir, ckpt, *extra)


def test_a_dry_run_beside_a_runs_checkpoints_touches_nothing(
    ckpt: Path, flags: Callable[..., list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before ("already holds checkpoints"), though it writes nothing lasting: now it
    runs from step 0 beside them; its save goes to a scratch experiment, removed; no metrics or
    log lines are added to the run's."""
    before = checksums(ckpt)
    capsys.readouterr()
    assert main([*flags("--training-steps", "4"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dry run OK: 1 step" in out and "(untouched)" in out
    assert checksums(ckpt) == before


def test_a_resume_from_a_ckptstore_import_says_how_to_start_from_it(
    ckpt: Path,
    flags: Callable[..., list[str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`ckptstore import --into-run` made a weights-only checkpoint the newest; the resume then
    ended in ckptstore's "pass strict=False", which no flag passes."""
    exp = ckpt / "default-exp"
    with ckptstore.CheckpointStore(str(exp)) as store:
        model = store.read(4)[1]["model"]
    torch.save({"model": model, "step": 1000}, tmp_path / "weights.pt")
    src = str(tmp_path / "weights.pt")
    ckptstore.import_checkpoint(src, str(exp), into_run=True)
    before = checksums(ckpt)
    capsys.readouterr()
    argv = flags("--training-steps", "8")
    assert main([*argv, "--resume-from-checkpoint", "latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "was imported with `ckptstore import`" in err and "holds model, step only" in err
    assert f"`pyrecover-train --resume-from-checkpoint {src} --experiment-name NEW`" in err
    assert "--resume-from-checkpoint 4 (nothing was changed)" in err
    assert checksums(ckpt) == before
    # ... and the commands it names work: the run from its own step, a new one from the weights
    assert main([*argv, "--resume-from-checkpoint", "4"]) == 0
    new = [*argv, "--experiment-name", "new", "--resume-from-checkpoint", src]
    assert main(new) == 0


def test_a_resume_from_a_checkpoint_without_a_runs_entries_names_the_cli_way(
    ckpt: Path, flags: Callable[..., list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    with ckptstore.CheckpointStore(str(ckpt / "default-exp")) as store:
        model = store.read(4)[1]["model"]
        store.save(6, {"model": model, "step": 6})  # another program's save: weights only
    capsys.readouterr()
    argv = flags("--training-steps", "8")
    assert main([*argv, "--resume-from-checkpoint", "latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert "strict=False" not in err and len(err.splitlines()) == 1, err
    exp = ckpt / "default-exp"
    export = f"ckptstore export {exp} --step latest --key model --out weights.safetensors"
    assert export in err and "--resume-from-checkpoint weights.safetensors" in err


def test_a_resume_past_a_dangling_latest_says_which_step_it_takes(
    ckpt: Path, flags: Callable[..., list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    (ckpt / "default-exp" / "latest").write_text("step-00001000\n")
    capsys.readouterr()
    argv = flags("--training-steps", "6", "--checkpoint-frequency", "2")
    assert main([*argv, "--resume-from-checkpoint", "latest"]) == 0
    out = capsys.readouterr().out
    assert "latest names step 1000, whose folder is gone: resuming from step 4" in out
    assert (ckpt / "default-exp" / "latest").read_text().strip() == "step-00000006"


def test_extending_a_finished_run_says_what_it_does_to_the_lr_schedule() -> None:
    old = {"training_steps": 400, "warmup_steps": 40, "learning_rate": 3e-3, "min_lr": None}
    cfg = TrainConfig(training_steps=800, warmup_steps=40, learning_rate=3e-3)
    (line,) = schedule_changes(old, cfg, 1, 1, 400)
    assert line.startswith("resume with --training-steps 400 -> 800: extends a finished run")
    assert "the learning rate goes from 0.0003 (where it ended) to 0.00176 at step 400" in line
    assert "pass --learning-rate 0.0003 --min-lr 0.0003" in line
    (line,) = schedule_changes(old, cfg, 1, 1, 200)  # not finished: the schedule changes
    assert "extends" not in line and "at the resumed step 200 the learning rate is" in line
