"""The format and storage registries: names, lazy classes, entry points, helpful errors."""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import STORAGES
from ckpt_plugin import FolderStorage

from ckptstore import (
    CheckpointError,
    CheckpointStore,
    available_formats,
    available_storages,
    get_format,
    get_storage,
    open_storage,
    register_format,
    register_storage,
)
from ckptstore.formats import ENTRY_POINT_GROUP, CheckpointFormat
from ckptstore.formats.torchfile import TorchFormat
from ckptstore.storage import FsspecStorage, LocalStorage
from ckptstore.storage import registry as storage_registry
from ckptstore.storage.s3 import S3Storage


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
    import ckptstore.plugins as plugins

    ep = importlib.metadata.EntryPoint(
        name="thirdparty", value="ckptstore.formats.torchfile:TorchFormat", group=ENTRY_POINT_GROUP
    )
    real = plugins.entry_points

    def fake(**kw: str) -> list[importlib.metadata.EntryPoint]:
        return [ep, *real(**kw)] if kw.get("group") == ENTRY_POINT_GROUP else list(real(**kw))

    monkeypatch.setattr(plugins, "entry_points", fake)
    monkeypatch.delitem(formats.FORMATS.loaded, "thirdparty", raising=False)
    assert "thirdparty" in available_formats()
    with CheckpointStore(str(tmp_path), format="thirdparty") as store:
        store.save(1, {"x": torch.ones(2)})
        assert store.manifest(1).format == "thirdparty"
    assert formats.FORMATS.loaded.pop("thirdparty") is TorchFormat  # imported once, then cached


# -- storage backends: the same registry, keyed by URL protocol ----------------------------------

BACKENDS = {
    "local": "LocalStorage",
    "file": "LocalStorage",
    "memory": "FsspecStorage",
    "s3": "S3Storage",
    "plugin": "FolderStorage",
}


@pytest.mark.parametrize("storage", STORAGES, indirect=True)
def test_each_storage_kind_is_served_by_its_backend(
    storage: tuple[str, dict[str, Any]], request: pytest.FixtureRequest
) -> None:
    """What the contract suite runs on, kind by kind: the class the registry picks."""
    url, opts = storage
    kind = request.node.callspec.params["storage"]
    assert type(open_storage(url, opts)).__name__ == BACKENDS[kind]


def test_builtin_storages_are_registered_lazily() -> None:
    assert {"local", "file", "memory", "s3", "s3a"} <= set(available_storages())
    assert get_storage("file") is LocalStorage and get_storage("local") is LocalStorage
    assert get_storage("s3") is S3Storage and issubclass(S3Storage, FsspecStorage)
    assert get_storage("gcs") is FsspecStorage  # any other fsspec protocol: the generic one
    assert "gcs" not in storage_registry.STORAGES.loaded  # not cached: a plugin may come later


def test_a_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """s3:// without s3fs: fsspec cannot import it; the line says which extra to install."""
    fsspec_registry = importlib.import_module("fsspec.registry")  # the module, not the mapping
    monkeypatch.delitem(fsspec_registry._registry, "s3", raising=False)
    broken = {"class": "no_such_s3fs.S3FileSystem", "err": "Install s3fs to access S3"}
    monkeypatch.setitem(fsspec_registry.known_implementations, "s3", broken)
    hint = r"cannot open s3://bucket/run: s3:// needs an extra: pip install 'ckptstore\[s3\]'"
    with pytest.raises(CheckpointError, match=hint):
        open_storage("s3://bucket/run")


def test_lazy_string_registration_of_a_storage_with_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = storage_registry.STORAGES
    monkeypatch.setattr(registry, "known", dict(registry.known))
    monkeypatch.setattr(registry, "loaded", dict(registry.loaded))
    register_storage("ghost", "not_installed_pkg.st:Ghost", errtxt="pip install ghost-store")
    with pytest.raises(CheckpointError, match="ghost://: pip install ghost-store"):
        CheckpointStore("ghost://bucket/run")
    with pytest.raises(ValueError, match="already registered"):
        register_storage("s3", "x.y:Z")
    register_storage("s3", "ckptstore.storage.s3:S3Storage")  # the same class: no error
    with pytest.raises(ValueError, match="letters, digits"):
        register_storage("a/b", LocalStorage)
    register_storage("disk", LocalStorage)  # a class object, used as is
    with CheckpointStore(f"disk://{tmp_path}/ckpt") as store:
        store.save(1, {"x": torch.ones(2)})
        assert store.load({"x": torch.zeros(2)}).step == 1
    assert (tmp_path / "ckpt" / "step-00000001" / "manifest.json").is_file()


def test_a_third_party_storage_is_found_through_its_entry_point(
    folder_backend: type[FolderStorage], tmp_path: Path
) -> None:
    """A package that declares ``[project.entry-points."ckptstore.storage"]`` needs no import
    or register_storage call by the user: the URL's protocol alone finds it."""
    eps = importlib.metadata.entry_points(group=storage_registry.ENTRY_POINT_GROUP)
    assert [ep.value for ep in eps if ep.name == "folder"] == ["ckpt_plugin:FolderStorage"]
    assert "folder" in available_storages()
    with CheckpointStore(f"folder://{tmp_path}/ckpt", experiment="e") as store:
        store.save(3, {"x": torch.ones(2)})
        assert store.url == f"folder://{tmp_path}/ckpt/e"
    assert (tmp_path / "ckpt" / "e" / "step-00000003" / "manifest.json").is_file()
    assert get_storage("folder") is folder_backend
    assert f"folder://{tmp_path}/ckpt" in folder_backend.opened


def test_no_backend_branches_on_the_kind_of_filesystem() -> None:
    """S3's behaviour lives in S3Storage: neither the generic backend nor open_storage asks
    which filesystem it has (issue 23: eight `is_s3` branches and an if/else before)."""
    src = Path(storage_registry.__file__).parent
    for name in ("remote.py", "registry.py", "__init__.py", "../plugins.py"):
        text = (src / name).read_text()
        assert "is_s3" not in text and "S3FileSystem" not in text, name


def test_formats_and_storages_share_one_registry_implementation() -> None:
    """Issue 29: the registry code was written twice (formats and storage); both are now an
    instance of ckptstore.plugins.Registry, and neither module imports importlib itself."""
    from ckptstore import plugins
    from ckptstore.formats import FORMATS

    assert isinstance(FORMATS, plugins.Registry)
    assert isinstance(storage_registry.STORAGES, plugins.Registry)
    src = Path(storage_registry.__file__).parents[1]
    for name in ("formats/__init__.py", "storage/registry.py"):
        text = (src / name).read_text()
        assert "import importlib" not in text and "entry_points(" not in text, name
