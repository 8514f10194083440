"""Storage backends: ckptstore's plugin registry (``ckptstore.plugins``, as the formats use),
keyed by URL protocol.

``known_storages`` maps a protocol to ``"module:Class"`` (imported only when first used) plus an
install hint for a missing extra; ``register_storage`` adds or replaces one at runtime;
third-party packages declare theirs in the ``ckptstore.storage`` entry-point group::

    [project.entry-points."ckptstore.storage"]
    myproto = "mypkg.ckpt:MyStorage"

A backend class implements :class:`StorageBackend`: ``from_url(url, storage_options)`` returns a
:class:`~ckptstore.storage.Storage`. A protocol with no backend of its own goes through fsspec
(:class:`~ckptstore.storage.remote.FsspecStorage`): gcs://, az://, hf://, ... work as fsspec
does, without fast paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ..errors import CheckpointError
from ..plugins import Registry

if TYPE_CHECKING:
    from . import Storage

ENTRY_POINT_GROUP = "ckptstore.storage"
LOCAL = "local"  # the protocol of a plain path (no "://")
_S3_HINT = "pip install 'ckptstore[s3]'"

known_storages: dict[str, dict[str, str]] = {
    LOCAL: {"class": "ckptstore.storage.local:LocalStorage"},
    "file": {"class": "ckptstore.storage.local:LocalStorage"},
    "memory": {"class": "ckptstore.storage.remote:FsspecStorage"},
    "s3": {"class": "ckptstore.storage.s3:S3Storage", "err": _S3_HINT},
    "s3a": {"class": "ckptstore.storage.s3:S3Storage", "err": _S3_HINT},
}
FALLBACK = "ckptstore.storage.remote:FsspecStorage"  # any other fsspec protocol


class StorageBackend(Protocol):
    """A storage class, as the registry holds it."""

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any]) -> Storage:
        """The storage rooted at ``url`` (a plain path, or ``PROTOCOL://...``). Raises
        ImportError when a library it needs is missing (the registry adds the install hint),
        ValueError for a URL it cannot use."""
        ...


STORAGES: Registry[StorageBackend] = Registry(
    "storage",
    ENTRY_POINT_GROUP,
    known_storages,
    lambda protocol: f"the storage for {protocol}://",
    ("from_url",),
)


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else LOCAL


def register_storage(
    protocol: str, cls: StorageBackend | str, *, clobber: bool = False, errtxt: str = ""
) -> None:
    """Register ``cls`` (a class, or ``"module:Class"`` imported when first used) for URLs
    ``protocol://...``. ``errtxt``: the install hint when it cannot be imported or opened."""
    STORAGES.register(protocol, cls, clobber=clobber, errtxt=errtxt)


def available_storages() -> list[str]:
    """The protocols with a backend of their own (any other fsspec protocol works too)."""
    return STORAGES.names()


def get_storage(protocol: str) -> StorageBackend:
    """The backend class for ``protocol``; imports it on first use. A protocol nobody
    registered gets the generic fsspec backend (not cached: an entry point may come later)."""
    return STORAGES.find(protocol) or STORAGES.load(FALLBACK, protocol)


def install_hint(protocol: str) -> str | None:
    return STORAGES.hint(protocol)


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage for ``url``: local paths and ``file://`` get the local fast path, ``s3://``
    the S3 one, a registered protocol its backend, anything else fsspec."""
    protocol = protocol_of(url)
    backend = get_storage(protocol)
    try:
        return backend.from_url(url, dict(storage_options or {}))
    except ImportError as e:
        hint = install_hint(protocol) or str(e)
        raise CheckpointError(f"cannot open {url}: {protocol}:// needs an extra: {hint}") from e
    except ValueError as e:
        raise CheckpointError(f"cannot open {url}: {e}") from e
