"""Checkpoint formats: a registry in the style of fsspec's ``registry.py``.

``known_formats`` maps a name to ``"module:Class"`` (imported only when first used) plus an
install hint for a missing extra; ``register_format`` adds or replaces one at runtime; third-party
packages declare theirs in the ``ckptstore.formats`` entry-point group::

    [project.entry-points."ckptstore.formats"]
    myformat = "mypkg.ckpt:MyFormat"

A format implements :class:`CheckpointFormat`: ``stage`` (foreground, on every rank: decide what
to write and, for async saves, snapshot it), ``persist`` (possibly in a background thread: write
this rank's payload, then on the coordinator call ``ctx.commit`` once every rank's payload is
durable), ``load`` and ``describe``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from ..buffers import Arena
from ..errors import CheckpointError
from ..manifest import FileEntry, Manifest
from ..storage import IOEngine, Storage
from ..tree import EncodedState

ENTRY_POINT_GROUP = "ckptstore.formats"

known_formats: dict[str, dict[str, str]] = {
    "torch": {"class": "ckptstore.formats.torchfile:TorchFormat"},
    "dcp": {
        "class": "ckptstore.formats.dcp:DCPFormat",
        "err": "the 'dcp' format needs torch.distributed.checkpoint (a torch build with "
        "distributed support, torch>=2.4)",
    },
}
_registry: dict[str, type[CheckpointFormat]] = {}


@dataclass(kw_only=True, slots=True)
class SaveContext:
    """Everything a format needs to write one checkpoint from one rank."""

    storage: Storage
    step_dir: str
    step: int
    token: str  # unique per save, part of every payload file name
    rank: int
    world_size: int
    group: Any  # a dedicated gloo ProcessGroup, or None outside torch.distributed
    io: IOEngine
    arena: Arena
    background: bool
    commit: Callable[[Sequence[FileEntry], dict[str, Any]], None]


@dataclass(kw_only=True, slots=True)
class LoadContext:
    storage: Storage
    step_dir: str
    rank: int
    world_size: int
    group: Any
    io: IOEngine
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class CheckpointFormat(Protocol):
    name: str

    def stage(self, enc: EncodedState | None, ctx: SaveContext) -> Any:
        """Foreground. ``enc`` is None on ranks that ``writes_on`` says do not write. For a
        background save, copy what will be written so the caller may change it right away."""
        ...

    def writes_on(self, rank: int, world_size: int) -> bool:
        """Whether ``rank`` takes part in writing (the 'torch' format: rank 0 only)."""
        ...

    def persist(self, staged: Any, ctx: SaveContext) -> None:
        """Create ``ctx.step_dir`` and write this rank's payload there; the coordinator calls
        ``ctx.commit(files, format_data)`` exactly once, after every rank's payload is durable.
        Under torch.distributed, a failure must reach every rank (DCP's collectives do that)."""
        ...

    def load(
        self, manifest: Manifest, ctx: LoadContext, keys: Sequence[str], like: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Read and verify what ``keys`` need; return ``{key: decoded value}`` (tensors on CPU).
        ``like`` is the caller's state (for in-place targets such as sharded tensors)."""
        ...

    def describe(self, manifest: Manifest, ctx: LoadContext) -> dict[str, Any]:
        """``{"tree": ..., "types": ..., "tensors": [{key, dtype, shape, nbytes, file}]}``."""
        ...


def register_format(
    name: str, cls: type[CheckpointFormat] | str, *, clobber: bool = False, errtxt: str = ""
) -> None:
    """Register ``cls`` (a class, or ``"module:Class"`` imported when first used) as ``name``."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"format name {name!r} must be letters, digits, '-' or '_'")
    taken = name in _registry or name in known_formats
    if taken and not clobber:
        current = _registry.get(name) or known_formats[name]["class"]
        if current is not cls and current != cls:
            raise ValueError(
                f"format {name!r} is already registered ({current}); pass clobber=True to replace"
            )
    if isinstance(cls, str):
        if ":" not in cls:
            raise ValueError(f"format class must be 'module:Class', got {cls!r}")
        known_formats[name] = {"class": cls, **({"err": errtxt} if errtxt else {})}
        _registry.pop(name, None)
    else:
        _registry[name] = cls


def available_formats() -> list[str]:
    names = set(known_formats) | set(_registry)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def get_format(name: str) -> type[CheckpointFormat]:
    """The class registered as ``name``; imports it on first use."""
    if name in _registry:
        return _registry[name]
    spec = known_formats.get(name)
    target = spec["class"] if spec else None
    if target is None:
        eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not eps:
            raise CheckpointError(
                f"unknown checkpoint format {name!r}; available: {', '.join(available_formats())}"
                f" (third-party formats register under the {ENTRY_POINT_GROUP!r} entry points)"
            )
        target = eps[0].value
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except ImportError as e:
        hint = (spec or {}).get("err") or f"install the package that provides {module_name}"
        raise CheckpointError(f"cannot load checkpoint format {name!r}: {hint} ({e})") from e
    _registry[name] = cls
    return cls
