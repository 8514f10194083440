"""Import from anything, export everything: foreign checkpoints come in as verified ckptstore
checkpoints, bitwise; a malformed one gets one line; a ckptstore checkpoint goes out whole.

Lightning and Hugging Face sources are in test_import_integrations.py (they need those
libraries: the integrations session).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import (
    FORMATS,
    TESTS,
    assert_same_state,
    communicate_all,
    make_state,
    one_line,
    run_cli,
)

from ckptstore import (
    CheckpointError,
    CheckpointStore,
    IncompatibleCheckpointError,
    export_checkpoint,
    foreign_kind,
    import_checkpoint,
    read_foreign,
    register_format,
)

WORKER = TESTS / "ckpt_foreign_worker.py"


def read_back(root: Path, step: int) -> dict[str, Any]:
    with CheckpointStore(str(root)) as store:
        assert store.verify(step).ok
        _, values = store.read(step)
    return values


def model_and_optim() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


# -------------------------------------------------------------------------------- torch.save --
def test_a_plain_state_dict_comes_in_as_the_model(tmp_path: Path, capsys: Any) -> None:
    model, _ = model_and_optim()
    torch.save(model.state_dict(), tmp_path / "w.pt")
    code, out, _ = run_cli(
        capsys, "import", str(tmp_path / "w.pt"), str(tmp_path / "c"), "--step", "0"
    )
    assert code == 0 and "took model (4 tensors" in out and "as step 0" in out
    values = read_back(tmp_path / "c", 0)
    assert_same_state({"model": model.state_dict()}, values)


def test_a_training_dict_comes_in_under_training_names(tmp_path: Path) -> None:
    model, opt = model_and_optim()
    src = {
        "model_state_dict": model.state_dict(),
        "optimizer_state_dict": opt.state_dict(),
        "global_step": torch.tensor(42),
        "epoch": 3,
    }
    torch.save(src, tmp_path / "ckpt.pt")
    report = import_checkpoint(str(tmp_path / "ckpt.pt"), str(tmp_path / "c"))
    assert report.manifest.step == 42 and report.foreign.kind == "torch.save"
    assert set(report.foreign.took) == {"model", "optim", "step", "epoch"}
    assert "from 'optimizer_state_dict'" in report.foreign.took["optim"]
    values = read_back(tmp_path / "c", 42)
    assert values["step"] == 42 and values["epoch"] == 3
    fresh, opt2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)), None
    with CheckpointStore(str(tmp_path / "c")) as store:
        opt2 = torch.optim.AdamW(fresh.parameters())
        store.load({"model": fresh, "optim": opt2})
    assert_same_state({"m": model, "o": opt}, {"m": fresh, "o": opt2})


# ----------------------------------------------------------------------------------------- dcp --
def dcp_source(tmp_path: Path, ranks: int) -> Path:
    out = tmp_path / f"dcp{ranks}"
    if ranks == 1:
        cmd = [sys.executable, str(WORKER), "dcp", str(out)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={ranks}", str(WORKER), "dcp", str(out)]
    tmp = tmp_path / "tmp"  # torchrun leaves a torchelastic_* folder in the temp folder
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    (log,) = communicate_all([proc])
    assert proc.returncode == 0, log[-3000:]
    return out


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_dcp_folder_comes_in(tmp_path: Path, ranks: int, capsys: Any) -> None:
    src = dcp_source(tmp_path, ranks)
    if ranks == 2:
        assert len(list(src.glob("*.distcp"))) == 2  # both ranks wrote
    code, out, _ = run_cli(capsys, "import", str(src), str(tmp_path / "c"))
    assert code == 0 and "imported dcp checkpoint" in out and "as step 21" in out, out
    expected = torch.load(f"{src}.expected.pt", weights_only=True)
    values = read_back(tmp_path / "c", 21)
    assert values["step"] == 21 and values["epoch"] == 2
    assert_same_state({"model": expected["model"]}, values, keys=["model"])
    # the optimizer's state is keyed by parameter id again (DCP names keys as strings)
    assert_same_state({"optim": expected["optimizer"]}, values, keys=["optim"])
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
    opt = torch.optim.AdamW(model.parameters())
    with CheckpointStore(str(tmp_path / "c")) as store:
        store.load({"model": model, "optim": opt})
    assert len(opt.state) == 4


# --------------------------------------------------------------------------------- safetensors --
def test_a_safetensors_file_comes_in(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {
        "a.weight": torch.randn(3, 4),
        "b": torch.arange(10, dtype=torch.int64),
        "h": torch.randn(5, dtype=torch.float64).to(torch.bfloat16),
        "flag": torch.tensor([True, False]),
        "empty": torch.zeros(0, 2),
    }
    save_file(tensors, tmp_path / "m.safetensors", metadata={"source": "test"})
    report = import_checkpoint(str(tmp_path / "m.safetensors"), str(tmp_path / "c"), step=5)
    assert report.foreign.kind == "safetensors" and "__metadata__" in report.foreign.left
    assert_same_state({"model": tensors}, read_back(tmp_path / "c", 5))


def test_an_export_comes_back_whole(tmp_path: Path, capsys: Any) -> None:
    """ckptstore -> safetensors -> ckptstore: every entry, not only the tensors."""
    state = make_state(4)
    with CheckpointStore(str(tmp_path / "a")) as store:
        store.save(4, state)
    out = tmp_path / "all.safetensors"
    code, said, _ = run_cli(capsys, "export", str(tmp_path / "a"), "--out", str(out))
    assert code == 0 and "safetensors.torch.load_file" in said
    code, said, _ = run_cli(capsys, "import", str(out), str(tmp_path / "b"))
    assert code == 0, said
    assert_same_state(read_back(tmp_path / "a", 4), read_back(tmp_path / "b", 4))


# ---------------------------------------------------------------------------------- export --
@pytest.mark.parametrize("fmt", FORMATS)
def test_export_writes_the_whole_state_in_one_call(tmp_path: Path, fmt: str) -> None:
    state = make_state(5)
    with CheckpointStore(str(tmp_path / "c"), format=fmt) as store:
        store.save(5, state)
        _, values = store.read(5)
    report = export_checkpoint(str(tmp_path / "c"), str(tmp_path / "all.pt"))
    assert report.keys == tuple(values) and report.format == "torch"
    assert_same_state(values, torch.load(tmp_path / "all.pt", weights_only=True))
    from safetensors.torch import load_file

    export_checkpoint(str(tmp_path / "c"), str(tmp_path / "all.safetensors"), keys=["model"])
    got = load_file(tmp_path / "all.safetensors")
    assert set(got) == {f"model.{k}" for k in state["model"].state_dict()} - {"model.head.weight"}
    assert torch.equal(got["model.body.weight"], state["model"].body.weight)


@pytest.mark.parametrize(
    "out, needle",
    [
        ("missing/dir/x.pt", "does not exist"),
        ("afile/x.pt", "is a file, not a folder"),
        ("adir", "is a folder"),
    ],
)
def test_export_to_a_bad_out_says_what_is_wrong_with_it(
    tmp_path: Path, capsys: Any, out: str, needle: str
) -> None:
    with CheckpointStore(str(tmp_path / "c")) as store:
        store.save(1, {"w": torch.ones(2)})
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, _, err = run_cli(capsys, "export", str(tmp_path / "c"), "--out", str(tmp_path / out))
    line = one_line(err)
    assert code == 2 and line.startswith(f"ckptstore: error: --out {tmp_path / out}"), line
    assert needle in line and ".tmp" not in line
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


# ------------------------------------------------------------------------ malformed and refused --
def malformed(tmp_path: Path, kind: str) -> Path:
    p = tmp_path / f"{kind}.pt"
    if kind == "garbage":
        p.write_bytes(b"GARBAGE!" * 100)
    elif kind == "truncated":
        torch.save({"w": torch.ones(1000)}, p)
        p.write_bytes(p.read_bytes()[:600])
    elif kind == "object":

        class Evil:
            def __reduce__(self) -> Any:
                return (os.system, ("echo pwned",))

        p.write_bytes(pickle.dumps({"w": Evil()}, protocol=2))
    elif kind == "zip-object":
        torch.save({"w": torch.ones(2), "f": zipfile.ZipInfo("x")}, p)
    elif kind == "safetensors":
        p = tmp_path / "bad.safetensors"
        p.write_bytes((200).to_bytes(8, "little") + b"{" + b"x" * 50)
    return p


@pytest.mark.parametrize("kind", ["garbage", "truncated", "object", "zip-object", "safetensors"])
def test_a_malformed_foreign_file_gets_one_line_and_exit_1(
    tmp_path: Path, capsys: Any, kind: str
) -> None:
    src = malformed(tmp_path, kind)
    code, out, err = run_cli(capsys, "import", str(src), str(tmp_path / "c"), "--step", "1")
    line = one_line(err)
    assert code == 1 and out == "" and str(src) in line, line
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").glob("step-*"))
    with pytest.raises(CheckpointError):
        read_foreign(str(src))


def test_a_source_without_a_step_asks_for_one(tmp_path: Path, capsys: Any) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    code, _, err = run_cli(capsys, "import", str(tmp_path / "w.pt"), str(tmp_path / "c"))
    assert code == 1 and "--step N" in one_line(err)


def test_an_existing_step_is_not_replaced_unless_asked(tmp_path: Path, capsys: Any) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    assert (
        run_cli(capsys, "import", str(tmp_path / "w.pt"), str(tmp_path / "c"), "--step", "3")[0]
        == 0
    )
    code, _, err = run_cli(
        capsys, "import", str(tmp_path / "w.pt"), str(tmp_path / "c"), "--step", "3"
    )
    assert code == 2 and "--overwrite" in one_line(err)
    argv = ["import", str(tmp_path / "w.pt"), str(tmp_path / "c"), "--step", "3", "--overwrite"]
    assert run_cli(capsys, *argv)[0] == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_import_writes_the_format_asked_for(tmp_path: Path, capsys: Any, fmt: str) -> None:
    state = {"model": {"w": torch.arange(6.0)}, "step": 4}
    torch.save(state, tmp_path / "s.pt")
    argv = ["import", str(tmp_path / "s.pt"), str(tmp_path / "c"), "--format", fmt]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0, out
    with CheckpointStore(str(tmp_path / "c")) as store:
        assert store.manifest(4).format == fmt
    assert_same_state(state, read_back(tmp_path / "c", 4))


def test_import_offers_the_registrys_formats(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--format's choices are the registry's when the command runs: a format registered after
    ckptstore was imported (as a plugin's is) is one; a name nobody registered is one line,
    exit 2, that lists them."""
    import ckptstore.formats as formats

    for attr in ("known", "loaded"):  # the registration ends with this test
        monkeypatch.setattr(formats.FORMATS, attr, dict(getattr(formats.FORMATS, attr)))
    register_format("late", "ckptstore.formats.torchfile:TorchFormat")
    torch.save({"w": torch.ones(2)}, tmp_path / "s.pt")
    argv = ["import", str(tmp_path / "s.pt"), str(tmp_path / "c"), "--step", "1"]
    assert run_cli(capsys, *argv, "--format", "late")[0] == 0
    with CheckpointStore(str(tmp_path / "c")) as store:
        assert store.manifest(1).format == "late"
    code, _, err = run_cli(capsys, *argv, "--format", "nope", "--overwrite")
    line = one_line(err)
    assert code == 2 and "'nope'" in line and all(f"'{f}'" in line for f in [*FORMATS, "late"])


