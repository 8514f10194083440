"""The ckptstore command line, in-process (fast) and once through the real entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from ckpt_helpers import ROOT, corrupt, make_state, run_cli

from ckptstore import CheckpointStore, cli
from ckptstore.cli import main


@pytest.fixture
def ckpts(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    with CheckpointStore(str(root)) as store:
        for step in (10, 9000, 10000):
            store.save(step, make_state(step % 7), metadata={"val_loss": step / 1e4})
    return root


def test_list(ckpts: Path, capsys: Any) -> None:
    code, out, _ = run_cli(capsys, "list", str(ckpts))
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split()[:3] == ["step", "time", "format"]
    assert [ln.split()[0] for ln in lines[1:]] == ["10", "9000", "10000"]
    assert "(latest)" in lines[-1]
    code, out, _ = run_cli(capsys, "list", str(ckpts), "--json")
    assert [orjson.loads(ln)["step"] for ln in out.splitlines()] == [10, 9000, 10000]


def test_verify_names_the_bad_file(ckpts: Path, capsys: Any) -> None:
    assert run_cli(capsys, "verify", str(ckpts))[0] == 0
    bad = corrupt(str(ckpts / "step-00009000"), {}, "flip")
    code, out, _ = run_cli(capsys, "verify", str(ckpts), "--step", "9000")
    assert code == 1 and "CORRUPT" in out and f"BAD {bad}" in out and "checksum mismatch" in out
    code, out, _ = run_cli(capsys, "verify", str(ckpts), "--step", "all")
    assert code == 1 and out.count("OK ") == 2
    code, out, _ = run_cli(capsys, "verify", str(ckpts / "step-00000010"))  # a step directory
    assert code == 0 and "step-00000010" in out


def test_inspect_shows_shapes_and_dtypes(ckpts: Path, capsys: Any) -> None:
    code, out, _ = run_cli(capsys, "inspect", str(ckpts), "--step", "10")
    assert code == 0
    assert "model.body.weight  float32  [16, 16]" in out
    assert "val_loss" in out and "state." in out
    code, out, _ = run_cli(capsys, "inspect", str(ckpts), "--json")
    info = orjson.loads(out)
    assert info["step"] == 10000 and any(t["key"] == "buf" for t in info["tensors"])


def test_prune(ckpts: Path, capsys: Any) -> None:
    code, out, _ = run_cli(capsys, "prune", str(ckpts), "--keep-last", "1", "--dry-run")
    assert code == 0 and "would delete 2" in out
    code, out, _ = run_cli(capsys, "prune", str(ckpts), "--keep-last", "1")
    assert code == 0 and "deleted 2 checkpoint(s): steps 10, 9000" in out
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-00010000"]


@pytest.mark.parametrize("fmt", ["torch", "dcp"])
def test_export_plain_weights(tmp_path: Path, capsys: Any, fmt: str) -> None:
    state = make_state(4)
    with CheckpointStore(str(tmp_path / "c"), format=fmt) as store:
        store.save(4, state)
    out_file = tmp_path / "weights.pt"
    code, out, _ = run_cli(
        capsys,
        "export",
        str(tmp_path / "c"),
        "--step",
        "latest",
        "--out",
        str(out_file),
        "--key",
        "model",
    )
    assert code == 0 and "exported model of step 4" in out
    sd = torch.load(out_file, weights_only=True)
    fresh = type(state["model"])()
    fresh.load_state_dict(sd)
    for a, b in zip(fresh.state_dict().values(), state["model"].state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert out_file.stat().st_size < 64_000  # views were cloned: not the whole read buffer
    code, _, _ = run_cli(
        capsys,
        "export",
        str(tmp_path / "c"),
        "--step",
        "4",
        "--out",
        str(tmp_path / "o.pt"),
        "--key",
        "optim",
    )
    assert code == 0 and "state" in torch.load(tmp_path / "o.pt", weights_only=True)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["list"], "url"),
        (["prune", "/x", "--keep-last", "0"], "must be >= 1"),
        (["verify", "/x", "--step", "abc"], "--step"),
        (["frobnicate"], "invalid choice"),
        (["list", "/x", "--storage-options", "{nope"], "not JSON"),
        (["list", "/x", "--storage-options", "[1]"], "must be a JSON object"),
    ],
)
def test_usage_errors_exit_2_with_one_line(argv: list[str], needle: str, capsys: Any) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err


def test_export_of_a_missing_key_is_a_usage_error(ckpts: Path, capsys: Any, tmp_path: Path) -> None:
    code, _, err = run_cli(
        capsys, "export", str(ckpts), "--step", "10", "--out", str(tmp_path / "x"), "--key", "nope"
    )
    assert code == 2 and "choose with --key" in err and "model" in err
    assert not (tmp_path / "x").exists()


def test_nothing_there_exits_1(tmp_path: Path, capsys: Any) -> None:
    code, _, err = run_cli(capsys, "verify", str(tmp_path / "empty"))
    assert code == 1 and "no checkpoint" in err


def test_entry_point_and_module(ckpts: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(
        [sys.executable, "-m", "ckptstore", "verify", str(ckpts)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0 and "OK" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "ckptstore", "list"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.s3
def test_list_on_s3_with_storage_options(moto: Any, capsys: Any) -> None:
    url = "s3://ckpt/cli-list"
    with CheckpointStore(url, storage_options=moto.storage_options()) as store:
        store.save(3, {"w": torch.ones(2)})
    opts = orjson.dumps(moto.storage_options()).decode()
    code, out, _ = run_cli(capsys, "list", url, "--storage-options", opts)
    assert code == 0 and out.splitlines()[1].startswith("3")


def test_a_reader_that_leaves_early_ends_it_quietly(ckpts: Path) -> None:
    """`ckptstore verify DIR | head -1`: no "[Errno 32] Broken pipe", SIGPIPE's status 141."""
    argv = [sys.executable, "-m", "ckptstore", "verify", str(ckpts), "--step", "all"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "closedpipe.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stderr) == (141, "")


def test_a_skipped_checkpoint_is_said_once_in_one_line(ckpts: Path, tmp_path: Path) -> None:
    """`ckptstore export --step latest` past a corrupt newest step: the fallback is one line on
    stderr, not that line again as a CheckpointWarning with a source line under it."""
    corrupt(str(ckpts / "step-00010000"), {}, "flip")
    argv = ["export", str(ckpts), "--step", "latest", "--out", str(tmp_path / "m.pt")]
    done = subprocess.run(
        [sys.executable, "-m", "ckptstore", *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "of step 9000" in done.stdout, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("ckptstore: skipped ") and "trying step 9000" in line


def test_what_is_no_checkpoint_folder_is_one_line(
    ckpts: Path, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probes of issue 24: an empty URL read as '/', a file as 'no checkpoints in FILE', a
    writer.lock folder as '[Errno 21]', a Ctrl-C as a traceback per thread."""
    (tmp_path / "w.pt").write_bytes(b"x")
    os.mkfifo(tmp_path / "fifo")
    (ckpts / "writer.lock").mkdir()
    code, _, err = run_cli(capsys, "list", "")
    assert code == 2 and "the URL is empty" in err and len(err.splitlines()) == 1
    for argv, said in [
        (["list", str(tmp_path / "w.pt")], "w.pt is a file, not a folder of checkpoints"),
        (["inspect", str(tmp_path / "w.pt")], "w.pt is a file, not a folder of checkpoints"),
        (["list", str(tmp_path / "fifo")], "fifo is a file, not a folder of checkpoints"),
        (["lock", str(ckpts)], "its writer.lock is a folder, not a lock file; if no run"),
    ]:
        code, out, err = run_cli(capsys, *argv)
        assert code == 1 and out == "" and said in err and len(err.splitlines()) == 1, err
    monkeypatch.setitem(
        cli._COMMANDS, "list", lambda args: (_ for _ in ()).throw(KeyboardInterrupt)
    )
    assert run_cli(capsys, "list", str(ckpts))[1:] == ("", "ckptstore: interrupted\n")
    assert main(["list", str(ckpts)]) == 130
