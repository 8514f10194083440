"""One rule for a checkpoint written by a newer ckptstore (a manifest schema this one does not
know): "latest" is refused everywhere (load, latest_step, verify, list), in one line that says
to upgrade and which older step this ckptstore could load if named; never a silent fallback to
that older step, never a Python warning. An older step named explicitly still loads."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from ckptstore import CheckpointStore, IncompatibleCheckpointError
from ckptstore.cli import main
from ckptstore.manifest import _body_checksum


def from_the_future(root: Path, step: int, schema: int = 99) -> None:
    """Step ``step`` as a newer ckptstore would commit it: a valid manifest of schema 99."""
    with CheckpointStore(str(root)) as store:
        store.save(step, {"w": torch.full((2,), float(step))})
    path = root / f"step-{step:08d}" / "manifest.json"
    body = orjson.loads(path.read_bytes())
    body.pop("checksum")
    body["ckptstore"] = schema
    body["checksum"] = _body_checksum(body)
    path.write_bytes(orjson.dumps(body))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    with CheckpointStore(str(tmp_path)) as store:
        for step in (10, 20):
            store.save(step, {"w": torch.full((2,), float(step))})
    from_the_future(tmp_path, 30)
    return tmp_path


def refusal_ok(text: str) -> None:
    assert "step-00000030 was written by a newer ckptstore (manifest schema 99" in text
    assert "pip install -U ckptstore" in text and "step 20 is the newest this one reads" in text
    assert "falls back" not in text and "\n" not in text.strip()


def test_latest_is_refused_not_passed_over(root: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a single Python warning on the way
        with CheckpointStore(str(root)) as store:
            state: dict[str, Any] = {"w": torch.zeros(2)}
            with pytest.raises(IncompatibleCheckpointError) as e:
                store.load(state)
            refusal_ok(str(e.value))
            assert torch.equal(state["w"], torch.zeros(2))  # nothing loaded
            with pytest.raises(IncompatibleCheckpointError) as e:
                store.latest_step()
            refusal_ok(str(e.value))
            report = store.verify()
            assert not report.ok and report.summary().startswith("NEEDS A NEWER CKPTSTORE")
            refusal_ok(report.problems[0])
            assert store.load(state, step=20).step == 20  # named: loads
            assert float(state["w"][0]) == 20.0
            assert store.list()[-1].step == 20  # listed apart from the broken ones, no warning


def test_the_command_line_says_the_same(root: Path, capsys: Any) -> None:
    assert main(["verify", str(root)]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("NEEDS A NEWER CKPTSTORE") and err == ""
    refusal_ok(out)
    assert main(["list", str(root)]) == 1
    out, err = capsys.readouterr()
    assert "30 (latest)  NEWER" in out and "needs a newer ckptstore" in out
    assert err.count("\n") == 1 and "schema 99" in err
    assert main(["verify", str(root), "--step", "20"]) == 0
    capsys.readouterr()


def test_an_older_step_from_a_newer_ckptstore_is_not_latest(tmp_path: Path) -> None:
    """A newer ckptstore wrote step 5, this one went on from scratch: latest is this one's."""
    from_the_future(tmp_path, 5)
    with CheckpointStore(str(tmp_path)) as store:
        store.save(8, {"w": torch.ones(2)})
        assert store.latest_step() == 8
        assert store.verify().ok
        with pytest.raises(IncompatibleCheckpointError, match="newer ckptstore"):
            store.load({"w": torch.zeros(2)}, step=5)
