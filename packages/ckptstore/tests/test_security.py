"""Loading never runs pickled code; names cannot leave the checkpoint root."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import orjson
import pytest
import torch
from ckpt_helpers import FORMATS

from ckptstore import CheckpointStore, CorruptCheckpointError
from ckptstore.manifest import CRC_CHUNK, Manifest


class Evil:
    """Unpickling this runs code: it creates MARKER."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {os.environ['CKPT_EVIL_MARKER']}",))


@pytest.fixture
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    m = tmp_path / "pwned"
    monkeypatch.setenv("CKPT_EVIL_MARKER", str(m))
    return m


def evil_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"model": {"w": torch.ones(2)}, "x": Evil()}, buf)
    return buf.getvalue()


def test_a_plain_torch_file_with_code_is_refused(tmp_path: Path, marker: Path) -> None:
    f = tmp_path / "old_checkpoint.pt"
    f.write_bytes(evil_bytes())
    refused = "refused.*weights_only.*never unpickles"
    with (
        CheckpointStore(str(tmp_path / "s")) as store,
        pytest.raises(CorruptCheckpointError, match=refused),
    ):
        store.load({"model": {}}, step=str(f))
    assert not marker.exists()


def test_a_plain_torch_file_of_weights_loads(tmp_path: Path) -> None:
    f = tmp_path / "weights.pt"
    model = torch.nn.Linear(3, 2)
    torch.save({"model": model.state_dict(), "step": 42}, f)
    other = torch.nn.Linear(3, 2)
    with CheckpointStore(str(tmp_path / "store")) as store:
        m = store.load({"model": other}, step=str(f))
    assert m.step == 42 and m.format == "torch.save"
    assert torch.equal(other.weight, model.weight)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_pickle_smuggled_into_a_valid_manifest_is_refused(
    tmp_path: Path, marker: Path, fmt: str
) -> None:
    """An attacker replaces the payload and rewrites the manifest with matching checksums."""
    with CheckpointStore(str(tmp_path), format=fmt) as store:
        store.save(1, {"model": {"w": torch.ones(2)}})
        store.save(2, {"model": {"w": torch.ones(2)}})
    d = tmp_path / "step-00000002"
    manifest = Manifest.from_json((d / "manifest.json").read_bytes())
    evil = evil_bytes()
    payload = manifest.files[0].path
    (d / payload).write_bytes(evil)
    body = orjson.loads((d / "manifest.json").read_bytes())
    body.pop("checksum")
    body["files"][0]["size"] = len(evil)
    body["files"][0]["crc32"] = {
        "chunk": CRC_CHUNK,
        "values": [zlib.crc32(evil[i : i + CRC_CHUNK]) for i in range(0, len(evil), CRC_CHUNK)],
    }
    forged = Manifest.from_json(orjson.dumps({**body, "checksum": _checksum(body)}), url=str(d))
    (d / "manifest.json").write_bytes(forged.to_json())
    with CheckpointStore(str(tmp_path), format=fmt) as store:
        assert store.verify(2).ok  # checksums match: only the content is malicious
        try:  # a format sees the pickle and refuses it, or reads raw bytes: garbage, never code
            store.load({"model": {}}, step=2)
            refused = False
        except CorruptCheckpointError as e:
            assert "pickle" in str(e) and "refusing to unpickle" in str(e), e
            refused = True
        assert refused or fmt != "torch"  # a safetensors file: the torch format notices
        if refused:
            with pytest.warns(UserWarning, match="refusing to unpickle"):
                assert store.load({"model": {}}).step == 1  # falls back past it
    assert not marker.exists()


def _checksum(body: dict[str, object]) -> str:
    return f"crc32:{zlib.crc32(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)):08x}"


def test_manifest_file_names_cannot_escape(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        store.save(1, {"w": torch.ones(2)})
    d = tmp_path / "step-00000001"
    body = orjson.loads((d / "manifest.json").read_bytes())
    body.pop("checksum")
    body["files"][0]["path"] = "../../../etc/passwd"
    with pytest.raises(CorruptCheckpointError, match="not a plain file name"):
        Manifest.from_json(orjson.dumps({**body, "checksum": _checksum(body)}))


def test_an_edited_manifest_is_not_a_checkpoint(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as store:
        store.save(1, {"w": torch.ones(2)})
        store.save(2, {"w": torch.ones(2)})
        m = tmp_path / "step-00000002" / "manifest.json"
        m.write_bytes(m.read_bytes().replace(b'"step": 2', b'"step": 3'))
        assert not store.verify(2).ok
        with pytest.warns(UserWarning, match="manifest checksum mismatch"):
            assert store.load({"w": torch.zeros(2)}).step == 1
