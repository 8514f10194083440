"""Storage backends: a registry in the style of fsspec's ``registry.py`` (and of ckptstore's
formats), keyed by URL protocol.

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

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import CheckpointError

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
_registry: dict[str, StorageBackend] = {}


class StorageBackend(Protocol):
    """A storage class, as the registry holds it."""

    @classmethod
    def from_url(cls, url: str, storage_options: dict[str, Any]) -> Storage:
        """The storage rooted at ``url`` (a plain path, or ``PROTOCOL://...``). Raises
        ImportError when a library it needs is missing (the registry adds the install hint),
        ValueError for a URL it cannot use."""
        ...


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else LOCAL


def register_storage(
    protocol: str, cls: StorageBackend | str, *, clobber: bool = False, errtxt: str = ""
) -> None:
    """Register ``cls`` (a class, or ``"module:Class"`` imported when first used) for URLs
    ``protocol://...``. ``errtxt``: the install hint when it cannot be imported or opened."""
    if not protocol or not protocol.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"storage protocol {protocol!r} must be letters, digits, '-' or '_'")
    if not clobber and _taken_by_another(protocol, cls):
        current = _registry.get(protocol) or known_storages[protocol]["class"]
        raise ValueError(
            f"storage {protocol!r} is already registered ({current}); pass clobber=True to replace"
        )
    if isinstance(cls, str):
        if ":" not in cls:
            raise ValueError(f"storage class must be 'module:Class', got {cls!r}")
        known_storages[protocol] = {"class": cls, **({"err": errtxt} if errtxt else {})}
        _registry.pop(protocol, None)
    else:
        _registry[protocol] = cls
        if errtxt:
            known_storages[protocol] = {"class": _dotted(cls), "err": errtxt}


def _taken_by_another(protocol: str, cls: StorageBackend | str) -> bool:
    current: StorageBackend | str | None = _registry.get(protocol)
    if current is None and protocol in known_storages:
        current = known_storages[protocol]["class"]
    if current is None:
        return False
    return current is not cls and current != cls and _dotted(current) != _dotted(cls)


def _dotted(cls: StorageBackend | str) -> str:
    if isinstance(cls, str):
        return cls
    return f"{cls.__module__}:{getattr(cls, '__qualname__', type(cls).__qualname__)}"


def available_storages() -> list[str]:
    """The protocols with a backend of their own (any other fsspec protocol works too)."""
    names = set(known_storages) | set(_registry)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def get_storage(protocol: str) -> StorageBackend:
    """The backend class for ``protocol``; imports it on first use. A protocol nobody
    registered gets the generic fsspec backend."""
    if protocol in _registry:
        return _registry[protocol]
    spec = known_storages.get(protocol)
    target = spec["class"] if spec else None
    if target is None:
        eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == protocol]
        if not eps:
            return _load(FALLBACK, protocol)  # not cached: an entry point may come later
        target = eps[0].value
    cls = _load(target, protocol)
    _registry[protocol] = cls
    return cls


def _load(target: str, protocol: str) -> StorageBackend:
    module_name, _, attr = target.partition(":")
    try:
        cls: StorageBackend = getattr(importlib.import_module(module_name), attr)
        return cls
    except ImportError as e:
        hint = install_hint(protocol) or f"install the package that provides {module_name}"
        raise CheckpointError(f"cannot load the storage for {protocol}://: {hint} ({e})") from e


def install_hint(protocol: str) -> str | None:
    return known_storages.get(protocol, {}).get("err")


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
