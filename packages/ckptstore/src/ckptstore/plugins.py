"""The one plugin registry of ckptstore, in the style of fsspec's ``registry.py``: the formats
(``formats/__init__.py``) and the storage backends (``storage/registry.py``) are each an instance.

``known`` maps a name to ``{"class": "module:Class", "err": install hint}`` (imported only when
first used); ``register`` adds or replaces one at runtime (a class, or its ``"module:Class"``);
third-party packages declare theirs in the registry's entry-point group::

    [project.entry-points."ckptstore.formats"]
    myformat = "mypkg.ckpt:MyFormat"
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from .errors import CheckpointError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> class. ``kind`` names an entry in messages ("format", "storage"); ``label(name)``
    says what failed to import ("checkpoint format 'x'", "the storage for s3://")."""

    def __init__(
        self,
        kind: str,
        group: str,
        known: dict[str, dict[str, str]],
        label: Callable[[str], str],
    ) -> None:
        self.kind, self.group, self.known, self.label = kind, group, known, label
        self.loaded: dict[str, T] = {}  # imported (or registered as a class) once

    def register(self, name: str, cls: T | str, *, clobber: bool = False, errtxt: str = "") -> None:
        """``cls`` (a class, or ``"module:Class"`` imported when first used) as ``name``;
        ``errtxt``: the install hint when it cannot be imported."""
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{self.kind} name {name!r} must be letters, digits, '-' or '_'")
        if not clobber and self._taken_by_another(name, cls):
            current = self.loaded.get(name) or self.known[name]["class"]
            raise ValueError(
                f"{self.kind} {name!r} is already registered ({current}); pass clobber=True to "
                "replace it"
            )
        if isinstance(cls, str):
            if ":" not in cls:
                raise ValueError(f"{self.kind} class must be 'module:Class', got {cls!r}")
            self.known[name] = {"class": cls, **({"err": errtxt} if errtxt else {})}
            self.loaded.pop(name, None)
        else:
            self.loaded[name] = cls
            if errtxt:
                self.known[name] = {"class": _dotted(cls), "err": errtxt}

    def _taken_by_another(self, name: str, cls: T | str) -> bool:
        current: Any = self.loaded.get(name)
        if current is None and name in self.known:
            current = self.known[name]["class"]
        if current is None:
            return False
        return current is not cls and current != cls and _dotted(current) != _dotted(cls)

    def names(self) -> list[str]:
        """Every name: built in, registered, or declared by an installed package."""
        found = set(self.known) | set(self.loaded)
        found.update(ep.name for ep in entry_points(group=self.group))
        return sorted(found)

    def hint(self, name: str) -> str | None:
        return self.known.get(name, {}).get("err")

    def find(self, name: str) -> T | None:
        """The class registered as ``name`` (imported on first use, then cached); None when
        nobody registered that name."""
        if name in self.loaded:
            return self.loaded[name]
        spec = self.known.get(name)
        target = spec["class"] if spec else None
        if target is None:
            eps = [ep for ep in entry_points(group=self.group) if ep.name == name]
            if not eps:
                return None
            target = eps[0].value
        cls = self.load(target, name)
        self.loaded[name] = cls
        return cls

    def load(self, target: str, name: str) -> T:
        """Import ``"module:Class"``; CheckpointError with the install hint if it cannot be."""
        module_name, _, attr = target.partition(":")
        try:
            cls: T = getattr(importlib.import_module(module_name), attr)
        except ImportError as e:
            hint = self.hint(name) or f"install the package that provides {module_name}"
            raise CheckpointError(f"cannot load {self.label(name)}: {hint} ({e})") from e
        return cls


def _dotted(cls: Any) -> str:
    if isinstance(cls, str):
        return cls
    return f"{cls.__module__}:{getattr(cls, '__qualname__', type(cls).__qualname__)}"
