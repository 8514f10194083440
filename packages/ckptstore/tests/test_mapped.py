"""Fresh tensors from the mapped payload (local disks): verified, private, and only where a
mapping is safe."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_helpers import FORMATS, assert_same_state, make_state

from ckptstore import CheckpointStore, CorruptCheckpointError, IOOptions
from ckptstore.formats import mapped
from ckptstore.storage import IOEngine

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:40 / /mnt/shared rw,relatime shared:9 - nfs4 server:/export rw,vers=4.2
31 30 0:41 / /mnt/shared/scratch rw - tmpfs tmpfs rw
32 22 0:42 / /mnt/my\\040disk rw - xfs /dev/sdb1 rw
"""


def test_the_mount_table_names_the_filesystem(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    kinds = {
        "/home/me/ckpt": "ext4",
        "/mnt/shared/run/step-00000001": "nfs4",
        "/mnt/shared/scratch/x": "tmpfs",
        "/mnt/sharedx": "ext4",  # a prefix of a name is not its mount point
        "/mnt/my disk/run": "xfs",
    }
    for path, kind in kinds.items():
        assert mapped.filesystem_type(path, str(info)) == kind, path
    assert mapped.filesystem_type("/x", str(tmp_path / "absent")) == ""


def test_only_local_disks_are_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = IOEngine()
    assert mapped.mappable(str(tmp_path), io)  # the test machine's temp folder: a local disk
    assert not mapped.mappable(None, io)  # an object store
    assert not mapped.mappable(str(tmp_path), IOEngine(IOOptions(direct=True)))
    monkeypatch.setattr(mapped, "filesystem_type", lambda p: "nfs4")
    assert not mapped.mappable(str(tmp_path), io)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("direct", [None, True])
def test_a_fresh_read_is_bitwise_and_private(tmp_path: Path, fmt: str, direct: bool | None) -> None:
    state = make_state(2, big=300_000)
    with CheckpointStore(str(tmp_path), format=fmt, io=IOOptions(direct=direct)) as store:
        store.save(2, state)
        _, first = store.read(2)
        assert_same_state({k: v for k, v in state.items() if k in first}, first, keys=list(first))
        first["big"].add_(1.0)  # the caller's copy: the file does not change
        first["model"]["body.weight"].zero_()
        assert store.verify(2).ok
        _, again = store.read(2)
        assert torch.equal(again["big"], state["big"])
        assert torch.equal(again["model"]["body.weight"], state["model"].body.weight)


def test_tensors_outlive_their_pruned_checkpoint(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path), keep_last=1) as store:
        store.save(1, {"w": torch.arange(100_000.0)})
        _, values = store.read(1)
        store.save(2, {"w": torch.zeros(3)})  # prunes step 1: its file is unlinked
        assert not (tmp_path / "step-00000001").exists()
        assert torch.equal(values["w"], torch.arange(100_000.0))


def test_a_damaged_chunk_is_found_through_the_mapping(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        store.save(1, {"w": torch.arange(3_000_000.0)})  # 12 MB: three checksum chunks
        (payload,) = (tmp_path / "step-00000001").glob("*.safetensors")
        with open(payload, "r+b") as f:
            f.seek(9 << 20)
            b = f.read(1)
            f.seek(9 << 20)
            f.write(bytes([b[0] ^ 1]))
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch in bytes 8388608-"):
            store.read(1)