# ------------------------------------------------------------ readers point at ckptstore import --
def test_load_and_read_of_a_foreign_folder_point_at_import(tmp_path: Path, capsys: Any) -> None:
    src = dcp_source(tmp_path, 1)
    with CheckpointStore(str(tmp_path / "c")) as store:
        for call in (lambda: store.read(str(src)), lambda: store.load({"step": 0}, str(src))):
            with pytest.raises(IncompatibleCheckpointError) as e:
                call()
            assert "is a dcp checkpoint, not a ckptstore one" in str(e.value)
            assert f"ckptstore import {src} DEST" in str(e.value)
    for cmd in ("verify", "inspect", "list"):
        code, _, err = run_cli(capsys, cmd, str(src))
        assert code == 1 and "ckptstore import" in one_line(err), (cmd, err)


def test_a_plain_torch_save_file_still_loads_through_the_api(tmp_path: Path, capsys: Any) -> None:
    model, _ = model_and_optim()
    torch.save({"model": model.state_dict(), "step": 9}, tmp_path / "w.pt")
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    with CheckpointStore(str(tmp_path / "c")) as store:
        state: dict[str, Any] = {"model": fresh, "step": 0}
        store.load(state, str(tmp_path / "w.pt"))
    assert state["step"] == 9 and torch.equal(fresh[0].weight, model[0].weight)
    code, _, err = run_cli(capsys, "verify", str(tmp_path / "w.pt"))
    assert code == 1 and "is a torch.save checkpoint" in one_line(err)


