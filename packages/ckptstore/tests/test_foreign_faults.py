"""Foreign checkpoints with something wrong or missing (issue 30): a DCP folder with a part
missing or damaged, safetensors files the safetensors library itself refuses, sources whose step
or tensors ckptstore cannot take, an import that would move an experiment back, and what
retention keeps and why. Each is one line naming the file and what to do, exit 1, nothing
written, nothing of the file run."""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_helpers import one_line, run_cli
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ckptstore import CheckpointStore, CorruptCheckpointError, read_foreign


def refused_import(capsys: pytest.CaptureFixture[str], src: Path, dest: Path) -> str:
    """``ckptstore import`` of ``src``: exit 1, one line naming ``src``, nothing written."""
    code, out, err = run_cli(capsys, "import", str(src), str(dest), "--step", "1")
    line = one_line(err)
    assert code == 1 and out == "" and str(src) in line, line
    assert not dest.exists() or not list(dest.glob("step-*"))
    return line


# -- DCP folders with a part missing or damaged --------------------------------------------------
def dcp_folder(tmp_path: Path) -> Path:
    out = tmp_path / "dcp"
    model = torch.nn.Linear(64, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process here
        dcp.save({"model": model.state_dict(), "step": 7}, checkpoint_id=str(out), no_dist=True)
    return out


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def damage(folder: Path, how: str, marker: Path) -> None:
    (shard,) = folder.glob("*.distcp")
    if how == "missing shard":
        shard.unlink()
    elif how == "truncated shard":
        os.truncate(shard, shard.stat().st_size // 2)
    elif how == "garbled shard":  # its archive headers (DCP keeps no checksum of the data)
        with open(shard, "r+b") as f:
            f.write(b"\xff" * 64)
    elif how == "truncated metadata":
        os.truncate(folder / ".metadata", 40)
    elif how == "code-running metadata":
        (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))


DCP_DAMAGE = {
    "missing shard": "__0_0.distcp is missing: the checkpoint's .metadata needs it",
    "truncated shard": "__0_0.distcp is truncated (",
    "garbled shard": "cannot read this DCP checkpoint (",
    "truncated metadata": ".metadata: truncated or damaged (",
    "code-running metadata": ".metadata: refused: a pickle that asks for posix.system",
}


@pytest.mark.parametrize("how", list(DCP_DAMAGE))
def test_a_damaged_dcp_folder_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    """Was a 50-line traceback: torch's CheckpointException derives from BaseException."""
    src, marker = dcp_folder(tmp_path), tmp_path / "code-ran"
    damage(src, how, marker)
    line = refused_import(capsys, src, tmp_path / "c")
    assert DCP_DAMAGE[how] in line and "again from where it was written" in line, line
    with pytest.raises(CorruptCheckpointError):
        read_foreign(str(src))
    assert not marker.exists()  # the pickle's code never ran


def test_a_dcp_metadata_naming_a_file_outside_its_folder_is_refused(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    src = dcp_folder(tmp_path)
    with open(src / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file, written above
    for index, info in metadata.storage_data.items():
        metadata.storage_data[index] = _StorageInfo("../../etc/passwd", info.offset, info.length)
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CorruptCheckpointError, match="a file outside the checkpoint folder"):
        read_foreign(str(src))


def test_an_intact_dcp_folder_still_comes_in_whole(tmp_path: Path) -> None:
    src = dcp_folder(tmp_path)
    found = read_foreign(str(src))
    assert found.kind == "dcp" and found.step == 7
    assert set(found.state["model"]) == {"weight", "bias"}


# -- safetensors files the safetensors library refuses -----------------------------------------
def st_file(path: Path, header: dict[str, Any] | bytes, data: bytes) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def f32(offsets: list[int], shape: list[int]) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape, "data_offsets": offsets}


BAD_SAFETENSORS: dict[str, tuple[dict[str, Any] | bytes, bytes, str]] = {
    "overlapping byte ranges": (
        {"a": f32([0, 8], [2]), "b": f32([4, 12], [2])},
        bytes(12),
        "tensor 'b' (bytes 4-12) overlaps tensor 'a'",
    ),
    "a negative dimension": ({"a": f32([0, 8], [-1])}, bytes(8), "has shape [-1]: dimensions"),
    "a duplicate tensor name": (
        b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
        b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
        bytes(8),
        "the name 'a' appears twice in its header",
    ),
    "non-string metadata": (
        {"__metadata__": {"epoch": 3}, "a": f32([0, 4], [1])},
        bytes(4),
        "its __metadata__ maps 'epoch' to 3, not to a string",
    ),
    "a header 200,000 deep": (
        b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}",
        b"",
        "its header is JSON nested too deep to be one",
    ),
    "an unknown dtype": (
        {"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}},
        bytes(4),
        "tensor 'a' has dtype 'F33', not one of BOOL, F4,",
    ),
    "bytes that belong to no tensor": ({"a": f32([0, 4], [1])}, bytes(8), "bytes 4-8 of"),
    "a size that does not fit the shape": (
        {"a": f32([0, 4], [2])},
        bytes(4),
        "holds bytes 0-4: shape [2] of F32 needs 8",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SAFETENSORS))
def test_what_the_safetensors_library_refuses_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    header, data, needle = BAD_SAFETENSORS[case]
    src = st_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(SafetensorError):
        load_file(src)  # the reference: the safetensors library refuses it
    line = refused_import(capsys, src, tmp_path / "c")
    assert needle in line and "not a valid safetensors file" in line, line


def test_a_dtype_torch_cannot_hold_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = st_file(
        tmp_path / "f4.safetensors",
        {"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}},
        b"\0",
    )
    line = refused_import(capsys, src, tmp_path / "c")
    assert "has dtype F4, which torch has no type for" in line, line


def test_what_the_safetensors_library_writes_still_comes_in(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0, 3),
        "half": torch.randn(2, dtype=torch.bfloat16),
    }
    save_file(tensors, tmp_path / "ok.safetensors", metadata={"format": "pt"})
    found = read_foreign(str(tmp_path / "ok.safetensors"))
    assert found.state["model"].keys() == tensors.keys()
    for k, t in tensors.items():
        assert torch.equal(found.state["model"][k], t), k


# -- steps, tensors and sources import cannot take as they are -----------------------------------
def test_an_empty_torch_save_is_refused_instead_of_taking_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({}, tmp_path / "empty.pt")
    line = refused_import(capsys, tmp_path / "empty.pt", tmp_path / "c")
    assert "is an empty torch.save checkpoint (it holds no entries): nothing to import" in line


@pytest.mark.parametrize(("step", "said"), [(5.0, "written as float 5.0"), ("5", "written as str")])
def test_a_whole_float_or_string_step_is_taken_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], step: Any, said: str
) -> None:
    torch.save({"model": {"w": torch.ones(2)}, "step": step}, tmp_path / "s.pt")
    code, out, _ = run_cli(capsys, "import", str(tmp_path / "s.pt"), str(tmp_path / "c"))
    assert code == 0 and "as step 5 of" in out and f"step (5, {said}" in out, out


