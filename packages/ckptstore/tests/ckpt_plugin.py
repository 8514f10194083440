"""A third-party storage backend for the tests, apart from ckpt_helpers: the helpers import no
ckptstore (ckpt_open_worker.py uses them where ckptstore cannot be imported); this does."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from ckptstore.storage import LocalStorage


# ------------------------------------------------------------- a third-party backend --
class FolderStorage(LocalStorage):
    """A storage backend as another package would ship one: ``folder://PATH`` is the local
    folder PATH. ckptstore finds it only through the entry point :func:`install_entry_point`
    declares (the ``plugin`` storage kind of the fixtures)."""

    opened: ClassVar[list[str]] = []

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any]) -> FolderStorage:
        cls.opened.append(url)
        return cls(url.removeprefix("folder://"))

    def url(self, path: str) -> str:
        return f"folder://{path}"


def install_entry_point(site: Path, group: str, name: str, value: str) -> None:
    """A distribution in the folder ``site`` (to be put on sys.path) that declares the entry
    point ``name = value`` in ``group``: what ``pip install`` of a plugin package leaves."""
    dist = site / "ckpt_test_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ckpt-test-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\n{name} = {value}\n")
