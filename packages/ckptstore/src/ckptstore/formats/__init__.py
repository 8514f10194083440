"""Checkpoint formats: ckptstore's plugin registry (``ckptstore.plugins``), keyed by name.

``known_formats`` maps a name to ``"module:Class"`` (imported only when first used) plus an
install hint for a missing extra; ``register_format`` adds or replaces one at runtime; third-party
packages declare theirs in the ``ckptstore.formats`` entry-point group::

    [project.entry-points."ckptstore.formats"]
    myformat = "mypkg.ckpt:MyFormat"

A format implements :class:`CheckpointFormat`: ``stage`` (foreground, on every rank: decide what
to write and, for async saves, snapshot it), ``persist`` (possibly in a background thread: write
this rank's payload, then on the coordinator call ``ctx.commit`` once every rank's payload is
durable), ``load`` and ``describe``. Its traits are class attributes: ``takes_dtensor`` (default
True; see :func:`takes_dtensor`) says whether it saves DTensors as they are, sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..buffers import Arena
from ..errors import CheckpointError
from ..manifest import FileEntry, Manifest
from ..plugins import Registry
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


def takes_dtensor(fmt: object) -> bool:
    """Does ``fmt`` save a DTensor as it is (each rank its shard: DCP), or must every tensor be
    whole (one file written by rank 0: ``torch``, whose class says ``takes_dtensor = False``)?
    A format that does not say takes them: only a format that writes on one rank cannot."""
    return bool(getattr(fmt, "takes_dtensor", True))


FORMATS: Registry[type[CheckpointFormat]] = Registry(
    "format",
    ENTRY_POINT_GROUP,
    known_formats,
    lambda name: f"checkpoint format {name!r}",
    ("stage", "writes_on", "persist", "load", "describe"),
)


def register_format(
    name: str, cls: type[CheckpointFormat] | str, *, clobber: bool = False, errtxt: str = ""
) -> None:
    """Register ``cls`` (a class, or ``"module:Class"`` imported when first used) as ``name``."""
    FORMATS.register(name, cls, clobber=clobber, errtxt=errtxt)


def available_formats() -> list[str]:
    return FORMATS.names()


def get_format(name: str) -> type[CheckpointFormat]:
    """The class registered as ``name``; imports it on first use."""
    cls = FORMATS.find(name)
    if cls is None:
        raise CheckpointError(
            f"unknown checkpoint format {name!r}; available: {', '.join(available_formats())}"
            f" (third-party formats register under the {ENTRY_POINT_GROUP!r} entry points)"
        )
    return cls