def test_a_folder_that_is_no_checkpoint_says_so(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError, match="not a checkpoint ckptstore can import"):
        read_foreign(str(tmp_path / "x"))


def test_foreign_kind_tells_a_foreign_checkpoint_from_ours_and_from_none(tmp_path: Path) -> None:
    """What a trainer asks of a path it was given, before reading it."""
    model, _ = model_and_optim()
    torch.save({"model": model.state_dict(), "step": 3}, tmp_path / "w.pt")
    kind, line = foreign_kind(str(tmp_path / "w.pt"))
    assert kind == "torch.save" and f"ckptstore import {tmp_path / 'w.pt'} DEST" in line
    with CheckpointStore(str(tmp_path / "c")) as store:
        store.save(3, {"model": model})
    assert foreign_kind(str(tmp_path / "c")) == ("", "")  # ours: the experiment
    assert foreign_kind(str(tmp_path / "c" / "step-00000003")) == ("", "")  # and a step of it
    assert foreign_kind(str(tmp_path / "missing")) == ("", "")  # nothing there: the caller says
    (tmp_path / "notes.txt").write_text("hello, world")
    kind, why = foreign_kind(str(tmp_path / "notes.txt"))
    assert kind == "" and "is not a checkpoint ckptstore can import" in why and "\n" not in why


