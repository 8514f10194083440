"""Checkpoints written by an older ckptstore keep loading, bitwise.

The fixtures under tests/fixtures/ were written by the revision named in each folder's
REVISION file (regenerate with fixtures/make_fixtures.py); ``expected.pt`` holds the same values
as a plain torch.save file.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import assert_same_state

from ckptstore import CheckpointStore

FIXTURES = Path(__file__).resolve().parent / "fixtures"
KINDS = ["torch", "dcp", "dcp-2ranks"]


@pytest.fixture(params=sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()))
def release(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A writable copy of one release's fixtures (a store may tidy up what it opens)."""
    copy = tmp_path / request.param
    shutil.copytree(FIXTURES / request.param, copy)
    return copy


@pytest.mark.parametrize("kind", KINDS)
def test_an_old_checkpoint_reads_bitwise(release: Path, kind: str) -> None:
    expected = torch.load(release / "expected.pt", weights_only=True)
    with CheckpointStore(str(release / kind), distributed=False) as store:
        report = store.verify()
        assert report.ok, report.summary()
        manifest, values = store.read()
    assert manifest.step == 3 and manifest.metadata == {"note": "fixture"}
    assert_same_state(expected, values)


@pytest.mark.parametrize("kind", KINDS)
def test_an_old_checkpoint_loads_into_objects(release: Path, kind: str) -> None:
    expected = torch.load(release / "expected.pt", weights_only=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state: dict[str, Any] = {"model": model, "optim": opt, "step": 0}
    with CheckpointStore(str(release / kind), distributed=False) as store:
        assert store.load(state).step == 3
    assert state["step"] == 3
    assert_same_state(expected, {"model": model, "optim": opt}, keys=["model"])
    assert_same_state(expected["optim"], opt.state_dict(), keys=["state"])
    assert opt.param_groups[0]["lr"] == 0.5


def test_the_fixtures_say_which_code_wrote_them() -> None:
    for release in FIXTURES.iterdir():
        if release.is_dir():
            assert len((release / "REVISION").read_text().strip()) == 40, release
