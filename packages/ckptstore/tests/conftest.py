"""Fixtures: every storage kind (local path, file://, memory://, s3:// on a real moto_server,
and a third-party backend found through its entry point)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from ckpt_helpers import s3server  # importable: the tests folder is on pytest's `pythonpath`
from ckpt_plugin import FolderStorage, install_entry_point

from ckptstore.storage import registry


def require_or_skip(env: str, why: str) -> None:
    if os.environ.get(env) == "1":
        pytest.fail(f"{why} (and {env}=1 says it is required)")
    pytest.skip(why)


@pytest.fixture(scope="session")
def moto() -> Iterator[Any]:
    why = s3server.unavailable_reason()
    if why is not None:
        require_or_skip("PYRECOVER_REQUIRE_S3", why)
    try:
        import s3fs  # noqa: F401
    except ImportError:
        require_or_skip("PYRECOVER_REQUIRE_S3", "s3fs missing: pip install 'ckptstore[s3]'")
    with s3server.MotoServer() as server:
        server.make_bucket("ckpt")
        yield server


@pytest.fixture(scope="session")
def folder_backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[type[FolderStorage]]:
    """``folder://`` served by :class:`FolderStorage`, declared only as an entry point of a
    distribution on sys.path (as a pip-installed plugin package is)."""
    site = tmp_path_factory.mktemp("site")
    install_entry_point(site, registry.ENTRY_POINT_GROUP, "folder", "ckpt_plugin:FolderStorage")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        yield FolderStorage
    registry.STORAGES.loaded.pop("folder", None)


@pytest.fixture
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(url, storage_options) of an empty checkpoint root of the requested kind."""
    kind = getattr(request, "param", "local")
    tag = uuid.uuid4().hex[:10]
    if kind == "local":
        yield str(tmp_path / "ckpt"), {}
    elif kind == "file":
        yield f"file://{tmp_path}/ckpt", {}
    elif kind == "memory":
        url = f"memory://ckpt-{tag}"
        yield url, {}
        fs = fsspec.filesystem("memory")
        if fs.exists(url):
            fs.rm(url, recursive=True)
    elif kind == "s3":
        server = request.getfixturevalue("moto")
        yield f"s3://ckpt/{tag}", server.storage_options()
    elif kind == "plugin":
        request.getfixturevalue("folder_backend")
        yield f"folder://{tmp_path}/ckpt", {}
    else:
        raise ValueError(kind)