def test_a_hugging_face_folder_with_sharded_bin_weights_comes_in(tmp_path: Path) -> None:
    """The layout of save_pretrained(safe_serialization=False) with shards, beside the
    Trainer's files (the real Trainer's safetensors layout: test_import_integrations.py)."""
    import json

    model, opt = model_and_optim()
    sd = model.state_dict()
    names = list(sd)
    src = tmp_path / "checkpoint-7"
    src.mkdir()
    parts = {
        "pytorch_model-00001-of-00002.bin": names[:2],
        "pytorch_model-00002-of-00002.bin": names[2:],
    }
    for file, keys in parts.items():
        torch.save({k: sd[k] for k in keys}, src / file)
    weight_map = {k: file for file, keys in parts.items() for k in keys}
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    torch.save(opt.state_dict(), src / "optimizer.pt")
    (src / "trainer_state.json").write_text(json.dumps({"global_step": 7, "epoch": 0.5}))
    (src / "tokenizer.json").write_text("{}")
    report = import_checkpoint(str(src), str(tmp_path / "c"))
    assert report.manifest.step == 7 and report.foreign.left == {
        "tokenizer.json": "not training state"
    }
    values = read_back(tmp_path / "c", 7)
    assert_same_state({"model": sd, "optim": opt.state_dict()}, values, keys=["model", "optim"])
