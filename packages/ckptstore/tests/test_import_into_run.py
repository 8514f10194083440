"""Issue 36: ``ckptstore import`` into an experiment a run writes, and a ``latest`` whose step
folder is gone. An import there became the run's newest checkpoint without a word (the next
resume failed, prune kept it, and after its folder was removed ``list`` exited 1 on the
dangling pointer with nothing saying what "latest" now meant or how to mend it)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from ckpt_helpers import one_line, run_cli
from safetensors.torch import save_file

from ckptstore import CheckpointStore


def checksums(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """An experiment a run wrote: steps 10 and 20 of a model, optimizer and step."""
    exp = tmp_path / "exp"
    with CheckpointStore(str(exp)) as store:
        for step in (10, 20):
            state = {"model": {"w": torch.full((2,), float(step))}, "optim": {"m": torch.ones(2)}}
            store.save(step, {**state, "step": step})
    return exp


@pytest.mark.parametrize("kind", ["torch.save", "safetensors"])
def test_an_import_into_a_run_is_refused_without_into_run(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    if kind == "safetensors":
        src = tmp_path / "w.safetensors"
        save_file({"w": torch.zeros(2)}, src)
        argv = ["import", str(src), str(run), "--step", "1000"]
    else:
        src = tmp_path / "w.pt"
        torch.save({"model": {"w": torch.zeros(2)}, "step": 1000}, src)
        argv = ["import", str(src), str(run)]
    before = checksums(run)
    code, out, err = run_cli(capsys, *argv)
    line = one_line(err)
    assert code == 2 and out == "", err
    assert "holds a run's checkpoints (up to step 20)" in line
    assert "would become its newest checkpoint (step 1000)" in line
    assert "not the run's optim" in line  # what a resume from it would lack
    assert f"pyrecover-train import-checkpoint {src} --experiment-name NEW" in line
    assert "--into-run" in line
    assert checksums(run) == before  # nothing written
    code, out, _ = run_cli(capsys, *argv, "--into-run")
    assert code == 0 and "as step 1000" in out
    with CheckpointStore(str(run)) as store:
        assert store.steps() == [10, 20, 1000] and store.latest_step() == 1000


def test_imports_into_an_experiment_of_imports_need_no_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only a run's checkpoints make an experiment a run's: imports may gather in one."""
    for step in (1, 2):
        torch.save({"model": {"w": torch.full((2,), float(step))}, "step": step}, tmp_path / "w.pt")
        assert run_cli(capsys, "import", str(tmp_path / "w.pt"), str(tmp_path / "c"))[0] == 0


def dangle(run: Path) -> None:
    """`latest` names step 30, whose folder is gone (removed by hand, say)."""
    (run / "latest").write_text("step-00000030\n")


def note(err: str) -> str:
    (line,) = [ln for ln in err.splitlines() if "note:" in ln]
    return line


@pytest.mark.parametrize("command", ["list", "verify", "inspect"])
def test_a_dangling_latest_is_explained(
    run: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    dangle(run)
    before = checksums(run)
    _, _, err = run_cli(capsys, command, str(run))
    line = note(err)
    assert "latest names step 30, whose folder is gone" in line
    assert 'every load and resume of "latest" takes step 20' in line
    assert f"ckptstore prune {run} --keep-last K" in line
    assert checksums(run) == before  # a reading command reads


def test_prune_repairs_a_dangling_latest(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dangle(run)
    before = checksums(run)
    code, out, _ = run_cli(capsys, "prune", str(run), "--keep-last", "5", "--dry-run")
    assert code == 0 and "would rewrite latest (it names step 30, whose folder is gone)" in out
    assert checksums(run) == before
    code, out, _ = run_cli(capsys, "prune", str(run), "--keep-last", "5")
    assert code == 0 and "rewrote latest: it named step 30" in out
    assert (run / "latest").read_text().strip() == "step-00000020"
    code, _, err = run_cli(capsys, "list", str(run))
    assert code == 0 and err == ""
