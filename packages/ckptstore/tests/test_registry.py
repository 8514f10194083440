"""The format registry: names, lazy classes, entry points, helpful errors."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

from ckptstore import (
    CheckpointError,
    CheckpointStore,
    available_formats,
    get_format,
    register_format,
)
from ckptstore.formats import ENTRY_POINT_GROUP, CheckpointFormat
from ckptstore.formats.torchfile import TorchFormat


def test_builtin_formats_and_declared_entry_points_agree() -> None:
    assert {"torch", "dcp"} <= set(available_formats())
    assert get_format("torch") is TorchFormat
    assert isinstance(get_format("dcp")(), CheckpointFormat)
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert eps.get("torch") == "ckptstore.formats.torchfile:TorchFormat"
    assert eps.get("dcp") == "ckptstore.formats.dcp:DCPFormat"


def test_unknown_format_lists_the_available_ones() -> None:
    with pytest.raises(CheckpointError, match="unknown checkpoint format 'nope'.*torch"):
        CheckpointStore("/tmp/never-created", format="nope")


def test_lazy_string_registration_with_install_hint(tmp_path: Path) -> None:
    register_format("ghost", "not_installed_pkg.fmt:Ghost", errtxt="pip install ghost-ckpt")
    with pytest.raises(CheckpointError, match="pip install ghost-ckpt"):
        get_format("ghost")
    with pytest.raises(ValueError, match="already registered"):
        register_format("torch", "x.y:Z")
    register_format("torch2", "ckptstore.formats.torchfile:TorchFormat")
    with CheckpointStore(str(tmp_path), format="torch2") as store:
        store.save(1, {"x": torch.ones(2)})
        assert store.manifest(1).format == "torch2"
        assert store.load({"x": torch.zeros(2)}).step == 1


def test_a_third_party_format_is_found_through_its_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package that declares ``[project.entry-points."ckptstore.formats"]`` needs no import
    or register_format call by the user: the name alone works."""
    import ckptstore.formats as formats

    ep = importlib.metadata.EntryPoint(
        name="thirdparty", value="ckptstore.formats.torchfile:TorchFormat", group=ENTRY_POINT_GROUP
    )
    real = formats.entry_points

    def fake(**kw: str) -> list[importlib.metadata.EntryPoint]:
        return [ep, *real(**kw)] if kw.get("group") == ENTRY_POINT_GROUP else list(real(**kw))

    monkeypatch.setattr(formats, "entry_points", fake)
    monkeypatch.delitem(formats._registry, "thirdparty", raising=False)
    assert "thirdparty" in available_formats()
    with CheckpointStore(str(tmp_path), format="thirdparty") as store:
        store.save(1, {"x": torch.ones(2)})
        assert store.manifest(1).format == "thirdparty"
    assert formats._registry.pop("thirdparty") is TorchFormat  # imported once, then cached