def test_a_step_that_is_no_whole_number_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"model": {"w": torch.ones(2)}, "step": 5.5}, tmp_path / "s.pt")
    code, _, err = run_cli(capsys, "import", str(tmp_path / "s.pt"), str(tmp_path / "c"))
    line = one_line(err)
    assert code == 1 and "records its step as 5.5 (float), not a whole number" in line, line
    assert "--step N" in line


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    ("kind", "told"),
    [
        ("meta", "on the meta device (a shape without values"),
        ("quantized", "a quantized tensor (torch.qint8): save t.dequantize()"),
        ("sparse", "layout torch.sparse_coo: convert it to a dense one first (t.to_dense())"),
    ],
)
def test_a_tensor_ckptstore_does_not_store_gets_its_own_advice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, told: str
) -> None:
    t = {
        "meta": lambda: torch.ones(2, device="meta"),
        "quantized": lambda: torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8),
        "sparse": lambda: torch.ones(4).to_sparse(),
    }[kind]()
    torch.save({"model": {"w": t}, "step": 5}, tmp_path / "s.pt")
    code, _, err = run_cli(capsys, "import", str(tmp_path / "s.pt"), str(tmp_path / "c"))
    assert code == 1 and told in err.strip().splitlines()[-1], err
    if kind != "sparse":
        assert ".to_dense()" not in err


def test_importing_below_the_latest_step_is_refused_unless_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 5 into an experiment at step 50 silently became `latest` (a resume went back 45)."""
    exp = tmp_path / "exp"
    with CheckpointStore(str(exp)) as store:
        store.save(50, {"w": torch.ones(2)})
    torch.save({"model": {"w": torch.zeros(2)}, "step": 5}, tmp_path / "s5.pt")
    code, _, err = run_cli(capsys, "import", str(tmp_path / "s5.pt"), str(exp), "--into-run")
    line = one_line(err)
    assert code == 2 and "is at step 50: step 5 would become its latest checkpoint" in line
    assert "a resume would go back 45 steps" in line and "--rewind" in line
    with CheckpointStore(str(exp)) as store:
        assert store.steps() == [50] and store.latest_step() == 50
    into = ["import", str(tmp_path / "s5.pt"), str(exp), "--into-run"]
    assert run_cli(capsys, *into, "--rewind")[0] == 0
    assert run_cli(capsys, *into, "--step", "60")[0] == 0
    with CheckpointStore(str(exp)) as store:
        assert store.steps() == [5, 50, 60] and store.latest_step() == 60


# -- retention says why it keeps what it keeps -------------------------------------------------
def test_prune_says_why_each_checkpoint_stays_and_its_dry_run_lists_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After an import below the head, --keep-last 1 kept four more without a word, and the
    dry run printed an empty kept list."""
    exp = tmp_path / "exp"
    with CheckpointStore(str(exp)) as store:
        for step in (10, 20, 30, 40):
            store.save(step, {"w": torch.ones(2)})
    torch.save({"model": {"w": torch.zeros(2)}, "step": 5}, tmp_path / "s5.pt")
    argv = ["import", str(tmp_path / "s5.pt"), str(exp), "--rewind", "--into-run"]
    assert run_cli(capsys, *argv)[0] == 0
    for dry in (True, False):
        code, out, _ = run_cli(capsys, "prune", str(exp), "--keep-last", "1", *["--dry-run"] * dry)
        lines = out.strip().splitlines()
        verb, keep = ("would delete", "would keep") if dry else ("deleted", "kept")
        assert code == 0 and lines[:2] == [f"{verb} 0 checkpoint(s)", f"{keep} 5:"], out
        assert lines[2] == "  step 5: latest; the newest that verifies; one of the last 1"
        for line, step in zip(lines[3:], (10, 20, 30, 40), strict=True):
            assert line.startswith(f"  step {step}: above the latest step 5 (a timeline given up")
    with CheckpointStore(str(exp)) as store:
        for step in (50, 60):
            store.save(step, {"w": torch.ones(2)})
    code, out, _ = run_cli(capsys, "prune", str(exp), "--keep-last", "1", "--dry-run")
    assert "would delete 6 checkpoint(s): steps 5, 10, 20, 30, 40, 50" in out
    assert "would keep 1:\n  step 60: latest; the newest that verifies; one of the last 1" in out
    with CheckpointStore(str(exp)) as store:
        assert store.steps() == [5, 10, 20, 30, 40, 50, 60]  # a dry run deletes nothing
